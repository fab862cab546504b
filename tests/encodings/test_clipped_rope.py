"""Clipped RoPE (``clipped_rope``) against the CoPE reference (hrlics/CoPE ``modeling_cope.py``), restated
here on its own: HF's frequencies, then ``inv_freq[n - c:] *= 0.5 * (1 + cos(linspace(0, π, c)))``
(``c = clip_low_n``), applied after the scaling's init function and again after a dynamic
recomputation; the auto-sized ``c`` of mlx-lm PR 1387 (the pairs whose period ``2π / θ`` exceeds the
trained length; the PR's hand-checked figure: 10 of 32 pairs for base 1e7, 64 rotary channels,
262,144 positions); and the rotation of q and k with those frequencies, HF's ``rotate_half`` form, in
float64.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc


def _hf_inv_freq(base: float, dim: int) -> torch.Tensor:
    """HF's default frequencies (``_compute_default_rope_parameters``), written here."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _reference_clip(inv_freq: torch.Tensor, clip_low_n: int) -> torch.Tensor:
    """hrlics/CoPE's ``LlamaRotaryEmbedding.__init__`` (use_cope), restated."""
    freq_dim = inv_freq.numel()
    clip = min(clip_low_n, freq_dim)
    inv_freq = inv_freq.clone()
    if clip > 0:
        theta = torch.linspace(0.0, torch.pi, steps=clip, dtype=torch.float32)
        inv_freq[freq_dim - clip :] = inv_freq[freq_dim - clip :] * (0.5 * (1.0 + torch.cos(theta)))
    return inv_freq


def _auto_clip(inv_freq: torch.Tensor, trained: int) -> int:
    """mlx-lm PR 1387's auto size: every pair whose period exceeds the trained length."""
    return sum(1 for f in inv_freq.tolist() if f == 0 or 2 * math.pi / f > trained)


def test_the_frequencies_equal_the_reference_with_its_clip_of_20():
    encoding = posenc.build("clipped_rope:clip_pairs=20", head_dim=128)
    want = _reference_clip(_hf_inv_freq(10000.0, 128), 20)
    torch.testing.assert_close(encoding.inv_freq, want, rtol=0, atol=0)
    assert encoding.inv_freq[-21] == _hf_inv_freq(10000.0, 128)[-21]  # the pair before the clip: untouched
    assert encoding.inv_freq[-20] == _hf_inv_freq(10000.0, 128)[-20]  # the boundary pair: taper 1
    assert encoding.inv_freq[-1] == 0  # the slowest: frozen


def test_the_auto_clip_counts_the_pairs_whose_period_exceeds_the_trained_length():
    encoding = posenc.build("clipped_rope:trained_length=262144,base=10000000", head_dim=64)
    assert encoding.clipped(_hf_inv_freq(1e7, 64)) == 10  # the PR's figure for Qwen3.5-family configs
    want = _reference_clip(_hf_inv_freq(1e7, 64), _auto_clip(_hf_inv_freq(1e7, 64), 262144))
    torch.testing.assert_close(encoding.inv_freq, want, rtol=0, atol=0)
    short = posenc.build("clipped_rope:trained_length=64", head_dim=16)
    assert short.clipped(_hf_inv_freq(10000.0, 16)) == _auto_clip(_hf_inv_freq(10000.0, 16), 64) == 5


def test_the_rotation_is_hf_s_with_the_clipped_frequencies():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 11, 32, dtype=torch.float64), torch.randn(2, 3, 11, 32, dtype=torch.float64)
    positions = torch.tensor([[0, 5, 9, 100, 250, 900, 1500, 2047, 3000, 4000, 7000]] * 2)
    encoding = posenc.build("clipped_rope:trained_length=512", head_dim=32)
    got_q, got_k = encoding.rotate(q, k, positions, positions)
    inv_freq = _reference_clip(_hf_inv_freq(10000.0, 32), _auto_clip(_hf_inv_freq(10000.0, 32), 512))
    # HF's float32 angles (inv_freq @ positions), then cos and sin, applied in float64
    angles = (inv_freq[None, :, None].float() @ positions[:, None, :].float()).transpose(1, 2)
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().double()[:, None], emb.sin().double()[:, None]

    def rotate_half(x):
        return torch.cat([-x[..., 16:], x[..., :16]], dim=-1)

    torch.testing.assert_close(got_q, q * cos + rotate_half(q) * sin, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, k * cos + rotate_half(k) * sin, rtol=1e-6, atol=1e-6)


def test_after_yarn_the_taper_acts_on_hf_s_yarn_frequencies():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024},
    )  # fmt: skip
    hf, scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    spec = "clipped_rope:clip_pairs=6,scaling=yarn,factor=4,original_max_position_embeddings=1024"
    encoding = posenc.build(spec, head_dim=32)
    torch.testing.assert_close(encoding.inv_freq, _reference_clip(hf, 6), rtol=1e-6, atol=0)
    assert encoding.attention_scale == pytest.approx(scale)


def test_a_dynamic_recomputation_is_clipped_again():
    """The reference re-applies the mask after ``_dynamic_frequency_update``."""
    spec = "clipped_rope:clip_pairs=3,scaling=dynamic,factor=2,max_position_embeddings=64"
    encoding = posenc.build(spec, head_dim=16)
    plain = posenc.build("rope:scaling=dynamic,factor=2,max_position_embeddings=64", head_dim=16)
    q = k = torch.randn(1, 1, 200, 16)
    positions = torch.arange(200)[None]
    encoding.rotate(q, k, positions, positions)
    plain.rotate(q, k, positions, positions)
    assert not torch.equal(plain.inv_freq, _hf_inv_freq(10000.0, 16))  # the dynamic base moved
    torch.testing.assert_close(encoding.inv_freq, _reference_clip(plain.inv_freq, 3), rtol=0, atol=0)


def test_hard_clipping_one_pair_and_none():
    base = _hf_inv_freq(10000.0, 16)
    hard = posenc.build("clipped_rope:clip_pairs=3,hard=true", head_dim=16)
    torch.testing.assert_close(hard.inv_freq, torch.cat([base[:5], torch.zeros(3)]), rtol=0, atol=0)
    torch.testing.assert_close(posenc.build("clipped_rope:clip_pairs=1", head_dim=16).inv_freq, base)
    torch.testing.assert_close(posenc.build("clipped_rope:clip_pairs=0", head_dim=16).inv_freq, base)
    long = posenc.build("clipped_rope:trained_length=100000000", head_dim=16)
    torch.testing.assert_close(long.inv_freq, base)  # no period is that long: nothing clipped


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("clipped_rope", "needs trained_length .* or clip_pairs"),
        ("clipped_rope:clip_pairs=9", r"clip_pairs must be in \[0, 8\]"),
        ("clipped_rope:clip_pairs=-1", "clip_pairs"),
        ("clipped_rope:trained_length=0", "trained_length"),
        ("clipped_rope:trained_length=64,hard=maybe", "hard"),
    ],
)
def test_bad_options_are_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        posenc.build(spec, head_dim=16)
