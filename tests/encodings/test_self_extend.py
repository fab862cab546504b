"""Self-Extend against datamllab/LongLM's ``self_extend_forward``, restated here on its own.

The references are the patch's two recipes, written again with HF's RoPE tables
(:mod:`_piecewise_rope`): the prefill's neighbour and grouped attentions merged by its neighbour mask
(``tril`` minus the shifted ``tril``), grouped queries at ``i // G + w_n - w_n / G`` (true division)
and keys at ``j // G``; and the decode step (``flash_self_extend_forward``, ``q_len == 1``), which
turns each key back by ``i - j`` near and ``i // G - j // G + w_n - w_n // G`` far. posenc follows the
decode step's whole shift everywhere: equal to it always, and to the prefill when ``G`` divides ``w_n``.
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


def patch_prefill(q, k, group: int, window: int, scale_base: int = -1, whole_shift: bool = False):
    """The patch's prefill (``q_len == kv_seq_len``); ``whole_shift`` writes the shift with ``//`` as
    its decode step does."""
    length = q.shape[2]
    position = torch.arange(length)
    if scale_base > 0:  # the patch's float32 log, restated in float64 (as posenc computes it)
        q = q * ((position.double() + 1).log() / math.log(scale_base)).clip(1)[:, None]
    neighbor = rope(q, position) @ rope(k, position).transpose(-1, -2) / math.sqrt(HEAD_DIM)
    shift_2 = 0 if position.max() < window else window  # the patch's _re_group_size_2
    shift = shift_2 - shift_2 // group if whole_shift else shift_2 - shift_2 / group
    cos, sin = hf_cos_sin((position // group + shift).float())  # HF's rotary_emb takes float positions
    group_q = q * cos + rotate_half(q) * sin
    grouped = group_q @ rope(k, position // group).transpose(-1, -2) / math.sqrt(HEAD_DIM)
    neighbor_mask = torch.ones(length, length).tril()
    if length - window > 0:
        neighbor_mask[window:, :-window] -= torch.ones(length - window, length - window).tril()
    return torch.where(neighbor_mask.bool(), neighbor, grouped)


def patch_decode_row(q_row, k, i: int, group: int, window: int):
    """The patch's decode step for the query at position ``i`` against keys ``0..i``: the query
    unrotated, each key turned back by its neighbour or grouped relative position."""
    key_position = torch.arange(i + 1)
    neighbor = i - key_position
    shift_2 = 0 if i < window else window
    grouped = i // group - key_position // group + (shift_2 - shift_2 // group)
    relative = torch.cat([grouped[:-window], neighbor[-window:]]) if i + 1 > window else neighbor
    k_rot = rope(k[:, :, : i + 1], relative, sign=-1.0)
    return q_row @ k_rot.transpose(-1, -2) / math.sqrt(HEAD_DIM)


def _posenc_logits(spec: str, q, k):
    enc = posenc.build(spec, head_dim=HEAD_DIM)
    positions = torch.arange(q.shape[2])[None]
    return enc.logits(q, k, positions, positions, scale=SCALE)


def _spec(group: int, window: int, extra: str = "") -> str:
    return f"self_extend:group_size={group},neighbor_window={window}{extra}"


@pytest.mark.parametrize(
    "length,group,window", [(37, 3, 4), (37, 4, 8), (37, 2, 1), (37, 5, 7), (1, 3, 4), (12, 4, 40)]
)
def test_logits_equal_the_patch_prefill_with_the_decode_step_s_whole_shift_in_float64(length, group, window):
    q, k = qk(2, length)
    got = _posenc_logits(_spec(group, window), q, k)
    want = patch_prefill(q, k, group, window, whole_shift=True)
    assert max_diff(causal_part(got), causal_part(want)) < 1e-12


@pytest.mark.parametrize("group,window", [(4, 8), (2, 6), (3, 9)])
def test_where_the_group_divides_the_window_the_patch_s_own_prefill_is_equal(group, window):
    q, k = qk(1, 37, seed=2)
    got = _posenc_logits(_spec(group, window), q, k)
    assert max_diff(causal_part(got), causal_part(patch_prefill(q, k, group, window))) < 1e-12


def test_where_it_does_not_the_prefill_s_fractional_shift_differs():
    """``w_n - w_n / G`` (prefill) and ``w_n - w_n // G`` (decode) differ when G does not divide w_n:
    posenc is the decode step's form, so only the far pairs of the prefill form differ."""
    q, k = qk(1, 37, seed=2)
    got = causal_part(_posenc_logits(_spec(3, 4), q, k))
    fractional = causal_part(patch_prefill(q, k, 3, 4))
    far = causal_part(torch.arange(37)[:, None] - torch.arange(37)[None] >= 4)
    assert max_diff(got[..., far], fractional[..., far]) > 1e-3
    assert max_diff(got[..., ~far], fractional[..., ~far]) < 1e-12


