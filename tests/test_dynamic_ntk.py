"""Dynamic NTK against reports of other implementations (issue 49 item 10).

Expected values: the formula ``b' = b · (s·L'/L − (s − 1))^(d/(d − 2))``, ``L' = max(seq_len, L)``,
written here, and HF's ``_compute_dynamic_ntk_parameters`` on a tiny config (no downloads).
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
import posenc.functional as F


def _dynamic_inv_freq(base: float, dim: int, factor: float, trained: int, seq_len: int) -> torch.Tensor:
    """The dynamic-NTK formula (bloc97 / emozilla, as HF states it), in float64."""
    longest = max(seq_len, trained)
    scaled = base * (factor * longest / trained - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / scaled ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def _rotate_half(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """HF's ``x·cos + rotate_half(x)·sin`` for ``x [B, H, T, D]``, ``positions [T]``, in float64."""
    angles = positions.double()[:, None] * inv_freq.double()[None]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.double() * cos + rotated.double() * sin).to(x.dtype)


NOMIC = {"base": 1000.0, "head_dim": 64, "factor": 2.0, "served": 512, "trained": 2048}


@pytest.mark.parametrize("seq_len", [None, 1, 100, 512, 1000, 2048, 4096])
def test_a_served_length_below_the_trained_one_does_not_scale(seq_len):
    """vLLM issue 52665 (nomic-embed-text-v1 served at 512, trained at 2048, factor 2): vLLM's
    ``2·512/2048 − 1 = −0.5`` made the base negative, a fractional power of it complex, then 1e38
    and nan. Here the larger of the two lengths is the trained one: no scaling up to 2048."""
    n = NOMIC
    scaling = {
        "rope_type": "dynamic",
        "factor": n["factor"],
        "original_max_position_embeddings": n["trained"],
        "max_position_embeddings": n["served"],
    }
    got, scale = F.rope_inv_freq(n["head_dim"], n["base"], scaling, seq_len=seq_len)
    want = _dynamic_inv_freq(n["base"], n["head_dim"], n["factor"], n["trained"], seq_len or 1)
    assert torch.isfinite(got).all() and scale == 1.0
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_dynamic_matches_hf_at_and_past_the_trained_length():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters

    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0},
    )
    for seq_len in (100, 2048, 4096, 10000):
        want, _ = _compute_dynamic_ntk_parameters(config, "cpu", seq_len=seq_len)
        got, _ = F.rope_inv_freq(
            64, 1000.0, {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 2048}, seq_len
        )
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def _layer_rope(trained: int = 16, factor: float = 2.0, cache_size: int = 2048):
    return posenc.build(
        f"rope:scaling=dynamic,factor={factor},original_max_position_embeddings={trained},cache_size={cache_size}",
        head_dim=8,
    )


def test_after_a_long_call_a_short_one_equals_a_fresh_module():
    """HF PR 46624: HF's dynamic update kept the grown frequencies after a long call until a call fell
    below the original length, so a shorter call rotated unlike a fresh module. Here every call uses
    its own length: below and above the trained length, the second call equals a fresh module's."""
    torch.manual_seed(0)
    for short in (8, 24):
        rope = _layer_rope()
        long_q = torch.randn(1, 2, 64, 8)
        rope.rotate(long_q, long_q, torch.arange(64)[None], torch.arange(64)[None])
        q = torch.randn(1, 2, short, 8)
        pos = torch.arange(short)[None]
        after_long, _ = rope.rotate(q, q, pos, pos)
        fresh, _ = _layer_rope().rotate(q, q, pos, pos)
        torch.testing.assert_close(after_long, fresh, rtol=0, atol=0)
        want = _rotate_half(q, pos[0], _dynamic_inv_freq(10000.0, 8, 2.0, 16, short))
        torch.testing.assert_close(after_long, want, rtol=1e-5, atol=1e-5)


def test_positions_past_factor_times_the_trained_length_are_rotated_by_the_formula():
    """vLLM PR 55910: vLLM's cache held ``factor × max_position_embeddings`` positions, and a longer
    sequence read past it. Here the tables grow: position 200 of a model trained at 16 with factor 2
    (cache built for 32 rows) gets the formula's rotation at the call's length 201."""
    torch.manual_seed(0)
    rope = _layer_rope(trained=16, factor=2.0, cache_size=32)
    q = torch.randn(1, 1, 201, 8)
    pos = torch.arange(201)[None]
    got, _ = rope.rotate(q, q, pos, pos)
    want = _rotate_half(q, pos[0], _dynamic_inv_freq(10000.0, 8, 2.0, 16, 201))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(got.abs().max()))
