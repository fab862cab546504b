"""The position rules of the attention layers (posenc.layers.positions): positions restart at each packed
document; a position-dependent query scale (the continuous log temperature, Llama 4's floored form)."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.layers.patterns import LayerSpec, LogQueryTemperature, QueryTemperature
from posenc.layers.positions import temperature_factors


def test_document_positions_restart():
    ids = torch.tensor([[0, 0, 0, 1, 1, 4, 4, 4, 4]])
    assert posenc.layers.positions.document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]


# ----------------------------------------------------------------------------
# The continuous log temperature (Inkling's global layers): queries at position ``p`` scaled by ``1 + alpha
# * ln(max((p + 1) / n_floor, 1))``, beside Llama 4's floored form (tests/layers/test_patterns.py).


ALPHA, N_FLOOR = 0.3, 5


def _formula(positions: torch.Tensor, alpha: float, n_floor: float) -> torch.Tensor:
    p = positions.double()
    return 1.0 + alpha * torch.log(torch.clamp((p + 1.0) / n_floor, min=1.0))


def _hf_inkling_queries(n_floor: int | None, length: int) -> torch.Tensor:
    """The queries HF's InklingAttention (a global, ``"hybrid"`` layer) hands its attention function."""
    transformers = pytest.importorskip("transformers")
    inkling = pytest.importorskip("transformers.models.inkling.modeling_inkling")
    from transformers.models.inkling.configuration_inkling import InklingTextConfig

    seen = {}

    def probe(module, query, key, value, attention_mask, **kwargs):
        seen["q"] = query.detach().clone()
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    transformers.AttentionInterface.register("posenc_probe", probe)
    config = InklingTextConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, layer_types=["hybrid"], log_scaling_n_floor=n_floor, log_scaling_alpha=ALPHA,
        rel_extent=8, d_rel=4,
    )  # fmt: skip
    config._attn_implementation = "posenc_probe"
    torch.manual_seed(0)
    attention = inkling.InklingAttention(config, 0)
    with torch.no_grad():
        attention(torch.randn(1, length, 32), attention_mask=None)
    return seen["q"]


def _reference_layer_output(layer, x, positions, alpha, n_floor):
    """The layer computed by hand: q scaled by the formula, causal softmax attention (float64)."""
    batch, length, width = x.shape
    heads, dim = layer.num_heads, layer.head_dim
    q = layer.q_proj(x).view(batch, length, heads, dim).transpose(1, 2)
    k = layer.k_proj(x).view(batch, length, heads, dim).transpose(1, 2)
    v = layer.v_proj(x).view(batch, length, heads, dim).transpose(1, 2)
    q = q * _formula(positions, alpha, n_floor).view(1, 1, -1, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(dim)
    s = s.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), -math.inf)
    out = torch.softmax(s, -1) @ v
    return layer.out_proj(out.transpose(1, 2).reshape(batch, length, width))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_log_temperature_equals_hf_inkling():
    length = 40
    scale = _hf_inkling_queries(N_FLOOR, length) / _hf_inkling_queries(None, length)  # [1, H, T, D]
    want = scale[0, 0, :, 0]
    torch.testing.assert_close(scale, want.view(1, 1, -1, 1).expand_as(scale), rtol=1e-6, atol=1e-6)
    positions = torch.arange(length)[None]
    got = temperature_factors(LogQueryTemperature(n_floor=N_FLOOR, alpha=ALPHA), positions)
    assert got.shape == (1, 1, length, 1)
    torch.testing.assert_close(got[0, 0, :, 0], want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        got[0, 0, :, 0].double(), _formula(positions[0], ALPHA, N_FLOOR), rtol=1e-6, atol=0
    )
    assert float(want[: N_FLOOR - 1].max()) == 1.0 and float(want[-1]) > 1.5  # flat, then grows: can fail


def test_continuous_and_floored_forms_differ_between_the_floor_steps():
    positions = torch.arange(0, 64)[None]
    log_form = LogQueryTemperature(n_floor=8, alpha=0.5).factors(positions)[0, 0, :, 0]
    floored = QueryTemperature(floor_scale=8, attn_scale=0.5).factors(positions)[0, 0, :, 0]
    # the floored form is constant on [8k - 1, 8k + 7); the continuous one grows at every position
    assert bool((log_form[8:].diff() > 0).all())
    assert bool((floored[8:15].diff() == 0).all())


@pytest.mark.parametrize("backend", ["eager", "sdpa", "blocked"])
def test_a_layer_with_the_log_temperature_equals_the_formula_with_gradients(backend):
    temperature = LogQueryTemperature(n_floor=4, alpha=0.4)
    layer = posenc.MultiheadAttention(32, 2, "nope", causal=True, query_temperature=temperature).double()
    x = torch.randn(2, 30, 32, dtype=torch.float64, requires_grad=True)
    with posenc.backends.use_backend(backend):
        got = layer(x)
    assert layer.last_backend == backend
    want = _reference_layer_output(layer, x, torch.arange(30), 0.4, 4)
    # the factors are float32 (as HF's tau): float32's rounding of them, in float64 attention
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    weight = torch.linspace(-1, 1, got.numel(), dtype=got.dtype).view_as(got)
    params = [x, *layer.parameters()]
    for g, w in zip(
        torch.autograd.grad((got * weight).sum(), params), torch.autograd.grad((want * weight).sum(), params)
    ):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_cached_decoding_continues_the_temperature():
    layer = posenc.MultiheadAttention(
        32, 2, "nope", causal=True, query_temperature=LogQueryTemperature(n_floor=3, alpha=0.5)
    ).double()
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        cache = posenc.KVCache()
        steps = [layer(x[:, :6], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(6, 16)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-12)


def test_a_model_pattern_carries_the_log_temperature():
    """Inkling-style recipe: sliding RoPE layers and a global NoPE layer with the log temperature."""
    temperature = LogQueryTemperature(n_floor=4, alpha=0.2)
    pattern = [LayerSpec("rope", window=4), LayerSpec("nope", temperature=temperature)]
    model = posenc.TransformerLM(20, 16, 2, 2, pattern=pattern)
    attentions = [m for m in model.modules() if isinstance(m, posenc.MultiheadAttention)]
    assert [a.query_temperature for a in attentions] == [None, temperature]
    model(torch.randint(0, 20, (1, 9)))


@pytest.mark.parametrize(
    "options,name",
    [
        ({"n_floor": 0}, "n_floor"),
        ({"n_floor": -8}, "n_floor"),
        ({"n_floor": math.inf}, "n_floor"),
        ({"n_floor": 8, "alpha": math.nan}, "alpha"),
        ({"n_floor": 8, "position_offset": math.inf}, "position_offset"),
    ],
)
def test_bad_log_temperature_names_the_field(options, name):
    with pytest.raises(ValueError, match=name):
        LogQueryTemperature(**options)


def test_a_layer_refuses_something_else_as_its_temperature():
    with pytest.raises(ValueError, match="LogQueryTemperature"):
        posenc.MultiheadAttention(16, 2, "nope", causal=True, query_temperature=1.1)
