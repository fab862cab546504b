"""ReRoPE and Leaky ReRoPE against bojone/rerope's patches, restated here on their own.

The references are the patches' two recipes, written again with HF's RoPE tables
(:mod:`_piecewise_rope`): the prefill's two logits merged by ``torch.where(|i - j| < w, ...)``
(``rerope_patch.py``: far queries rotated at ``w``, keys unrotated; ``leaky_rerope_patch.py``: a
second, linearly scaled RoPE at ``position + w·(k - 1)`` for queries and ``position`` for keys) and
the decode step's relative rotation of the keys (``(i - j).clip(max=w)``; the leaky table joined
from the two). posenc's logits equal both in float64 on every pair a causal decoder reads.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from _piecewise_rope import (
    EXACT,
    HEAD_DIM,
    THETA,
    cached_generate_equals_full_pass,
    cached_pieces,
    causal_part,
    hf_cos_sin,
    hf_ids,
    layer,
    max_diff,
    output_from_logits,
    plain_rope_output,
    qk,
    rope,
    rotate_half,
    smollm2_checks,
    swapped_equals_hf,
    tiny_llama,
)

SCALE = HEAD_DIM**-0.5


def patch_prefill(q, k, window: int, leaky: float | None = None, log_length: int | None = None):
    """The patches' prefill (``q_len > 1``): RoPE logits near, the rectified ones far, one where."""
    length = q.shape[2]
    positions = torch.arange(length)
    if log_length is not None:  # query_states *= ((position_ids + 1).log() / log(training_length)).clip(1)
        q = q * ((positions.double() + 1).log() / math.log(log_length)).clip(1)[:, None]
    near = rope(q, positions) @ rope(k, positions).transpose(-1, -2) / math.sqrt(HEAD_DIM)
    if leaky is None:
        far = rope(q, positions * 0 + window) @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    else:
        offset = int(window * (leaky - 1))
        scaled = torch.arange(length + offset, dtype=torch.float32) / leaky  # the linear-scaling RoPE's t
        q2 = _rotate_at(q, scaled[positions + offset])
        k2 = _rotate_at(k, scaled[positions])
        far = q2 @ k2.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    rectified = (positions[:, None] - positions[None]).abs() < window
    return torch.where(rectified, near, far)


def _rotate_at(x, float_positions):
    cos, sin = hf_cos_sin(float_positions)
    return x * cos + rotate_half(x) * sin


def patch_decode_row(q_row, k, i: int, window: int, leaky: float | None = None):
    """The patches' decode step for the query at position ``i`` (keys 0..i): the query unrotated,
    each key turned back by its (rectified) relative position."""
    relative = i - torch.arange(i + 1)
    if leaky is None:
        k_rot = rope(k[:, :, : i + 1], relative.clip(max=window), sign=-1.0)
    else:
        offset = int(window * (leaky - 1))
        scaled = torch.arange(i + 1 + offset, dtype=torch.float32) / leaky
        # cos = cat([cos[:window], cos2[window + offset:]]): row r < w from RoPE, r >= w from cos2[r + offset]
        at = torch.where(relative < window, relative.float(), scaled[relative + offset])
        cos, sin = hf_cos_sin(at)
        part = k[:, :, : i + 1]
        k_rot = part * cos + rotate_half(part) * (-sin)
    return q_row @ k_rot.transpose(-1, -2) / math.sqrt(HEAD_DIM)


def _posenc_logits(spec: str, q, k):
    enc = posenc.build(spec, head_dim=HEAD_DIM)
    positions = torch.arange(q.shape[2])[None]
    return enc.logits(q, k, positions, positions, scale=SCALE)


CASES = [(37, 5, None), (37, 1, None), (37, 8, 4.0), (37, 3, 16.0), (1, 4, None), (1, 4, 2.0), (12, 40, None)]


def _spec(window: int, leaky: float | None, extra: str = "") -> str:
    name = "rerope" if leaky is None else "leaky_rerope"
    leak = "" if leaky is None else f",leaky_factor={leaky}"
    return f"{name}:window={window}{leak}{extra}"


@pytest.mark.parametrize("length,window,leaky", CASES)
def test_logits_equal_the_patch_prefill_in_float64(length, window, leaky):
    q, k = qk(2, length)
    got = _posenc_logits(_spec(window, leaky), q, k)
    want = patch_prefill(q, k, window, leaky)
    assert max_diff(causal_part(got), causal_part(want)) < 1e-12


@pytest.mark.parametrize("length,window,leaky", [(23, 5, None), (23, 4, 4.0), (23, 2, 3.0)])
def test_logits_equal_the_patch_decode_step(length, window, leaky):
    """The decode step turns each key by the relative angle: the same rotation rounded through other
    float32 table rows (cos((i - j)θ) against cos(iθ), cos(jθ)), so equal to the tables' precision."""
    q, k = qk(1, length, seed=4)
    got = _posenc_logits(_spec(window, leaky), q, k)
    for i in range(length):
        want = patch_decode_row(q[:, :, i : i + 1], k, i, window, leaky)
        assert max_diff(got[:, :, i : i + 1, : i + 1], want) < 1e-5, i


def test_log_query_scaling_equals_the_patch():
    q, k = qk(1, 37, seed=5)
    for leaky in (None, 4.0):
        got = _posenc_logits(_spec(6, leaky, ",log_scale_length=5"), q, k)
        want = patch_prefill(q, k, 6, leaky, log_length=5)
        assert max_diff(causal_part(got), causal_part(want)) < 1e-12
        assert max_diff(causal_part(got), causal_part(_posenc_logits(_spec(6, leaky), q, k))) > 1e-3


