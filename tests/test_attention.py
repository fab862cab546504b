"""MultiheadAttention behaviour against independent references (torch.nn.MultiheadAttention, formulas)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import posenc
from posenc.backends import NoBackendError


def _copy_into_torch_mha(ours: posenc.MultiheadAttention) -> nn.MultiheadAttention:
    ref = nn.MultiheadAttention(
        ours.embed_dim, ours.num_heads, batch_first=True, dtype=ours.q_proj.weight.dtype
    )
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ref.eval()


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_nope_self_attention_equals_torch_mha_with_masks(backend):
    torch.manual_seed(1)
    ours = posenc.MultiheadAttention(24, 3, encoding="nope", causal=True, backend=backend).double().eval()
    ref = _copy_into_torch_mha(ours)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 6] = True
    causal_block = torch.triu(
        torch.ones(7, 7, dtype=torch.bool), diagonal=1
    )  # True = not allowed (torch MHA)
    want, want_w = ref(x, x, x, key_padding_mask=pad, attn_mask=causal_block, average_attn_weights=False)
    got, got_w = ours(x, key_padding_mask=pad, need_weights=True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_w, want_w)


def test_cross_attention_equals_torch_mha():
    ours = posenc.MultiheadAttention(16, 4).double().eval()
    ref = _copy_into_torch_mha(ours)
    q, kv = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(3, 11, 16, dtype=torch.float64)
    pad = torch.rand(3, 11) < 0.3
    pad[:, 0] = False
    want, _ = ref(q, kv, kv, key_padding_mask=pad)
    torch.testing.assert_close(ours(q, context=kv, key_padding_mask=pad), want)


def test_grouped_query_attention_equals_repeated_heads_formula():
    layer = posenc.MultiheadAttention(32, 4, num_kv_heads=2, causal=True, bias=False).double().eval()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    q = (x @ layer.q_proj.weight.T).view(2, 6, 4, 8).transpose(1, 2)
    k = (x @ layer.k_proj.weight.T).view(2, 6, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    v = (x @ layer.v_proj.weight.T).view(2, 6, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    logits = q @ k.transpose(-1, -2) / 8**0.5
    logits = logits.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), float("-inf"))
    ctx = (logits.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 32)
    for backend in ("eager", "sdpa"):
        with posenc.use_backend(backend):
            torch.testing.assert_close(layer(x), ctx @ layer.out_proj.weight.T)


def test_bool_and_float_attn_masks_agree():
    layer = posenc.MultiheadAttention(16, 2).eval()
    x = torch.randn(2, 5, 16)
    allowed = torch.rand(2, 5, 5) > 0.4
    allowed[..., 0] = True
    additive = torch.zeros(2, 5, 5).masked_fill(~allowed, float("-inf"))
    for backend in ("eager", "sdpa"):
        with posenc.use_backend(backend):
            torch.testing.assert_close(layer(x, attn_mask=allowed), layer(x, attn_mask=additive))


def test_positions_1d_and_batched_agree():
    layer = posenc.MultiheadAttention(16, 2, encoding="sinusoidal").eval()
    x = torch.randn(2, 5, 16)
    pos = torch.arange(3, 8)
    torch.testing.assert_close(layer(x, positions=pos), layer(x, positions=pos.expand(2, 5)))


def test_left_padding_takes_positions_from_the_mask():
    """BLOOM-style: a left-padded sequence's real tokens get positions 0, 1, ... like the unpadded one."""
    layer = posenc.MultiheadAttention(16, 2, encoding="sinusoidal", causal=True).eval()
    x = torch.randn(1, 4, 16)
    padded = torch.cat([torch.randn(1, 2, 16), x], dim=1)
    pad = torch.tensor([[True, True, False, False, False, False]])
    torch.testing.assert_close(layer(padded, key_padding_mask=pad)[:, 2:], layer(x), rtol=1e-5, atol=1e-6)
    # ... and decoding after the padded prompt continues at position 4.
    cache = posenc.KVCache()
    layer(padded, key_padding_mask=pad, cache=cache)
    step = torch.randn(1, 1, 16)
    full = layer(torch.cat([x, step], dim=1))[:, -1:]
    torch.testing.assert_close(layer(step, cache=cache), full, rtol=1e-5, atol=1e-6)


def test_one_cache_serves_several_layers():
    layers = [posenc.MultiheadAttention(16, 2, causal=True, layer_idx=i).eval() for i in range(2)]
    x = torch.randn(1, 5, 16)

    def stack(inp, cache=None):
        for layer in layers:
            inp = inp + layer(inp, cache=cache)
        return inp

    full = stack(x)
    cache = posenc.KVCache()
    steps = torch.cat([stack(x[:, i : i + 1], cache) for i in range(5)], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-6)
    assert cache.length(0) == cache.length(1) == 5


def test_cross_attention_cache_reuses_projected_context():
    layer = posenc.MultiheadAttention(16, 2).eval()
    q, ctx = torch.randn(1, 3, 16), torch.randn(1, 7, 16)
    cache = posenc.KVCache()
    first = layer(q, context=ctx, cache=cache)
    again = layer(q, context=ctx, cache=cache)  # context keys come from the cache
    torch.testing.assert_close(again, first)
    assert cache.length(0) == 7


def test_dropout_only_in_training():
    layer = posenc.MultiheadAttention(16, 2, dropout=0.5)
    x = torch.randn(2, 6, 16)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    assert not torch.allclose(layer(x), layer(x))


def test_forcing_a_backend_that_cannot_run_lists_its_reasons():
    layer = posenc.MultiheadAttention(16, 2, encoding="shaw:k=2", causal=True)
    with pytest.raises(NoBackendError, match="sdpa"), posenc.use_backend("sdpa"):
        layer(torch.randn(1, 3, 16))
    layer(torch.randn(1, 3, 16))
    assert layer.last_backend != "sdpa"


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="unknown backend 'fastest'"):
        posenc.MultiheadAttention(16, 2, backend="fastest")


def test_auto_weighs_costs_that_forcing_ignores():
    layer = posenc.MultiheadAttention(16, 2, encoding="alibi", causal=True)
    small, large = torch.randn(1, 8, 16), torch.randn(1, 300, 16)
    layer(small)
    assert layer.last_backend == "sdpa"  # blocked declines tiny problems in auto
    layer(large)
    assert layer.last_backend == "blocked"
    with posenc.use_backend("blocked"):  # a decline is not a limit: forcing still runs it
        forced = layer(small)
    with posenc.use_backend("eager"):
        torch.testing.assert_close(forced, layer(small), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        layer(large)
    assert layer.last_backend != "flex"  # no 10-15 s compile per shape on CPU unless asked
