"""NoPE (posenc.encodings.nope): no position term at all. A causal layer with it equals attention written
out here in float64 from the layer's own projections (``softmax(q k^T / sqrt(d)) v`` under the causal
mask), at any positions; it has no parameters, and its order sensitivity comes from the mask alone."""

from __future__ import annotations

import torch

import posenc


def _written_out(layer: posenc.MultiheadAttention, x: torch.Tensor, causal: bool) -> torch.Tensor:
    batch, length, width = x.shape
    heads, dim = layer.num_heads, width // layer.num_heads

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, length, heads, dim).transpose(1, 2)

    q, k, v = split(layer.q_proj(x)), split(layer.k_proj(x)), split(layer.v_proj(x))
    logits = q @ k.transpose(-1, -2) / dim**0.5
    if causal:
        logits = logits.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v
    return layer.out_proj(out.transpose(1, 2).reshape(batch, length, width))


def test_a_nope_layer_is_attention_written_out_without_positions():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    for causal in (True, False):
        layer = posenc.MultiheadAttention(16, 2, "nope", causal=causal).double()
        torch.testing.assert_close(layer(x), _written_out(layer, x, causal), rtol=1e-12, atol=1e-12)
        shifted = layer(x, positions=torch.arange(7) + 1000)
        torch.testing.assert_close(shifted, layer(x), rtol=1e-12, atol=1e-12)  # positions change nothing


def test_nope_has_no_parameters_and_only_the_mask_sees_order():
    torch.manual_seed(0)
    encoder = posenc.MultiheadAttention(16, 2, "nope", causal=False).double()
    assert list(encoder.encoding.parameters()) == []
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    order = torch.randperm(6)
    # Without a mask, permuting the tokens permutes the outputs: nothing tells the positions apart.
    torch.testing.assert_close(encoder(x[:, order]), encoder(x)[:, order], rtol=1e-12, atol=1e-12)
    causal = posenc.MultiheadAttention(16, 2, "nope", causal=True).double()
    assert not torch.allclose(causal(x[:, order]), causal(x)[:, order])  # the causal mask does