@pytest.mark.parametrize("leaky", [None, 4.0])
def test_the_layer_is_one_softmax_over_the_patch_logits(leaky):
    """The layer's output (GQA, 37 tokens) equals values weighted by one causal softmax of the patch's logits."""
    attn = layer(_spec(5, leaky), num_kv_heads=1)
    x = torch.randn(2, 37, attn.embed_dim, dtype=torch.float64)
    want = output_from_logits(attn, x, lambda q, k: patch_prefill(q, k, 5, leaky))
    torch.testing.assert_close(attn(x), want, **EXACT)


@pytest.mark.parametrize(
    "spec,rope_spec",
    [
        ("rerope:window=37", "rope"),
        ("leaky_rerope:window=2,leaky_factor=1", "rope"),
        (
            "rerope:window=64,base=500,pairing=interleaved,rotary_dim=8,scaling=linear,factor=2",
            "rope:base=500,pairing=interleaved,rotary_dim=8,scaling=linear,factor=2",
        ),
        (
            "leaky_rerope:window=40,leaky_factor=8,scaling=yarn,factor=4,original_max_position_embeddings=16",
            "rope:scaling=yarn,factor=4,original_max_position_embeddings=16",
        ),
    ],
)
def test_disabled_is_plain_rope(spec, rope_spec):
    """A window past the sequence, or leaky_factor=1, is RoPE with the same options."""
    attn = layer(spec)
    x = torch.randn(2, 37, attn.embed_dim, dtype=torch.float64)
    torch.testing.assert_close(attn(x), plain_rope_output(attn, x, rope_spec), **EXACT)


@pytest.mark.parametrize("spec", ["rerope:window=3", "leaky_rerope:window=3,leaky_factor=5"])
def test_enabled_differs_from_plain_rope(spec):
    attn = layer(spec)
    x = torch.randn(1, 20, attn.embed_dim, dtype=torch.float64)
    assert max_diff(attn(x), plain_rope_output(attn, x, "rope")) > 1e-3


@pytest.mark.parametrize(
    "spec", ["rerope:window=3", "leaky_rerope:window=4,leaky_factor=3,log_scale_length=6"]
)
@pytest.mark.parametrize("chunks", [[1] * 20, [7, 1, 1, 5, 6], [3, 17]])
def test_cached_decoding_equals_the_full_pass_past_the_window(spec, chunks):
    attn = layer(spec, num_kv_heads=1)
    x = torch.randn(2, 20, attn.embed_dim, dtype=torch.float64)
    torch.testing.assert_close(cached_pieces(attn, x, chunks), attn(x), **EXACT)


def test_shifted_positions_give_the_same_output():
    """Both parts depend on i - j only (to the float32 tables' rounding of the larger angles)."""
    attn = layer("leaky_rerope:window=4,leaky_factor=3")
    x = torch.randn(1, 15, attn.embed_dim, dtype=torch.float64)
    torch.testing.assert_close(attn(x, positions=torch.arange(15) + 101), attn(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "spec,option",
    [
        ("rerope:window=0", "window"),
        ("rerope", "window"),
        ("leaky_rerope:window=4", "leaky_factor"),
        ("leaky_rerope:window=4,leaky_factor=0.5", "leaky_factor"),
        ("rerope:window=4,log_scale_length=1", "log_scale_length"),
        ("rerope:window=4,scaling=dynamic,factor=2", "scaling"),
        ("leaky_rerope:window=4,leaky_factor=2,scaling=longrope,factor=2", "scaling|long"),
        ("rerope:window=4,base=1", "base"),
        ("rerope:window=4,rotary_dim=3", "rotary_dim"),
    ],
)
def test_bad_options_are_refused_at_build_time_by_name(spec, option):
    with pytest.raises(ValueError, match=option):
        posenc.build(spec, head_dim=HEAD_DIM)


def test_bidirectional_layers_are_refused():
    with pytest.raises(ValueError, match="causal"):
        posenc.MultiheadAttention(32, 2, encoding="rerope:window=4", causal=False)


# ---------------------------------------------------------------------------- HF


@pytest.mark.hf
@pytest.mark.parametrize("spec", ["rerope:window=512", "leaky_rerope:window=3,leaky_factor=1"])
def test_hf_swap_disabled_is_the_model_s_own_rope(spec):
    swapped_equals_hf(tiny_llama, f"{spec},base={THETA}", hf_ids(19))


@pytest.mark.hf
@pytest.mark.parametrize("spec", ["rerope:window=4", "leaky_rerope:window=3,leaky_factor=4"])
def test_hf_swap_enabled_generates_with_the_cache_as_a_full_pass(spec):
    import posenc.hf

    model = posenc.hf.swap_encoding(tiny_llama(), f"{spec},base={THETA}")
    plain = tiny_llama()
    with torch.no_grad():
        assert max_diff(model(hf_ids(12)).logits, plain(hf_ids(12)).logits) > 1e-4  # the method acts
    cached_generate_equals_full_pass(model, hf_ids(9), 8, rtol=1e-9, atol=1e-9)


@pytest.mark.real
@pytest.mark.hf
def test_smollm2_disabled_is_hf_and_enabled_decodes_as_a_full_pass():
    smollm2_checks("rerope:window=4096,base=100000", "leaky_rerope:window=6,leaky_factor=4,base=100000")
