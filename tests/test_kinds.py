"""One contract per kind: the kind bases checked by ``@register``, the LayerContext a layer hands its
encoding, derived float32 buffers that survive casts, ``to_empty()`` and meta-device construction,
the one RoPE cos/sin cache, the scaling registry's examples and the parsed :class:`Spec`.

The registry-wide tests are generated from ``posenc.available()`` with the contract tests' example
builder; expected outputs come from a twin layer built the ordinary way or from formulas written
here.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import posenc
from posenc.encodings import rope_scaling
from posenc.encodings.base import BiasEncoding, LayerContext, PositionalEncoding, RotaryEncoding
from posenc.encodings.registry import build_for_layer, format_spec, register, resolve
from posenc.encodings.rope_scaling import RopeScaling, rope_scaling_example
from posenc.encodings.spec import Spec
from posenc.kernels.rope import MAX_CACHED_ROWS, RotaryTables
from test_contract import EMBED, HEAD_DIM, HEADS, make_encoding

NAMES = posenc.available()


def example_spec(name: str) -> str:
    """The registered name with its ``example_options`` as a spec string (what a user would write)."""
    return format_spec(name, posenc.get_class(name).example_options)


def derived(enc: PositionalEncoding) -> dict[str, torch.Tensor]:
    return {name: enc.get_buffer(name) for name in enc.derived_buffers}


def _unregister(name: str) -> None:
    from posenc.encodings import registry

    registry._REGISTRY.pop(name, None)


# ---------------------------------------------------------------------------- kinds and @register


def test_register_refuses_a_class_that_misses_its_hook():
    with pytest.raises(TypeError, match=r"BiasEncoding but does not implement bias_at\(\)"):

        @register("test-no-hook")
        class NoHook(BiasEncoding):
            def __init__(self, num_heads: int) -> None:
                super().__init__()

    assert "test-no-hook" not in posenc.available()


def test_register_refuses_a_class_outside_the_kind_bases():
    with pytest.raises(TypeError, match="must derive from exactly one of AbsoluteEncoding"):

        @register("test-no-base")
        class NoBase(PositionalEncoding):
            kind = posenc.Kind.ROTARY

            def rotate(self, q, k, q_pos, k_pos):
                return q, k

    assert "test-no-base" not in posenc.available()


def test_register_refuses_derived_buffers_without_reset_buffers():
    with pytest.raises(TypeError, match=r"does not implement reset_buffers\(\)"):

        @register("test-no-reset")
        class NoReset(RotaryEncoding):
            derived_buffers = ("inv_freq",)

            def rotate(self, q, k, q_pos, k_pos):
                return q, k

    assert "test-no-reset" not in posenc.available()


# ---------------------------------------------------------------------------- LayerContext


@pytest.fixture
def own_dim_encoding():
    """A test-only BIAS encoding whose own option happens to be called ``dim`` (not the model width)."""

    @register("test-own-dim")
    class OwnDim(BiasEncoding):
        """A zero bias with an unrelated option named dim."""

        layer_sizes = ("num_heads",)

        def __init__(self, num_heads: int, dim: int = 3) -> None:
            super().__init__()
            self.num_heads, self.dim = num_heads, dim

        def bias_at(self, head, q_pos, k_pos):
            return (head * 0 + q_pos * 0 + k_pos * 0).float()

    yield OwnDim
    _unregister("test-own-dim")


def test_an_option_named_dim_is_not_overwritten_by_the_layer(own_dim_encoding):
    layer = posenc.MultiheadAttention(32, 4, encoding="test-own-dim")
    assert layer.encoding.dim == 3 and layer.encoding.config() == {"num_heads": 4, "dim": 3}
    assert posenc.MultiheadAttention(32, 4, encoding="test-own-dim:dim=5").encoding.dim == 5
    model = posenc.TransformerLM(7, 32, 1, 4, "test-own-dim", max_len=16)
    assert model.blocks[0].attn.encoding.dim == 3


def test_layer_context_fills_only_declared_options():
    context = LayerContext(num_heads=4, head_dim=8, dim=32, causal=True, max_len=64)
    t5 = build_for_layer("t5", context)
    assert t5.config()["num_heads"] == 4 and t5.config()["bidirectional"] is False
    assert build_for_layer("t5:bidirectional=true", context).config()["bidirectional"] is True  # spec wins
    learned = build_for_layer("learned", context)
    assert learned.config() == {"dim": 32, "max_len": 64}
    assert build_for_layer("learned:max_len=8", context).config()["max_len"] == 8
    with pytest.raises(ValueError, match="spec sets num_heads=8 but the layer has num_heads=4"):
        build_for_layer("t5:num_heads=8", context)
    with pytest.raises(ValueError, match="encoding was built with head_dim=16 but the layer has head_dim=8"):
        build_for_layer(posenc.build("rope", head_dim=16), context)


@pytest.mark.parametrize("name", NAMES)
def test_layer_device_and_dtype_reach_the_encoding(name):
    layer = posenc.MultiheadAttention(
        EMBED, HEADS, encoding=example_spec(name), causal=True, device="meta", dtype=torch.float64
    )
    for param_name, param in layer.encoding.named_parameters():
        assert param.device.type == "meta", f"{name}.{param_name} is on {param.device}"
        assert param.dtype == torch.float64, f"{name}.{param_name} is {param.dtype}"
    for buffer_name, buffer in derived(layer.encoding).items():
        assert buffer.device.type == "meta" and buffer.dtype in (torch.float32, torch.int64), buffer_name


# ---------------------------------------------------------------------------- derived buffers


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_cast_keeps_derived_tables_exact_and_float32(name, dtype):
    enc = make_encoding(name)
    cast = copy.deepcopy(enc).to(dtype)
    for buffer_name, table in derived(cast).items():
        assert not table.is_floating_point() or table.dtype == torch.float32, f"{name}.{buffer_name}"
        torch.testing.assert_close(table, derived(enc)[buffer_name], rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_float64_layer_gives_the_float32_outputs(name):
    layer = posenc.MultiheadAttention(EMBED, HEADS, encoding=make_encoding(name), causal=True).eval()
    x = torch.randn(2, 9, EMBED)
    want = layer(x).double()
    got = layer.to(torch.float64)(x.double())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


UNBOUND = [
    name
    for name in NAMES
    if all(
        p.default is not p.empty
        for key, p in posenc.encodings.registry.options(name).items()
        if key not in ("self",)
    )
    and posenc.get_class(name).layer_sizes
]


@pytest.mark.parametrize("name", UNBOUND)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_an_unbound_encoding_can_be_cast_then_bound(name, dtype):
    """``posenc.build("rope").to(torch.bfloat16)`` raised AttributeError; the layer binds it afterwards."""
    spec = example_spec(name)
    enc = posenc.build(spec).to(dtype)
    layer = posenc.MultiheadAttention(EMBED, HEADS, encoding=enc, causal=True).eval()
    twin = posenc.MultiheadAttention(EMBED, HEADS, encoding=spec, causal=True).eval()
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(2, 7, EMBED)
    torch.testing.assert_close(layer(x), twin(x), rtol=0, atol=0)


def test_unbound_rope_is_among_the_cast_cases():
    assert "rope" in UNBOUND  # the case of the bug report


@pytest.mark.parametrize("name", NAMES)
def test_layer_built_on_meta_then_to_empty_equals_its_twin(name):
    spec = example_spec(name)
    twin = posenc.MultiheadAttention(EMBED, HEADS, encoding=spec, causal=True).eval()
    with torch.device("meta"):
        layer = posenc.MultiheadAttention(EMBED, HEADS, encoding=spec, causal=True)
    layer = layer.to_empty(device="cpu").eval()
    layer.load_state_dict(twin.state_dict())
    x = torch.randn(2, 11, EMBED)
    torch.testing.assert_close(layer(x), twin(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_model_built_on_meta_then_to_empty_equals_its_twin(name):
    spec = example_spec(name)
    twin = posenc.TransformerLM(13, EMBED, 2, HEADS, spec, max_len=32).eval()
    with torch.device("meta"):
        model = posenc.TransformerLM(13, EMBED, 2, HEADS, spec, max_len=32)
    model = model.to_empty(device="cpu").eval()
    model.load_state_dict(twin.state_dict())
    tokens = torch.randint(0, 13, (2, 12))
    torch.testing.assert_close(model(tokens), twin(tokens), rtol=0, atol=0)


def test_yarn_built_on_meta_keeps_its_frequencies():
    """The case of the bug report: yarn on meta was off by 0.31 after to_empty()."""
    spec = "rope:scaling=yarn,factor=4,original_max_position_embeddings=64"
    with torch.device("meta"):
        layer = posenc.MultiheadAttention(EMBED, HEADS, encoding=spec, causal=True)
    layer.to_empty(device="cpu")
    want, scale = rope_scaling.rope_scaled_inv_freq(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "head_dim": HEAD_DIM}
    )
    torch.testing.assert_close(layer.encoding.inv_freq, want, rtol=0, atol=0)
    positions = torch.arange(5, dtype=torch.float32)[:, None] * want
    torch.testing.assert_close(layer.encoding.cos_cached[:5], positions.cos() * scale)


# ---------------------------------------------------------------------------- the RoPE cache


def _rotate_half_float32(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]`` rotated with rotate_half pairing, angles in float32 (as the cache does)."""
    angles = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def test_far_positions_do_not_grow_the_cache():
    enc = posenc.build("rope", head_dim=8, cache_size=16)
    x = torch.randn(1, 2, 3, 8)
    positions = torch.tensor([[3, 100, 10**7]])
    got, _ = enc.rotate(x, x, positions, positions)
    assert enc.cos_cached.shape[0] <= max(16, MAX_CACHED_ROWS)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    torch.testing.assert_close(got, _rotate_half_float32(x, positions, inv_freq))


