"""Attention sinks (gpt-oss): equal to HF gpt-oss ``eager_attention_forward`` on every backend that
serves them, forward and gradients (the sink logits included), cached decoding and weights."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.backends import AttentionRequest, get_backend

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


class _HFModule(torch.nn.Module):
    """What HF's function reads from its attention module."""

    def __init__(self, sinks: torch.Tensor) -> None:
        super().__init__()
        self.sinks = sinks
        self.num_key_value_groups = HEADS // KV_HEADS
        self.training = False


def _hf_attention(q, k, v, sinks, additive_mask, scale):
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    out, weights = gpt_oss.eager_attention_forward(_HFModule(sinks), q, k, v, additive_mask, scale)
    return out.transpose(1, 2), weights  # HF returns [B, T, H, D]


def _causal_additive(q_len, k_len, offset, dtype):
    allowed = torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None] + offset
    return torch.zeros(q_len, k_len, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@pytest.mark.parametrize(
    "encoding,backend",
    [("nope", "eager"), ("nope", "sdpa"), ("alibi", "blocked"), ("alibi", "sdpa"), ("alibi", "eager")],
)
@pytest.mark.parametrize("offset", [0, 6])
def test_sinks_equal_hf_gpt_oss(encoding, backend, offset):
    torch.manual_seed(0)
    dtype = torch.float64
    batch, q_len = 2, 300 if backend == "blocked" else 11  # blocked: several query blocks
    k_len = q_len + offset
    enc = posenc.build(encoding, num_heads=HEADS) if encoding == "alibi" else posenc.build("nope")
    q = torch.randn(batch, HEADS, q_len, HEAD_DIM, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, KV_HEADS, k_len, HEAD_DIM, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, KV_HEADS, k_len, HEAD_DIM, dtype=dtype, requires_grad=True)
    sinks = torch.randn(HEADS, dtype=dtype, requires_grad=True)
    q_pos, k_pos = torch.arange(offset, k_len)[None], torch.arange(k_len)[None]
    request = AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=enc, q_pos=q_pos, k_pos=k_pos, scale=0.3, causal=True, causal_offset=offset,
        sinks=sinks,
    )  # fmt: skip
    assert get_backend(backend).reasons(request) == []
    out, _ = get_backend(backend).run(request)
    mask = _causal_additive(q_len, k_len, offset, dtype)
    if encoding == "alibi":
        mask = mask + enc.bias_for_positions(q_pos, k_pos).to(dtype)
    ref, _ = _hf_attention(q, k, v, sinks, mask, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    weight = torch.randn_like(out)
    got = torch.autograd.grad((out * weight).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((ref * weight).sum(), (q, k, v, sinks))
    for label, g, w in zip(("q", "k", "v", "sinks"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-7, atol=1e-9, msg=lambda m, label=label: f"{label}: {m}")


@pytest.mark.parametrize("name", ["rope", "alibi", "shaw", "t5", "learned"])
def test_layer_with_sinks_weights_cache_and_backends(name):
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(HEADS * HEAD_DIM, HEADS, name, causal=True, sinks=True).double()
    with torch.no_grad():
        layer.sinks.normal_()
    x = torch.randn(2, 13, HEADS * HEAD_DIM, dtype=torch.float64)
    with posenc.use_backend("eager"):
        ref, weights = layer(x, need_weights=True)
    # Weights: rows sum to less than one (the sink keeps the rest of the mass).
    assert bool((weights.sum(-1) < 1).all()) and bool((weights.sum(-1) > 0).all())
    out = layer(x)  # auto
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    cache, pieces = posenc.KVCache(), []
    for a, b in ((0, 5), (5, 6), (6, 13)):
        pieces.append(layer(x[:, a:b], cache=cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), ref, rtol=1e-9, atol=1e-10)
    out.sum().backward()
    assert layer.sinks.grad is not None and bool(layer.sinks.grad.abs().gt(0).all())


def test_sinks_change_the_output_and_are_validated():
    torch.manual_seed(0)
    plain = posenc.MultiheadAttention(16, 2, "rope", causal=True)
    sunk = posenc.MultiheadAttention(16, 2, "rope", causal=True, sinks=True)
    sunk.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(1, 5, 16)
    assert not torch.allclose(plain(x), sunk(x))
    with pytest.raises(ValueError, match="sinks must be True or False"):
        posenc.MultiheadAttention(16, 2, sinks=1)
