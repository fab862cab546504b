"""MultiheadAttention (posenc.layers.attention) against independent references (torch.nn.MultiheadAttention,
formulas): masks, GQA, caches, dropout, forced backends; a layer's own head size; values taken from the
key projection (K = V)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import posenc
from posenc.backends import NoBackendError
from posenc.layers.patterns import LayerSpec


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


# ----------------------------------------------------------------------------
# A layer's own head size (``MultiheadAttention(head_dim=D)``, ``LayerSpec.head_dim``; Gemma 4's global
# layers): ``q_proj`` ``E -> H·D``, ``out_proj`` ``H·D -> E``, logits scaled by ``1/sqrt(D)``.


E, H, HKV, D = 24, 4, 2, 10  # D * H = 40 != E


def _layer(**options) -> posenc.MultiheadAttention:
    torch.manual_seed(0)
    return posenc.MultiheadAttention(
        E, H, "nope", causal=True, num_kv_heads=HKV, head_dim=D, **options
    ).double()


def test_wide_heads_equal_attention_written_out():
    layer = _layer()
    assert layer.q_proj.weight.shape == (H * D, E) and layer.k_proj.weight.shape == (HKV * D, E)
    assert layer.out_proj.weight.shape == (E, H * D)
    x = torch.randn(2, 7, E, dtype=torch.float64)
    q = layer.q_proj(x).view(2, 7, H, D).transpose(1, 2)
    k = layer.k_proj(x).view(2, 7, HKV, D).transpose(1, 2).repeat_interleave(H // HKV, dim=1)
    v = layer.v_proj(x).view(2, 7, HKV, D).transpose(1, 2).repeat_interleave(H // HKV, dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(D)
    logits = logits.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    want = layer.out_proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, H * D))
    torch.testing.assert_close(layer(x), want, rtol=1e-12, atol=1e-12)


def test_wide_heads_decode_as_the_full_call_and_the_decode_step():
    layer = posenc.MultiheadAttention(E, H, "rope", causal=True, num_kv_heads=HKV, head_dim=D).double().eval()
    x = torch.randn(2, 9, E, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        cache = posenc.KVCache(max_length=12)
        steps = [layer(x[:, :5], cache=cache)]
        with cache.fixed_shapes():
            steps += [layer(x[:, t : t + 1], cache=cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)


def test_a_model_gives_each_layer_its_head_size():
    pattern = [LayerSpec("rope"), LayerSpec("rope", head_dim=D, num_kv_heads=1), LayerSpec("rope")]
    model = posenc.TransformerLM(11, E, 3, H, num_kv_heads=HKV, pattern=pattern)
    assert [(b.attn.head_dim, b.attn.num_kv_heads) for b in model.blocks] == [(6, 2), (D, 1), (6, 2)]
    assert model.blocks[1].attn.encoding.head_dim == D  # the rotation is built for the layer's head
    tokens = torch.randint(0, 11, (2, 8))
    with torch.no_grad():
        full = model(tokens)
        cache = posenc.KVCache()
        steps = [model(tokens[:, :4], cache=cache)] + [
            model(tokens[:, t : t + 1], cache=cache) for t in range(4, 8)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: posenc.MultiheadAttention(E, H, head_dim=0), "head_dim must be positive"),
        (lambda: posenc.MultiheadAttention(E, 5, "nope"), "pass head_dim= for another head size"),
        (lambda: posenc.MultiheadAttention(E, H, head_dim=2.5), "head_dim must be an int"),
        (
            lambda: posenc.MultiheadAttention(E, H, "rope", pattern=LayerSpec("rope", head_dim=8)),
            "pattern: head_dim and num_kv_heads are the layer's sizes",
        ),
    ],
)
def test_bad_head_sizes_are_refused_by_name(build, needle):
    with pytest.raises(ValueError) as err:
        build()
    assert needle in str(err.value)


# ----------------------------------------------------------------------------
# K = V (Gemma 4's global layers, ``attention_k_eq_v``): ``MultiheadAttention(value_from_key=True)`` takes
# its values from the key projection before the encoding acts (before RoPE), and has no ``v_proj``.


KV_E, KV_H, KV_HKV = 32, 4, 2


def _pair(encoding: str, **options):
    shared = posenc.MultiheadAttention(
        KV_E, KV_H, encoding, num_kv_heads=KV_HKV, value_from_key=True, **options
    ).double()
    twin = posenc.MultiheadAttention(KV_E, KV_H, encoding, num_kv_heads=KV_HKV, **options).double()
    state = shared.state_dict()
    state.update({"v_proj.weight": state["k_proj.weight"], "v_proj.bias": state["k_proj.bias"]})
    twin.load_state_dict(state)
    return shared, twin


@pytest.mark.parametrize("encoding", ["rope", "alibi", "sinusoidal", "shaw"])
def test_values_are_the_key_projection_before_the_encoding(encoding):
    shared, twin = _pair(encoding, causal=True)
    assert shared.v_proj is None and not any(k.startswith("v_proj") for k in shared.state_dict())
    x = torch.randn(2, 13, KV_E, dtype=torch.float64)
    got, want = shared(x), twin(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weight = torch.linspace(-1, 1, got.numel(), dtype=got.dtype).view_as(got)
    (got * weight).sum().backward()
    (want * weight).sum().backward()
    torch.testing.assert_close(shared.k_proj.weight.grad, twin.k_proj.weight.grad + twin.v_proj.weight.grad)
    torch.testing.assert_close(shared.q_proj.weight.grad, twin.q_proj.weight.grad)
    if encoding == "rope":  # the check can fail: values from the rotated keys give another output
        rotated, _ = shared.encoding.rotate(
            *(shared.key_values(x)[0],) * 2, torch.arange(13)[None], torch.arange(13)[None]
        )
        assert not torch.allclose(rotated, shared.key_values(x)[1])


@pytest.mark.parametrize("cache_options", [{}, {"max_length": 20}, {"recent_tokens": 6, "sink_tokens": 2}])
def test_cached_decoding_equals_the_twin(cache_options):
    shared, twin = _pair("rope", causal=True)
    x = torch.randn(2, 14, KV_E, dtype=torch.float64)
    with torch.no_grad():
        outputs = []
        for layer in (shared, twin):
            cache = posenc.KVCache(**cache_options)
            steps = [layer(x[:, :8], cache=cache)] + [
                layer(x[:, t : t + 1], cache=cache) for t in range(8, 14)
            ]
            outputs.append(torch.cat(steps, 1))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-12, atol=1e-12)


def test_fixed_shape_steps_and_cross_attention():
    shared, twin = _pair("rope", causal=True)
    shared.eval(), twin.eval()
    x = torch.randn(2, 12, KV_E, dtype=torch.float64)
    with torch.no_grad():
        cache = posenc.KVCache(max_length=16)
        shared(x[:, :8], cache=cache)
        with cache.fixed_shapes():
            steps = torch.cat([shared(x[:, t : t + 1], cache=cache) for t in range(8, 12)], 1)
        torch.testing.assert_close(steps, twin(x)[:, 8:], rtol=1e-12, atol=1e-12)
    cross_shared, cross_twin = _pair("rope")
    context = torch.randn(2, 9, KV_E, dtype=torch.float64)
    torch.testing.assert_close(cross_shared(x, context), cross_twin(x, context), rtol=1e-12, atol=1e-12)


def test_value_from_key_must_be_a_bool():
    with pytest.raises(ValueError, match="value_from_key"):
        posenc.MultiheadAttention(KV_E, KV_H, "rope", value_from_key="yes")


def test_pattern_carries_value_from_key_both_ways():
    """``LayerSpec.value_from_key``: a layer built from the pattern has K = V (no ``v_proj``), reports
    it in its ``pattern``, and a layer built from that pattern is the same layer."""
    spec = posenc.layers.patterns.LayerSpec("rope", window=5, value_from_key=True)
    layer = posenc.MultiheadAttention(
        KV_E, KV_H, "rope", causal=True, num_kv_heads=KV_HKV, pattern=spec
    ).double()
    assert layer.v_proj is None and layer.value_from_key
    assert layer.pattern.value_from_key and layer.pattern.window == 5
    assert not posenc.MultiheadAttention(KV_E, KV_H, "rope").pattern.value_from_key
    again = posenc.MultiheadAttention(
        KV_E, KV_H, "rope", causal=True, num_kv_heads=KV_HKV, pattern=layer.pattern
    ).double()
    again.load_state_dict(layer.state_dict())  # strict: no v_proj either
    _, twin = _pair("rope", causal=True, window=5)
    twin.load_state_dict(
        layer.state_dict() | {"v_proj.weight": layer.k_proj.weight, "v_proj.bias": layer.k_proj.bias}
    )
    x = torch.randn(2, 9, KV_E, dtype=torch.float64)
    torch.testing.assert_close(again(x), twin(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            {"pattern": posenc.layers.patterns.LayerSpec("rope", value_from_key="yes")},
            "value_from_key must be True or False",
        ),
        (
            {"pattern": posenc.layers.patterns.LayerSpec("rope"), "value_from_key": True},
            "give either pattern or .*value_from_key, not both",
        ),
    ],
)
def test_bad_pattern_value_from_key_names_the_parameter(options, match):
    with pytest.raises(ValueError, match=match):
        posenc.MultiheadAttention(KV_E, KV_H, "rope", causal=True, **options)


@pytest.mark.parametrize("encoding", ["rope", "rope:partial_rotary_factor=0.5"])
def test_switch_rope_pairing_keeps_a_k_eq_v_layer(encoding):
    """Switching the pairing permutes ``k_proj``'s rows, and so a K = V layer's value channels: its
    ``out_proj`` columns are permuted with them and the output stays (the twin is left unswitched)."""
    shared, twin = _pair(encoding, causal=True)
    x = torch.randn(2, 9, KV_E, dtype=torch.float64)
    assert posenc.switch_rope_pairing_(shared, "interleaved") == 1
    torch.testing.assert_close(shared(x), twin(x), rtol=1e-12, atol=1e-12)
