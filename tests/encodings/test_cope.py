"""CoPE against x-transformers ``CoPE`` (Appendix B of arXiv 2405.18719) and docs/conventions.md §10.4."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc import functional as F


def test_positions_reference_rows():
    causal = torch.tril(torch.ones(5, 5))
    ones = F.cope_positions(causal, npos_max=64)
    torch.testing.assert_close(ones[4], torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0]))  # i - j + 1, not i - j
    assert float(ones[2, 4]) == 0.0  # future keys count nothing
    halves = F.cope_positions(causal * 0.5, npos_max=64)
    torch.testing.assert_close(halves[4], torch.tensor([2.5, 2.0, 1.5, 1.0, 0.5]))
    torch.testing.assert_close(
        F.cope_positions(causal, npos_max=3)[4], torch.tensor([2.0, 2.0, 2.0, 2.0, 1.0])
    )


def test_interpolation_between_integer_positions():
    logits = torch.tensor([[0.0, 10.0, 20.0, 40.0]])
    got = F.cope_interpolate(logits, torch.tensor([[0.25, 2.5, 3.0]]))
    torch.testing.assert_close(got, torch.tensor([[2.5, 30.0, 40.0]]))


@pytest.mark.parametrize("npos_max", [4, 16])
def test_logits_match_x_transformers_cope(npos_max):
    import x_transformers.x_transformers as x_transformers  # a test reference: the [test] extra installs it

    batch, heads, length, dim = 2, 3, 9, 8
    q, k = torch.randn(batch, heads, length, dim), torch.randn(batch, heads, length, dim)
    scale = dim**-0.5
    reference = x_transformers.CoPE(dim=dim, heads=heads, max_pos=npos_max)
    enc = posenc.build("cope", head_dim=dim, npos_max=npos_max)
    with torch.no_grad():
        reference.pos_emb.normal_()
        enc.pos_emb.copy_(reference.pos_emb)
    # x-transformers gates the scaled, causally masked logits and adds the CoPE term of the unscaled q.
    sim = (q @ k.transpose(-1, -2)) * scale
    future = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    sim = sim.masked_fill(future, -torch.finfo(sim.dtype).max)
    want = sim + reference(q, sim)
    pos = torch.arange(length)[None]
    got = enc.logits(q, k, pos, pos, scale=scale)
    torch.testing.assert_close(got[..., ~future], want[..., ~future], rtol=1e-5, atol=1e-5)


def test_attention_layer_uses_cope_logits_and_gradients_reach_the_table():
    layer = posenc.MultiheadAttention(16, 2, encoding="cope:npos_max=8", causal=True)
    with torch.no_grad():
        layer.encoding.pos_emb.normal_()
    x = torch.randn(1, 6, 16)
    out, weights = layer(x, need_weights=True)
    q = layer.q_proj(x).view(1, 6, 2, 8).transpose(1, 2)
    k = layer.k_proj(x).view(1, 6, 2, 8).transpose(1, 2)
    pos = torch.arange(6)[None]
    logits = layer.encoding.logits(q, k, pos, pos, scale=8**-0.5)
    logits = logits.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), float("-inf"))
    torch.testing.assert_close(weights, torch.softmax(logits, -1), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert layer.encoding.pos_emb.grad is not None and layer.encoding.pos_emb.grad.abs().sum() > 0
    # A zero table (the initial state) leaves plain attention.
    plain = posenc.MultiheadAttention(16, 2, encoding="nope", causal=True)
    fresh = posenc.MultiheadAttention(16, 2, encoding="cope", causal=True)
    fresh.load_state_dict({**plain.state_dict(), "encoding.pos_emb": torch.zeros(16, 8)})
    torch.testing.assert_close(fresh(x), plain(x), rtol=1e-6, atol=1e-6)


def test_errors():
    with pytest.raises(ValueError, match="causal"):
        posenc.MultiheadAttention(16, 2, encoding="cope", causal=False)
    with pytest.raises(ValueError, match="npos_max"):
        posenc.build("cope", head_dim=8, npos_max=1)