def test_rotary_tables_are_the_cache_of_every_rotary_encoding():
    rotary = [n for n in NAMES if posenc.get_class(n).kind is posenc.Kind.ROTARY]
    assert {"rope", "xpos", "axial_rope", "mrope"} <= set(rotary)
    for name in rotary:
        enc = make_encoding(name)
        if any(param.requires_grad for param in enc.parameters()):
            continue  # learned frequencies (rope_mixed) change every step: nothing to cache
        assert isinstance(enc.tables, RotaryTables), name


def test_rotary_tables_serve_cached_and_far_positions_alike():
    inv_freq = torch.tensor([1.0, 0.1, 0.01])
    tables = RotaryTables(inv_freq, attention_scale=0.5, cache_size=4)
    positions = torch.tensor([[0, 3, 7], [MAX_CACHED_ROWS + 5, 1, 2]])
    cos, sin = tables.tables(positions)
    angles = positions.float()[..., None] * inv_freq
    torch.testing.assert_close(cos, 0.5 * angles.cos())
    torch.testing.assert_close(sin, 0.5 * angles.sin())


# ---------------------------------------------------------------------------- RoPE scaling


def test_rope_scaling_carries_the_options_of_both_forms():
    from_spec = posenc.build("rope:scaling=yarn,factor=4,original_max_position_embeddings=4096", head_dim=16)
    from_dict = posenc.build(
        "rope",
        head_dim=16,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    )
    want = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=4096)
    assert from_spec.scaling == want and from_dict.scaling == want
    with pytest.raises(ValueError, match="need a scaling type"):
        RopeScaling.from_options(None, factor=4.0)


