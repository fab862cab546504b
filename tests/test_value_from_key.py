"""K = V (Gemma 4's global layers, ``attention_k_eq_v``): ``MultiheadAttention(value_from_key=True)``
takes its values from the key projection before the encoding acts (before RoPE), and has no ``v_proj``.

The reference is a twin layer with its own ``v_proj`` holding the key projection's weights: the same
output, and the key projection's gradient is the sum of the twin's two gradients. (Gemma 4 through
``posenc.hf`` is compared with HF in tests/test_hf.py.)
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.layers.decode import StaticDecodeStep

E, H, HKV = 32, 4, 2


def _pair(encoding: str, **options):
    shared = posenc.MultiheadAttention(
        E, H, encoding, num_kv_heads=HKV, value_from_key=True, **options
    ).double()
    twin = posenc.MultiheadAttention(E, H, encoding, num_kv_heads=HKV, **options).double()
    state = shared.state_dict()
    state.update({"v_proj.weight": state["k_proj.weight"], "v_proj.bias": state["k_proj.bias"]})
    twin.load_state_dict(state)
    return shared, twin


@pytest.mark.parametrize("encoding", ["rope", "alibi", "sinusoidal", "shaw"])
def test_values_are_the_key_projection_before_the_encoding(encoding):
    shared, twin = _pair(encoding, causal=True)
    assert shared.v_proj is None and not any(k.startswith("v_proj") for k in shared.state_dict())
    x = torch.randn(2, 13, E, dtype=torch.float64)
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
    x = torch.randn(2, 14, E, dtype=torch.float64)
    with torch.no_grad():
        outputs = []
        for layer in (shared, twin):
            cache = posenc.KVCache(**cache_options)
            steps = [layer(x[:, :8], cache=cache)] + [
                layer(x[:, t : t + 1], cache=cache) for t in range(8, 14)
            ]
            outputs.append(torch.cat(steps, 1))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-12, atol=1e-12)


def test_static_decode_step_and_cross_attention():
    shared, twin = _pair("rope", causal=True)
    shared.eval(), twin.eval()
    x = torch.randn(2, 12, E, dtype=torch.float64)
    with torch.no_grad():
        cache = posenc.KVCache(max_length=16)
        shared(x[:, :8], cache=cache)
        step = StaticDecodeStep(shared, cache)
        steps = torch.cat([step(x[:, t : t + 1], step.next_position()) for t in range(8, 12)], 1)
        torch.testing.assert_close(steps, twin(x)[:, 8:], rtol=1e-12, atol=1e-12)
    cross_shared, cross_twin = _pair("rope")
    context = torch.randn(2, 9, E, dtype=torch.float64)
    torch.testing.assert_close(cross_shared(x, context), cross_twin(x, context), rtol=1e-12, atol=1e-12)


def test_value_from_key_must_be_a_bool():
    with pytest.raises(ValueError, match="value_from_key"):
        posenc.MultiheadAttention(E, H, "rope", value_from_key="yes")


def test_pattern_carries_value_from_key_both_ways():
    """``LayerSpec.value_from_key``: a layer built from the pattern has K = V (no ``v_proj``), reports
    it in its ``pattern``, and a layer built from that pattern is the same layer."""
    spec = posenc.layers.patterns.LayerSpec("rope", window=5, value_from_key=True)
    layer = posenc.MultiheadAttention(E, H, "rope", causal=True, num_kv_heads=HKV, pattern=spec).double()
    assert layer.v_proj is None and layer.value_from_key
    assert layer.pattern.value_from_key and layer.pattern.window == 5
    assert not posenc.MultiheadAttention(E, H, "rope").pattern.value_from_key
    again = posenc.MultiheadAttention(
        E, H, "rope", causal=True, num_kv_heads=HKV, pattern=layer.pattern
    ).double()
    again.load_state_dict(layer.state_dict())  # strict: no v_proj either
    _, twin = _pair("rope", causal=True, window=5)
    twin.load_state_dict(
        layer.state_dict() | {"v_proj.weight": layer.k_proj.weight, "v_proj.bias": layer.k_proj.bias}
    )
    x = torch.randn(2, 9, E, dtype=torch.float64)
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
        posenc.MultiheadAttention(E, H, "rope", causal=True, **options)


@pytest.mark.parametrize("encoding", ["rope", "rope:partial_rotary_factor=0.5"])
def test_switch_rope_pairing_keeps_a_k_eq_v_layer(encoding):
    """Switching the pairing permutes ``k_proj``'s rows, and so a K = V layer's value channels: its
    ``out_proj`` columns are permuted with them and the output stays (the twin is left unswitched)."""
    shared, twin = _pair(encoding, causal=True)
    x = torch.randn(2, 9, E, dtype=torch.float64)
    assert posenc.switch_rope_pairing_(shared, "interleaved") == 1
    torch.testing.assert_close(shared(x), twin(x), rtol=1e-12, atol=1e-12)
