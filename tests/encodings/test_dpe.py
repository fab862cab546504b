"""DPE against LuLuLuyi/DPE's ``dpe_flash_forward`` (``dpe_for_llama.py``), restated here on its own.

The reference builds, for each scale factor ``s``, HF's ``cos``/``sin`` tables at the grouped positions
(queries ``i // s + W - W / s``, keys ``j // s``), and joins them pair group by pair group
(``concat_tensors``: group ``g`` takes columns ``[r_g, r_{g+1})`` of each half of the head, with
``dimension_groups_range`` the equal split). Its prefill (``atten_merge_forward``) runs a window flash
attention (``window_size=[W-1, 0]``, every query at RoPE's own positions) and a causal one of the last
``L - W`` queries at the grouped positions against the first ``L - W`` keys, and merges the two by their
log-sum-exp (``1 / (1 + exp(lse_gap))``). Its decode step turns each key back by the grouped relative
position ``i // s - j // s + W - W // s`` (the last ``W`` keys by ``i - j``). posenc follows the decode
step's whole shift everywhere. Logits and outputs in float64.
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
    rotate_half,
    swapped_equals_hf,
    tiny_llama,
)

SCALE = HEAD_DIM**-0.5
HALF = HEAD_DIM // 2


def _ranges(groups: int) -> list[int]:
    """The reference's ``dimension_groups_range``: equal groups of the ``HEAD_DIM / 2`` pairs."""
    return [g * HALF // groups for g in range(groups + 1)]


def _concat(tables: list[torch.Tensor], ranges: list[int]) -> torch.Tensor:
    """The reference's ``concat_tensors``: each group's columns of the first half, then of the second."""
    first = [t[..., ranges[g] : ranges[g + 1]] for g, t in enumerate(tables)]
    second = [t[..., HALF + ranges[g] : HALF + ranges[g + 1]] for g, t in enumerate(tables)]
    return torch.cat(first + second, dim=-1)


def _grouped_tables(positions_of, factors):
    """``cos``/``sin`` ``[T, HEAD_DIM]``: group ``g``'s pairs at ``positions_of(s_g)``."""
    ranges = _ranges(len(factors))
    pairs = [hf_cos_sin(positions_of(s)) for s in factors]
    return _concat([c for c, _ in pairs], ranges), _concat([s for _, s in pairs], ranges)


def _turn(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def reference_prefill(q, k, v, window: int, factors: list[int], whole_shift: bool = True):
    """``atten_merge_forward``: the window part and the grouped part, merged by log-sum-exp; returns
    the output ``[B, H, L, D]``."""
    length = q.shape[2]
    position = torch.arange(length)
    normal_cos, normal_sin = hf_cos_sin(position)
    normal_q, normal_k = _turn(q, normal_cos, normal_sin), _turn(k, normal_cos, normal_sin)
    distance = position[:, None] - position[None]
    near = normal_q @ normal_k.transpose(-1, -2) * SCALE
    near = near.masked_fill(~((distance >= 0) & (distance < window)), -math.inf)
    near_out, near_lse = near.softmax(-1) @ v, torch.logsumexp(near, -1, keepdim=True)
    if length <= window:
        return near_out
    re_window = 0 if position.max() < window else window

    def q_at(s):
        shift = re_window - re_window // s if whole_shift else re_window - re_window / s
        return (position // s + shift).float()

    q_cos, q_sin = _grouped_tables(q_at, factors)
    k_cos, k_sin = _grouped_tables(lambda s: position // s, factors)
    scale_len = length - window
    scale_q = _turn(q, q_cos, q_sin)[:, :, -scale_len:]
    scale_k = _turn(k, k_cos, k_sin)[:, :, :scale_len]
    far = scale_q @ scale_k.transpose(-1, -2) * SCALE
    far = far.masked_fill(torch.ones(scale_len, scale_len, dtype=torch.bool).triu(1), -math.inf)
    far_out, far_lse = far.softmax(-1) @ v[:, :, :scale_len], torch.logsumexp(far, -1, keepdim=True)
    gap = far_lse - near_lse[:, :, -scale_len:]
    out = near_out.clone()
    out[:, :, -scale_len:] = near_out[:, :, -scale_len:] / (1 + torch.exp(gap)) + far_out / (
        1 + torch.exp(-gap)
    )
    return out


def reference_decode_row(q_row, k, i: int, window: int, factors: list[int]):
    """The decode step's logits of the query at ``i`` against keys ``0..i``: the query unrotated, each
    key turned back by its grouped (far) or plain (last ``window`` keys) relative position."""
    key = torch.arange(i + 1)
    re_window = 0 if i < window else window
    normal = i - key

    def relative(s):
        grouped = i // s - key // s + (re_window - re_window // s)
        return (torch.cat([grouped[:-window], normal[-window:]]) if i + 1 > window else normal).float()

    cos, sin = _grouped_tables(relative, factors)
    k_turned = _turn(k[:, :, : i + 1], cos, -sin)
    return q_row @ k_turned.transpose(-1, -2) * SCALE


def _spec(window: int, factors: list[int], extra: str = "") -> str:
    return f"dpe:window={window},factors={'|'.join(map(str, factors))}{extra}"


def _posenc(spec: str, q, k, v):
    enc = posenc.build(spec, head_dim=HEAD_DIM)
    positions = torch.arange(q.shape[2])[None]
    logits = enc.logits(q, k, positions, positions, scale=SCALE)
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return logits.masked_fill(~causal, -math.inf).softmax(-1) @ v, logits


CASES = [
    (37, 4, [2, 3, 5, 8]),
    (37, 6, [4, 1]),
    (29, 1, [3, 3, 2, 7, 1, 2, 4, 9]),
    (1, 3, [2, 2]),
    (12, 40, [5, 6]),
]


@pytest.mark.parametrize("length,window,factors", CASES)
def test_output_equals_the_reference_prefill_with_the_decode_step_s_whole_shift(length, window, factors):
    q, k = qk(2, length, seed=3)
    v = torch.randn_like(k)
    got, _ = _posenc(_spec(window, factors), q, k, v)
    want = reference_prefill(q, k, v, window, factors)
    assert max_diff(got, want) < 1e-12


def test_where_every_factor_divides_the_window_the_reference_s_own_prefill_is_equal():
    q, k = qk(1, 37, seed=2)
    v = torch.randn_like(k)
    got, _ = _posenc(_spec(8, [2, 4, 8, 1]), q, k, v)
    assert max_diff(got, reference_prefill(q, k, v, 8, [2, 4, 8, 1], whole_shift=False)) < 1e-12
    fractional = reference_prefill(q, k, v, 8, [3, 4, 8, 1], whole_shift=False)
    assert max_diff(_posenc(_spec(8, [3, 4, 8, 1]), q, k, v)[0], fractional) > 1e-4  # 8 - 8/3 differs


@pytest.mark.parametrize("window,factors", [(4, [2, 3, 5, 8]), (3, [16, 1]), (1, [2, 2, 3, 3, 4, 4, 5, 5])])
def test_logits_equal_the_reference_decode_step(window, factors):
    """The decode step turns keys by the relative angle: the same rotation through other float32
    table rows, so equal to the tables' precision."""
    q, k = qk(1, 29, seed=4)
    _, got = _posenc(_spec(window, factors), q, k, torch.randn_like(k))
    for i in range(29):
        want = reference_decode_row(q[:, :, i : i + 1], k, i, window, factors)
        assert max_diff(got[:, :, i : i + 1, : i + 1], want) < 1e-5, i


def test_each_group_of_pairs_moves_with_its_own_factor():
    """A far logit depends on a group's factor only through that group's pairs: changing the factor
    of group 1 leaves a query whose other groups' content is zero... unchanged only there."""
    q, k = qk(1, 30, seed=7)
    q[..., :2] = 0  # group 0 of 4 holds pairs 0, 1 (columns 0, 1 and 8, 9)
    q[..., HALF : HALF + 2] = 0
    _, a = _posenc(_spec(3, [2, 3, 4, 5]), q, k, torch.randn_like(k))
    _, b = _posenc(_spec(3, [7, 3, 4, 5]), q, k, torch.randn_like(k))
    assert max_diff(causal_part(a), causal_part(b)) < 1e-12
    _, c = _posenc(_spec(3, [2, 7, 4, 5]), q, k, torch.randn_like(k))
    assert max_diff(causal_part(a), causal_part(c)) > 1e-3


def test_equal_factors_are_self_extend():
    attn = layer(_spec(5, [3, 3, 3, 3]), num_kv_heads=1)
    x = torch.randn(2, 37, attn.embed_dim, dtype=torch.float64)
    with posenc.use_backend("eager"):
        other = layer("self_extend:group_size=3,neighbor_window=5", num_kv_heads=1)
        other.load_state_dict(attn.state_dict())
        torch.testing.assert_close(attn(x), other(x), **EXACT)


@pytest.mark.parametrize("spec", [_spec(3, [1, 1]), _spec(64, [4, 8])])
def test_all_ones_or_a_window_past_the_sequence_is_plain_rope(spec):
    attn = layer(spec)
    x = torch.randn(2, 37, attn.embed_dim, dtype=torch.float64)
    torch.testing.assert_close(attn(x), plain_rope_output(attn, x, "rope"), **EXACT)


def test_the_layer_is_one_softmax_over_the_reference_logits():
    attn = layer(_spec(5, [2, 3, 4, 6]), num_kv_heads=1)
    x = torch.randn(2, 37, attn.embed_dim, dtype=torch.float64)

    def logits(q, k):
        enc = posenc.build(_spec(5, [2, 3, 4, 6]), head_dim=HEAD_DIM)
        positions = torch.arange(37)[None]
        return enc.logits(q, k, positions, positions, scale=SCALE)

    want = output_from_logits(attn, x, logits)
    torch.testing.assert_close(attn(x), want, **EXACT)
    assert max_diff(attn(x), plain_rope_output(attn, x, "rope")) > 1e-3


@pytest.mark.parametrize("chunks", [[1] * 20, [7, 1, 1, 5, 6], [3, 17]])
def test_cached_decoding_equals_the_full_pass_past_the_window(chunks):
    attn = layer(_spec(4, [2, 5]), num_kv_heads=1)
    x = torch.randn(2, 20, attn.embed_dim, dtype=torch.float64)
    torch.testing.assert_close(cached_pieces(attn, x, chunks), attn(x), **EXACT)


@pytest.mark.parametrize(
    "spec,option",
    [
        ("dpe:window=4", "factors"),
        ("dpe:factors=2|2", "window"),
        ("dpe:window=0,factors=2|2", "window"),
        ("dpe:window=4,factors=2|0", "factors"),
        ("dpe:window=4,factors=2|2|2", "factors has 3 entries"),
        ("dpe:window=4,factors=2|2,scaling=dynamic,factor=2", "scaling"),
    ],
)
def test_bad_options_are_refused_by_name(spec, option):
    with pytest.raises((ValueError, TypeError), match=option):
        posenc.MultiheadAttention(32, 2, encoding=spec, causal=True)


# ---------------------------------------------------------------------------- HF


@pytest.mark.hf
def test_hf_swap_with_factors_of_one_is_the_model_s_own_rope():
    swapped_equals_hf(tiny_llama, f"{_spec(2, [1, 1, 1, 1])},base={THETA}", hf_ids(19))


@pytest.mark.hf
def test_hf_swap_enabled_generates_with_the_cache_as_a_full_pass():
    import posenc.hf

    model = posenc.hf.swap_encoding(tiny_llama(), f"{_spec(3, [2, 3, 4, 8])},base={THETA}")
    with torch.no_grad():
        assert max_diff(model(hf_ids(12)).logits, tiny_llama()(hf_ids(12)).logits) > 1e-4
    cached_generate_equals_full_pass(model, hf_ids(9), 8, rtol=1e-9, atol=1e-9)
