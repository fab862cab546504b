"""ALiBi: slopes against docs/conventions.md §6.1's worked lists, HF BLOOM and x-transformers; symmetric bias
against x-transformers ``AlibiPositionalBias``; causal form against BLOOM's ``m·j`` form under a causal
mask (formulas written here)."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import functional as F
from posenc.encodings.alibi import ALiBi

HEAD_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 31, 32, 40, 64, 96]


def test_worked_lists_for_8_12_and_6_heads() -> None:
    expected = {
        8: [2.0**-e for e in range(1, 9)],
        12: [2.0**-e for e in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5],
        6: [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3],
    }
    for heads, slopes in expected.items():
        got = F.alibi_slopes(heads)
        assert got.dtype == torch.float32 and got.shape == (heads,)
        torch.testing.assert_close(got, torch.tensor(slopes, dtype=torch.float32), rtol=0, atol=0)
    # docs/conventions.md §6.1's printed decimals for the 12-head tail.
    tail = torch.tensor([0.7071067812, 0.3535533906, 0.1767766953, 0.08838834765])
    torch.testing.assert_close(F.alibi_slopes(12)[8:], tail, rtol=0, atol=1e-8)


def test_six_heads_are_not_monotone() -> None:
    slopes = F.alibi_slopes(6)
    assert not bool((slopes[1:] < slopes[:-1]).all())


def test_power_of_two_rule_is_the_geometric_sequence_two_to_minus_8h_over_n() -> None:
    for n in (1, 2, 4, 8, 16, 32, 64):
        expected = torch.tensor([2.0 ** (-8.0 * h / n) for h in range(1, n + 1)], dtype=torch.float64)
        torch.testing.assert_close(F.alibi_slopes(n), expected.float(), rtol=0, atol=0)


@pytest.mark.parametrize("heads", HEAD_COUNTS)
def test_slopes_equal_hf_bloom(heads: int) -> None:
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    hf = _get_alibi_slopes(heads, torch.device("cpu"))
    # BLOOM computes the powers in float32: at most a few 1e-8 from the float64 list (docs/conventions.md §6.1).
    torch.testing.assert_close(F.alibi_slopes(heads), hf, rtol=0, atol=1e-7)


@pytest.mark.parametrize("heads", HEAD_COUNTS)
def test_slopes_equal_x_transformers(heads: int) -> None:
    from x_transformers.x_transformers import AlibiPositionalBias

    xt = torch.tensor(AlibiPositionalBias._get_slopes(heads), dtype=torch.float32)
    torch.testing.assert_close(F.alibi_slopes(heads), xt, rtol=0, atol=1e-7)


@pytest.mark.parametrize("heads", [3, 8, 12])
def test_bloom_build_alibi_tensor_is_slope_times_key_position(heads: int) -> None:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    length = 7
    hf = build_alibi_tensor(torch.ones(1, length, dtype=torch.long), heads, torch.float32)  # [H, 1, L]
    ours = F.alibi_slopes(heads)[:, None, None] * torch.arange(length, dtype=torch.float32)
    torch.testing.assert_close(ours, hf, rtol=0, atol=1e-6)


@pytest.mark.parametrize("heads,q_len,k_len", [(4, 3, 3), (6, 5, 5), (12, 2, 9), (8, 1, 6)])
def test_symmetric_bias_equals_x_transformers(heads: int, q_len: int, k_len: int) -> None:
    from x_transformers.x_transformers import AlibiPositionalBias

    xt = AlibiPositionalBias(heads=heads)(q_len, k_len)  # queries are the last q_len positions
    enc = ALiBi(num_heads=heads, mode="symmetric")
    torch.testing.assert_close(enc.bias(q_len, k_len, q_offset=k_len - q_len), xt, rtol=0, atol=1e-7)


def test_symmetric_3x3_rows_from_reference() -> None:
    # docs/conventions.md §6.2: 3×3, the head with m = 1/16 has rows [0, −.0625, −.125], ...
    bias = ALiBi(num_heads=2, mode="symmetric").bias(3, 3)[0]  # 2 heads: [1/16, 1/256]
    expected = torch.tensor([[0, -0.0625, -0.125], [-0.0625, 0, -0.0625], [-0.125, -0.0625, 0]])
    torch.testing.assert_close(bias, expected, rtol=0, atol=0)


def test_causal_bias_is_the_paper_form_for_every_pair() -> None:
    enc = ALiBi(num_heads=3)
    # 3 heads: the two slopes of 2 heads (2^-4, 2^-8), then the first of 4 heads (2^-2).
    slopes = [2.0 ** (-8 * 1 / 2), 2.0 ** (-8 * 2 / 2), 2.0 ** (-8 * 1 / 4)]
    q_pos, k_pos = torch.tensor([[2, 5]]), torch.tensor([[0, 1, 2, 3, 4, 5, 6]])
    expected = torch.tensor(
        [[[-m * (i - j) for j in k_pos[0].tolist()] for i in q_pos[0].tolist()] for m in slopes],
        dtype=torch.float32,
    )
    got = enc.bias_for_positions(q_pos, k_pos)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got[0], expected, rtol=0, atol=0)


def test_causal_softmax_equals_bloom_key_position_form_under_a_causal_mask() -> None:
    """softmax(q·k/√d − m(i−j) + causal) == softmax(q·k/√d + m·j + causal): the row constant m·i cancels."""
    heads, length, embed = 4, 9, 16
    attn = posenc.MultiheadAttention(embed, heads, encoding="alibi", causal=True, backend="eager")
    x = torch.randn(2, length, embed, dtype=torch.float64)
    attn = attn.double()
    _, weights = attn(x, need_weights=True)
    d = embed // heads
    q = attn.q_proj(x).view(2, length, heads, d).transpose(1, 2)
    k = attn.k_proj(x).view(2, length, heads, d).transpose(1, 2)
    slopes = torch.tensor([2.0 ** (-8.0 * h / heads) for h in range(1, heads + 1)], dtype=torch.float64)
    bloom_bias = slopes[:, None, None] * torch.arange(length, dtype=torch.float64)  # m·j for every row
    future = torch.arange(length)[None, :] > torch.arange(length)[:, None]
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(d) + bloom_bias
    expected = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=1e-7)


def test_cached_decoding_continues_positions() -> None:
    attn = posenc.MultiheadAttention(8, 2, encoding="alibi", causal=True, backend="eager").eval()
    x = torch.randn(1, 6, 8)
    full = attn(x)
    cache = posenc.KVCache()
    steps = [attn(x[:, t : t + 1], cache=cache) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-6)


def test_both_modes_are_shift_invariant() -> None:
    for mode in ("causal", "symmetric"):
        enc = ALiBi(num_heads=5, mode=mode)
        q, k = torch.arange(4)[None], torch.arange(7)[None]
        torch.testing.assert_close(enc.bias_for_positions(q + 1000, k + 1000), enc.bias_for_positions(q, k))
    assert ALiBi.shift_invariant


def test_causal_and_symmetric_modes_give_the_same_attention_under_a_causal_mask() -> None:
    causal = posenc.MultiheadAttention(8, 4, encoding="alibi", causal=True, backend="eager")
    symmetric = posenc.MultiheadAttention(8, 4, encoding="alibi:mode=symmetric", causal=True, backend="eager")
    symmetric.load_state_dict(causal.state_dict())
    x = torch.randn(2, 7, 8)
    torch.testing.assert_close(symmetric(x), causal(x), rtol=0, atol=0)
    # Without the mask they differ: the causal form rewards distant future keys.
    future = ALiBi(num_heads=4).bias(1, 3)[0, 0]
    torch.testing.assert_close(future, torch.tensor([0.0, 0.25, 0.5]), rtol=0, atol=0)


def test_causal_mode_refuses_a_non_causal_layer() -> None:
    with pytest.raises(ValueError, match="mode='symmetric'"):
        posenc.MultiheadAttention(8, 2, encoding="alibi")
    posenc.MultiheadAttention(8, 2, encoding="alibi:mode=symmetric")  # encoders use the symmetric form


def test_symmetric_mode_in_an_encoder_and_cross_attention() -> None:
    heads, embed = 2, 8
    attn = posenc.MultiheadAttention(embed, heads, encoding="alibi:mode=symmetric", backend="eager").double()
    x_q, x_kv = torch.randn(1, 3, embed, dtype=torch.float64), torch.randn(1, 5, embed, dtype=torch.float64)
    _, weights = attn(x_q, context=x_kv, need_weights=True)
    d = embed // heads
    q = attn.q_proj(x_q).view(1, 3, heads, d).transpose(1, 2)
    k = attn.k_proj(x_kv).view(1, 5, heads, d).transpose(1, 2)
    slopes = torch.tensor([2.0**-4, 2.0**-8], dtype=torch.float64)
    distance = (torch.arange(3)[:, None] - torch.arange(5)[None, :]).abs().double()
    expected = torch.softmax(
        q @ k.transpose(-1, -2) / math.sqrt(d) - slopes[:, None, None] * distance, dim=-1
    )
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=1e-7)


def test_no_parameters_and_slopes_are_not_saved() -> None:
    enc = ALiBi(num_heads=12)
    assert list(enc.parameters()) == []
    assert enc.state_dict() == {}
    assert not enc.slopes.requires_grad


def test_slopes_stay_float32_when_the_model_is_cast() -> None:
    enc = ALiBi(num_heads=12).to(torch.bfloat16)
    assert enc.slopes.dtype == torch.float32
    torch.testing.assert_close(enc.slopes, F.alibi_slopes(12), rtol=0, atol=0)
    assert enc.bias(1, 300, q_offset=299).dtype == torch.float32


def test_bias_at_is_elementwise() -> None:
    enc = ALiBi(num_heads=6, mode="symmetric")
    dense = enc.bias(5, 7)
    for h, i, j in [(0, 0, 0), (4, 3, 6), (5, 4, 1)]:
        value = enc.bias_at(torch.tensor(h), torch.tensor(i), torch.tensor(j))
        assert value.shape == () and float(value) == float(dense[h, i, j])
    score = torch.tensor(0.25)
    got = enc.score_mod(score, torch.tensor(0), torch.tensor(4), torch.tensor(3), torch.tensor(6))
    assert float(got) == pytest.approx(0.25 + float(dense[4, 3, 6]))


def test_bad_options_raise_the_registry_error() -> None:
    with pytest.raises(ValueError, match="mode"):
        posenc.build("alibi:mode=bidirectional", num_heads=4)
    with pytest.raises(ValueError, match="num_heads"):
        posenc.build("alibi", num_heads=0)
    with pytest.raises(ValueError, match="num_heads"):
        posenc.build("alibi:num_heads=two")
    with pytest.raises(ValueError, match="num_heads"):
        F.alibi_slopes(0)


def test_preview_lists_the_slopes() -> None:
    text = ALiBi(num_heads=12).preview()
    assert "head 8: m = 0.70710677" in text and "2^-0.5" in text


def test_causal_mode_refuses_cross_attention_in_a_causal_layer() -> None:
    # Cross-attention is never causally masked, so the causal form would favour distant keys.
    attn = posenc.MultiheadAttention(8, 2, encoding="alibi", causal=True)
    with pytest.raises(ValueError, match="cross-attention is never causal"):
        attn(torch.randn(1, 3, 8), context=torch.randn(1, 10, 8))