@pytest.mark.parametrize("rope_type", rope_scaling.rope_scaling_types())
def test_every_scaling_type_has_an_example_that_builds(rope_type):
    config, seq_len = rope_scaling_example(rope_type, 64, 16, 4.0)
    assert config["rope_type"] == rope_type
    enc = posenc.build("rope", head_dim=16, rope_parameters=config)
    assert enc.rope_type == rope_type and math.isfinite(enc.attention_scale)
    if rope_type in rope_scaling.LENGTH_DEPENDENT:
        assert seq_len is not None and seq_len > 64


def test_a_new_scaling_type_appears_in_the_figure():
    from posenc.viz import PlotOptions, make_figure

    @rope_scaling._scaling("test-halved", example=lambda original, pairs, factor: ({"factor": 2.0}, None))
    def halved(config, seq_len=None):
        return rope_scaling.linear_inv_freq({**config, "factor": 2.0}, seq_len)

    try:
        enc = posenc.build("rope", head_dim=16)
        fig = make_figure(enc, "scaling", PlotOptions(length=64))
        titles = {ax.get_title() for ax in fig.axes}
        assert set(rope_scaling.rope_scaling_types()) <= titles
        assert "test-halved" in titles
    finally:
        rope_scaling._SCALINGS.pop("test-halved")
        rope_scaling._EXAMPLES.pop("test-halved")


def test_a_scaling_type_without_an_example_is_refused():
    with pytest.raises(TypeError):
        rope_scaling._scaling("test-no-example")  # type: ignore[call-arg]


# ---------------------------------------------------------------------------- Spec


def test_resolve_parses_once_into_a_spec():
    spec = resolve("t5:num_buckets=16,bidirectional=false")
    assert isinstance(spec, Spec) and spec.cls is posenc.get_class("t5")
    assert spec.options == {"num_buckets": 16, "bidirectional": False}
    assert str(spec) == "t5:num_buckets=16,bidirectional=False"
    assert posenc.build(spec, num_heads=2).config()["num_buckets"] == 16


def test_a_model_parses_each_spec_string_once(monkeypatch):
    from posenc.encodings import registry

    calls = []
    original = registry.parse_spec
    monkeypatch.setattr(registry, "parse_spec", lambda text: calls.append(text) or original(text))
    posenc.TransformerLM(7, 32, 4, 2, ["t5", "t5", "alibi", "alibi"], max_len=16)
    assert sorted(calls) == ["alibi", "t5"]
