"""Shaw et al. 2018 relative position representations against the paper's formula.

The reference here is written independently of ``posenc.encodings.shaw``: Python loops build the
index, the ``(Tq, Tk, D)`` tensors ``a^K`` and ``a^V`` are materialised, and einsums evaluate
``e_ij = q_i·(k_j + a^K_ij)/sqrt(D)`` and ``z_i = Σ_j α_ij (v_j + a^V_ij)`` (docs/conventions.md §3.1).
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc import functional as F

torch_f64 = torch.float64


def reference_index(
    q_positions: list[int], k_positions: list[int], k: int | None, max_len: int
) -> list[list[int]]:
    """Paper index by hand: clip(j - i, -k, k) + k, or (j - i) + max_len - 1 unclipped."""
    rows = []
    for i in q_positions:
        if k is None:
            rows.append([(j - i) + max_len - 1 for j in k_positions])
        else:
            rows.append([max(-k, min(k, j - i)) + k for j in k_positions])
    return rows


def materialise(table: torch.Tensor, index: list[list[int]]) -> torch.Tensor:
    """a_ij = table[index_ij]: [Tq, Tk, D] for a shared table, [H, Tq, Tk, D] for per-head tables."""
    rows = [[table[..., r, :] for r in row] for row in index]
    stacked = torch.stack([torch.stack(row, dim=-2) for row in rows], dim=-3)
    return stacked


def naive_layer(attn, x_q, x_kv, q_positions, k_positions, *, key_padding_mask=None, causal_offset=None):
    """Full layer output with the Shaw formula evaluated on materialised a^K, a^V (float64)."""
    enc = attn.encoding
    heads, head_dim = attn.num_heads, attn.head_dim
    batch = x_q.shape[0]

    def split(t):
        return t.view(batch, t.shape[1], heads, head_dim).transpose(1, 2)

    q, k, v = split(attn.q_proj(x_q)), split(attn.k_proj(x_kv)), split(attn.v_proj(x_kv))
    index = reference_index(q_positions, k_positions, enc.k, enc.max_len)
    a_key = materialise(enc.key_table, index)
    spec = "bhid,hijd->bhij" if enc.per_head else "bhid,ijd->bhij"
    logits = (torch.einsum("bhid,bhjd->bhij", q, k) + torch.einsum(spec, q, a_key)) / head_dim**0.5
    if causal_offset is not None:
        allowed = torch.tensor(
            [[j <= i + causal_offset for j in range(len(k_positions))] for i in range(len(q_positions))]
        )
        logits = logits.masked_fill(~allowed, float("-inf"))
    if key_padding_mask is not None:
        logits = logits.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    probs = logits.softmax(-1)
    out = torch.einsum("bhij,bhjd->bhid", probs, v)
    if enc.value_table is not None:
        a_value = materialise(enc.value_table, index)
        out = out + torch.einsum("bhij,hijd->bhid" if enc.per_head else "bhij,ijd->bhid", probs, a_value)
    return attn.out_proj(out.transpose(1, 2).reshape(batch, len(q_positions), -1))


def make_layer(spec: str, *, embed_dim: int = 24, heads: int = 3, causal: bool = False):
    return posenc.MultiheadAttention(embed_dim, heads, spec, causal=causal).to(torch_f64)


# ---------------------------------------------------------------------------- index


def test_index_matrix_matches_reference_l5_k2():
    positions = torch.arange(5)[None]
    expected = [[2, 3, 4, 4, 4], [1, 2, 3, 4, 4], [0, 1, 2, 3, 4], [0, 0, 1, 2, 3], [0, 0, 0, 1, 2]]
    assert F.shaw_relative_index(positions, positions, 2).tolist() == [expected]


def test_cache_mode_row_is_last_query():
    index = F.shaw_relative_index(torch.tensor([[4]]), torch.arange(5)[None], 2)
    assert index.tolist() == [[[0, 0, 0, 1, 2]]]


def test_unclipped_index_is_shaw_sign_offset_by_max_len():
    positions = torch.arange(5)[None]
    index = F.shaw_relative_index(positions, positions, None, max_len=5)
    # docs/conventions.md §3.2: Shaw with k = L_max - 1 gives (j - i) + 4, first rows [4..8], [3..7].
    assert index[0, 0].tolist() == [4, 5, 6, 7, 8]
    assert index[0, 1].tolist() == [3, 4, 5, 6, 7]
    assert index.tolist() == [reference_index(range(5), range(5), None, 5)]


# ---------------------------------------------------------------------------- forward vs the formula


@pytest.mark.parametrize(
    "spec",
    ["shaw:k=2", "shaw:k=3,per_head=true", "shaw:k=2,value_term=false", "shaw:k=None,max_len=9", "shaw:k=16"],
)
def test_self_attention_equals_naive_formula(spec):
    attn = make_layer(spec)
    x = torch.randn(2, 7, 24, dtype=torch_f64)
    expected = naive_layer(attn, x, x, list(range(7)), list(range(7)))
    torch.testing.assert_close(attn(x), expected, rtol=1e-10, atol=1e-10)


def test_logits_equal_naive_formula():
    enc = posenc.build("shaw", head_dim=8, num_heads=3, k=2, per_head=True).to(torch_f64)
    q = torch.randn(2, 3, 6, 8, dtype=torch_f64)
    k = torch.randn(2, 3, 6, 8, dtype=torch_f64)
    positions = torch.arange(6)[None]
    a_key = materialise(enc.key_table, reference_index(range(6), range(6), 2, 0))
    expected = (q @ k.transpose(-1, -2) + torch.einsum("bhid,hijd->bhij", q, a_key)) * 0.25
    got = enc.logits(q, k, positions, positions, scale=0.25)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_causal_padding_and_explicit_positions_equal_naive():
    attn = make_layer("shaw:k=3", causal=True)
    x = torch.randn(2, 6, 24, dtype=torch_f64)
    pad = torch.tensor([[False] * 6, [False, False, False, False, True, True]])
    positions = [10, 11, 12, 13, 14, 15]
    got = attn(x, positions=torch.tensor(positions), key_padding_mask=pad)
    expected = naive_layer(attn, x, x, positions, positions, key_padding_mask=pad, causal_offset=0)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_cross_attention_queries_at_last_positions():
    attn = make_layer("shaw:k=2,per_head=true")
    x_q = torch.randn(2, 3, 24, dtype=torch_f64)
    x_kv = torch.randn(2, 8, 24, dtype=torch_f64)
    q_positions, k_positions = [5, 6, 7], list(range(8))
    got = attn(x_q, x_kv, positions=torch.tensor(q_positions))
    expected = naive_layer(attn, x_q, x_kv, q_positions, k_positions)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("spec", ["shaw:k=2", "shaw:k=None,max_len=16,per_head=true"])
def test_cached_decoding_equals_full_forward(spec):
    attn = make_layer(spec, causal=True)
    x = torch.randn(2, 9, 24, dtype=torch_f64)
    full = attn(x)
    cache = posenc.KVCache()
    steps = [attn(x[:, :4], cache=cache)] + [attn(x[:, t : t + 1], cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)


def test_gradients_equal_naive_formula():
    attn = make_layer("shaw:k=2,per_head=true", causal=True)
    x = torch.randn(2, 6, 24, dtype=torch_f64, requires_grad=True)
    weight = torch.randn(2, 6, 24, dtype=torch_f64)
    params = [x, attn.encoding.key_table, attn.encoding.value_table, attn.q_proj.weight]
    got = torch.autograd.grad((attn(x) * weight).sum(), params)
    expected_out = naive_layer(attn, x, x, list(range(6)), list(range(6)), causal_offset=0)
    expected = torch.autograd.grad((expected_out * weight).sum(), params)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


def test_shared_tables_have_head_depth_and_per_head_tables_one_per_head():
    shared = posenc.build("shaw", head_dim=8, num_heads=4, k=3)
    per_head = posenc.build("shaw", head_dim=8, num_heads=4, k=3, per_head=True)
    assert tuple(shared.key_table.shape) == (7, 8) and tuple(shared.value_table.shape) == (7, 8)
    assert tuple(per_head.key_table.shape) == (4, 7, 8)
    assert posenc.build("shaw", head_dim=8, k=None, max_len=10).key_table.shape[0] == 19
    assert posenc.build("shaw", head_dim=8, value_term=False).value_table is None


# ---------------------------------------------------------------------------- errors


def test_unclipped_variant_past_max_len_names_max_len():
    attn = make_layer("shaw:k=None,max_len=6")
    attn(torch.randn(1, 6, 24, dtype=torch_f64))  # exactly max_len positions is fine
    with pytest.raises(ValueError, match="max_len=6"):
        attn(torch.randn(1, 7, 24, dtype=torch_f64))
    with pytest.raises(ValueError, match="max_len=6"):
        attn(torch.randn(1, 2, 24, dtype=torch_f64), positions=torch.tensor([3, 6]))


def test_bad_clipping_distance_is_an_error():
    with pytest.raises(ValueError, match="k"):
        posenc.build("shaw", head_dim=8, k=0)


def test_preview_shows_index_map():
    text = posenc.build("shaw", head_dim=8, k=2).preview(5)
    assert "0   0   0   1   2" in text


def test_grouped_query_heads_equal_mha_with_repeated_kv_projections():
    """num_kv_heads=1: same output as full multi-head attention whose every head uses that key/value head."""
    gqa = posenc.MultiheadAttention(24, 3, "shaw:k=2,per_head=true", num_kv_heads=1).to(torch_f64)
    mha = posenc.MultiheadAttention(24, 3, "shaw:k=2,per_head=true").to(torch_f64)
    with torch.no_grad():
        mha.load_state_dict(
            {
                **gqa.state_dict(),
                "k_proj.weight": gqa.k_proj.weight.repeat(3, 1),
                "k_proj.bias": gqa.k_proj.bias.repeat(3),
                "v_proj.weight": gqa.v_proj.weight.repeat(3, 1),
                "v_proj.bias": gqa.v_proj.bias.repeat(3),
            }
        )
    x = torch.randn(2, 7, 24, dtype=torch_f64)
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-12, atol=1e-12)
