"""The kind bases and what every encoding shares (posenc.encodings.base): the kinds checked by ``@register``,
the LayerContext a layer hands its encoding, derived float32 buffers that survive casts, ``to_empty()``
and meta-device construction; real-valued positions taken by the families that define them and refused
with the reason by the encodings defined on whole positions (docs/conventions.md §7.11).

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
from _contract import EMBED, HEAD_DIM, HEADS, make_encoding
from posenc.encodings import rope_scaling
from posenc.encodings.base import BiasEncoding, Kind, LayerContext, PositionalEncoding
from posenc.encodings.registry import build_for_layer, format_spec, register

NAMES = posenc.available()


def example_spec(name: str) -> str:
    """The registered name with its ``example_options`` as a spec string (what a user would write)."""
    return format_spec(name, posenc.get_class(name).example_options)


def derived(enc: PositionalEncoding) -> dict[str, torch.Tensor]:
    return {name: enc.get_buffer(name) for name in enc.derived_buffers}


def _unregister(name: str) -> None:
    from posenc.encodings import registry

    registry._REGISTRY.pop(name, None)


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


# ----------------------------------------------------------------------------
# Real-valued positions: taken by the families that define them (rotary: an angle p·θ for any real p),
# refused with the reason by the encodings defined on whole positions (docs/conventions.md §7.11).


FLOAT_FAMILIES = ["rope", "hope:train_length=64", "fope:train_length=64", "mrope", "xpos"]


def test_which_encodings_take_real_positions():
    takes = {name for name in posenc.available() if posenc.get_class(name).float_positions}
    assert {"rope", "hope", "fope", "mrope", "xpos"} <= takes
    assert all(posenc.get_class(name).kind is Kind.ROTARY for name in takes)
    assert not {"learned", "t5", "shaw", "deberta", "alibi", "sinusoidal", "axial_rope"} & takes


def test_rope_at_real_positions_is_the_formula():
    """Pair k of a query at real position p turns by p·θ_k (written out in float64)."""
    enc = posenc.build("rope", head_dim=16)
    pos = torch.tensor([[0.0, 0.25, 1.5, 7.125, 100.75]])
    q = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    got, _ = enc.rotate(q, q, pos, pos)
    want = q.clone()
    for k in range(8):
        angle = pos[0].double() * 10000.0 ** (-2 * k / 16)
        x1, x2 = q[..., k], q[..., k + 8]
        want[..., k] = x1 * angle.cos() - x2 * angle.sin()
        want[..., k + 8] = x2 * angle.cos() + x1 * angle.sin()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the half-way angle differs from both neighbours: the fraction is used, not truncated
    assert not torch.allclose(got[:, :, 1], q[:, :, 1])


@pytest.mark.parametrize("spec", FLOAT_FAMILIES)
def test_layer_takes_real_positions_and_caches(spec):
    layer = posenc.MultiheadAttention(32, 2, spec, causal=True).eval()
    x = torch.randn(2, 9, 32)
    pos = torch.cumsum(torch.rand(2, 9) + 0.1, dim=1)  # random increasing real positions
    full = layer(x, positions=pos)
    assert layer.last_backend == "sdpa"
    cache = posenc.KVCache()
    steps = [
        layer(x[:, :4], positions=pos[:, :4], cache=cache),
        layer(x[:, 4:], positions=pos[:, 4:], cache=cache),
    ]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    eager = posenc.MultiheadAttention(32, 2, spec, causal=True, backend="eager").eval()
    eager.load_state_dict(layer.state_dict())
    if hasattr(layer.encoding, "sin_coef"):  # FoPE's coefficients are buffers of the encoding
        eager.encoding.load_state_dict(layer.encoding.state_dict())
    torch.testing.assert_close(eager(x, positions=pos), full, rtol=1e-5, atol=1e-5)
    # whole numbers as reals give what the integers give
    whole = torch.arange(9).expand(2, -1)
    torch.testing.assert_close(
        layer(x, positions=whole.float()), layer(x, positions=whole), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("learned", "one row per whole position"),
        ("t5", "buckets whole relative distances"),
        ("shaw", "clipped whole distance"),
        ("deberta", "log-buckets"),
        ("alibi", "alibi is defined on whole positions"),
        ("sinusoidal", "sinusoidal is defined on whole positions"),
        ("axial_rope:grid_width=4", "patch index"),
    ],
)
def test_integer_only_encodings_refuse_real_positions_with_the_reason(spec, reason):
    layer = posenc.MultiheadAttention(32, 2, spec, causal=True)
    x = torch.randn(1, 5, 32)
    with pytest.raises(ValueError, match=r"positions must be an integer tensor") as err:
        layer(x, positions=torch.tensor([0.0, 1.0, 2.5, 3.0, 4.0]))
    assert reason in str(err.value)
    layer(x, positions=torch.arange(5))  # whole positions still work


def test_bad_real_positions():
    layer = posenc.MultiheadAttention(32, 2, "rope", causal=True)
    x = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match="non-negative"):
        layer(x, positions=torch.tensor([0.0, -0.5, 1.0]))
    with pytest.raises(ValueError, match="finite"):
        layer(x, positions=torch.tensor([0.0, math.nan, 1.0]))
    out = layer(x, positions=torch.tensor([0.0, 0.5, 1.0], dtype=torch.float16))  # widened to float32
    assert out.shape == x.shape


@pytest.mark.parametrize("backend", ["sdpa", "blocked", "segments"])
def test_every_rotary_backend_agrees_with_eager_at_real_positions(backend):
    """Windows send rotary layers to the blocked and segment splits: real positions reach them too."""
    x = torch.randn(2, 40, 32)
    pos = torch.cumsum(torch.rand(2, 40) + 0.1, dim=1)
    torch.manual_seed(0)
    eager = posenc.MultiheadAttention(32, 2, "rope", causal=True, window=8, backend="eager").eval()
    fast = posenc.MultiheadAttention(32, 2, "rope", causal=True, window=8, backend=backend).eval()
    fast.load_state_dict(eager.state_dict())
    got = fast(x, positions=pos)
    assert fast.last_backend == backend
    torch.testing.assert_close(got, eager(x, positions=pos), rtol=1e-5, atol=1e-5)