@pytest.mark.parametrize("group,window", [(3, 4), (4, 8), (2, 1)])
def test_logits_equal_the_patch_decode_step(group, window):
    """The decode step turns keys by the relative angle: the same rotation through other float32
    table rows, so equal to the tables' precision."""
    q, k = qk(1, 29, seed=4)
    got = _posenc_logits(_spec(group, window), q, k)
    for i in range(29):
        want = patch_decode_row(q[:, :, i : i + 1], k, i, group, window)
        assert max_diff(got[:, :, i : i + 1, : i + 1], want) < 1e-5, i


def test_log_query_scaling_equals_the_patch_s_scale_base():
    q, k = qk(1, 37, seed=5)
    got = _posenc_logits(_spec(4, 8, ",log_scale_length=6"), q, k)
    want = patch_prefill(q, k, 4, 8, scale_base=6)
    assert max_diff(causal_part(got), causal_part(want)) < 1e-12
    assert max_diff(causal_part(got), causal_part(_posenc_logits(_spec(4, 8), q, k))) > 1e-3


def test_the_layer_is_one_softmax_over_the_patch_logits():
    attn = layer(_spec(3, 5), num_kv_heads=1)
    x = torch.randn(2, 37, attn.embed_dim, dtype=torch.float64)
    want = output_from_logits(attn, x, lambda q, k: patch_prefill(q, k, 3, 5, whole_shift=True))
    torch.testing.assert_close(attn(x), want, **EXACT)


@pytest.mark.parametrize(
    "spec,rope_spec",
    [
        ("self_extend:group_size=1,neighbor_window=3", "rope"),
        ("self_extend:group_size=4,neighbor_window=37", "rope"),
        (
            "self_extend:group_size=1,neighbor_window=2,base=500,pairing=interleaved,rotary_dim=8,scaling=llama3,"
            "factor=8,original_max_position_embeddings=16,low_freq_factor=1,high_freq_factor=4",
            "rope:base=500,pairing=interleaved,rotary_dim=8,scaling=llama3,factor=8,original_max_position_embeddings=16,"
            "low_freq_factor=1,high_freq_factor=4",
        ),
    ],
)
def test_disabled_is_plain_rope(spec, rope_spec):
    """Group size 1, or a neighbour window past the sequence, is RoPE with the same options."""
    attn = layer(spec)
    x = torch.randn(2, 37, attn.embed_dim, dtype=torch.float64)
    torch.testing.assert_close(attn(x), plain_rope_output(attn, x, rope_spec), **EXACT)


def test_enabled_differs_from_plain_rope():
    attn = layer(_spec(3, 4))
    x = torch.randn(1, 20, attn.embed_dim, dtype=torch.float64)
    assert max_diff(attn(x), plain_rope_output(attn, x, "rope")) > 1e-3


@pytest.mark.parametrize("spec", [_spec(3, 4), _spec(2, 5, ",log_scale_length=4")])
@pytest.mark.parametrize("chunks", [[1] * 20, [7, 1, 1, 5, 6], [3, 17]])
def test_cached_decoding_equals_the_full_pass_past_the_window(spec, chunks):
    attn = layer(spec, num_kv_heads=1)
    x = torch.randn(2, 20, attn.embed_dim, dtype=torch.float64)
    torch.testing.assert_close(cached_pieces(attn, x, chunks), attn(x), **EXACT)


@pytest.mark.parametrize(
    "spec,option",
    [
        ("self_extend:group_size=0,neighbor_window=4", "group_size"),
        ("self_extend:group_size=2,neighbor_window=0", "neighbor_window"),
        ("self_extend:neighbor_window=4", "group_size"),
        ("self_extend:group_size=2", "neighbor_window"),
        ("self_extend:group_size=2,neighbor_window=4,log_scale_length=1", "log_scale_length"),
        ("self_extend:group_size=2,neighbor_window=4,scaling=dynamic,factor=2", "scaling"),
    ],
)
def test_bad_options_are_refused_at_build_time_by_name(spec, option):
    with pytest.raises(ValueError, match=option):
        posenc.build(spec, head_dim=HEAD_DIM)


# ---------------------------------------------------------------------------- HF


@pytest.mark.hf
@pytest.mark.parametrize("spec", [_spec(1, 2), _spec(4, 64)])
def test_hf_swap_disabled_is_the_model_s_own_rope(spec):
    swapped_equals_hf(tiny_llama, f"{spec},base={THETA}", hf_ids(19))


@pytest.mark.hf
def test_hf_swap_enabled_generates_with_the_cache_as_a_full_pass():
    import posenc.hf

    model = posenc.hf.swap_encoding(tiny_llama(), f"{_spec(3, 4)},base={THETA}")
    with torch.no_grad():
        assert max_diff(model(hf_ids(12)).logits, tiny_llama()(hf_ids(12)).logits) > 1e-4  # the method acts
    cached_generate_equals_full_pass(model, hf_ids(9), 8, rtol=1e-9, atol=1e-9)


@pytest.mark.real
@pytest.mark.hf
def test_smollm2_disabled_is_hf_and_enabled_decodes_as_a_full_pass():
    smollm2_checks(f"{_spec(1, 4)},base=100000", f"{_spec(3, 5)},base=100000")
