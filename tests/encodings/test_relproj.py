"""Relative-projection bias (Inkling; x-transformers ``RelativeProjPositionalBias``): each query mixes a
bank of bias-versus-distance curves with weights from its own input, ``bias(i, j) = (r_i · P)[i − j]``
for ``0 <= i − j < extent``.

References: x-transformers' module with copied weights; HF's own ``InklingAttention`` (the
``position_bias`` it hands its attention function, read through a probe registered in HF's
``AttentionInterface``: the bias and, on global layers, its log temperature); and the formula
written out here. The backends that evaluate token states (eager, sdpa, flex) are checked against
eager by the registry-generated tests/test_backends.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.encodings.base import TokenStates
from posenc.layers.patterns import LogQueryTemperature

E, H = 32, 2


def _formula(x, weight, bank, n_floor=None, alpha=0.0):
    """The bias written out with loops over heads and pairs, float64."""
    batch, length, _ = x.shape
    d_rel, extent = bank.shape
    r = (x @ weight.T).view(batch, length, H, d_rel)
    bias = torch.zeros(batch, H, length, length, dtype=torch.float64)
    for i in range(length):
        scale = 1.0 if n_floor is None else 1.0 + alpha * math.log(max((i + 1) / n_floor, 1.0))
        for j in range(length):
            if 0 <= i - j < extent:
                bias[:, :, i, j] = (r[:, i] @ bank[:, i - j]) * scale
    return bias


def test_equals_x_transformers_relative_proj_positional_bias():
    x_transformers = pytest.importorskip("x_transformers.x_transformers")
    if not hasattr(x_transformers, "RelativeProjPositionalBias"):  # the [test] floor (2.1) predates it
        pytest.skip("this x-transformers has no RelativeProjPositionalBias (the newest release has)")
    enc = posenc.build("relproj:d_rel=3,extent=6,bias=true", num_heads=H, dim=E).double()
    reference = x_transformers.RelativeProjPositionalBias(E, H, num_distance_basis=3, max_dist=6).double()
    with torch.no_grad():
        reference.to_distance_weights[0].weight.copy_(enc.to_weights.weight)
        reference.to_distance_weights[0].bias.copy_(enc.to_weights.bias)
        reference.distance_bank.copy_(enc.bank)
    x = torch.randn(2, 11, E, dtype=torch.float64)
    got = enc.bias_from_states(TokenStates.same_sequence(enc.token_states(x)))
    torch.testing.assert_close(got, reference(x), rtol=1e-12, atol=1e-12)
    assert float(got.abs().max()) > 0.01


def _hf_inkling(n_floor: int | None, length: int, seed: int = 0):
    """HF's InklingAttention (global "hybrid" layer) and the position_bias it hands its attention function."""
    transformers = pytest.importorskip("transformers")
    inkling = pytest.importorskip("transformers.models.inkling.modeling_inkling")
    from transformers.models.inkling.configuration_inkling import InklingTextConfig

    seen = {}

    def probe(module, query, key, value, attention_mask, position_bias=None, **kwargs):
        seen["bias"] = position_bias.detach().clone()
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    transformers.AttentionInterface.register("posenc_probe", probe)
    config = InklingTextConfig(
        vocab_size=32, hidden_size=E, num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=1,
        head_dim=16, layer_types=["hybrid"], log_scaling_n_floor=n_floor, log_scaling_alpha=0.3,
        rel_extent=7, d_rel=4,
    )  # fmt: skip
    config._attn_implementation = "posenc_probe"
    torch.manual_seed(seed)
    attention = inkling.InklingAttention(config, 0)  # float32: its short convolutions are float32
    with torch.no_grad():
        attention.rel_logits_proj.proj.normal_(0.0, 1.0)
        x = torch.randn(2, length, E)
        attention(x, attention_mask=None)
    return attention, x.double(), seen["bias"].double()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("n_floor", [None, 4])
def test_equals_hf_inkling_attention_s_position_bias(n_floor):
    hf, x, want = _hf_inkling(n_floor, 17)
    spec = "relproj:d_rel=4,extent=7" + (
        f",log_scaling_n_floor={n_floor},log_scaling_alpha=0.3" if n_floor else ""
    )
    enc = posenc.build(spec, num_heads=H, dim=E).double()
    weight, bank = hf.r_proj.weight.detach().double(), hf.rel_logits_proj.proj.detach().double()
    with torch.no_grad():
        enc.to_weights.weight.copy_(weight)
        enc.bank.copy_(bank)
        got = enc.bias_from_states(TokenStates.same_sequence(enc.token_states(x)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # HF runs in float32
    # the temperature is float32, as HF's tau
    torch.testing.assert_close(got, _formula(x, weight, bank, n_floor, 0.3), rtol=1e-6, atol=1e-6)
    if n_floor:  # the temperature matters at these positions
        assert (_formula(x, weight, bank) - want).abs().max() > 1e-2


def test_a_layer_decodes_as_it_runs_on_every_backend_that_serves_it():
    """Inkling's global layer: the relative-projection bias and the log temperature on q and on the bias."""
    n_floor = 3
    layer = posenc.MultiheadAttention(
        E, H, f"relproj:d_rel=4,extent=5,log_scaling_n_floor={n_floor},log_scaling_alpha=0.5", causal=True,
        query_temperature=LogQueryTemperature(n_floor=n_floor, alpha=0.5),
    ).double()  # fmt: skip
    with torch.no_grad():
        layer.encoding.bank.normal_(0.0, 1.0)
    x = torch.randn(2, 12, E, dtype=torch.float64, requires_grad=True)
    results = {}
    for backend in ("eager", "sdpa"):
        with posenc.backends.use_backend(backend):
            out = layer(x)
        weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        params = [x, *layer.parameters()]
        results[backend] = (out, torch.autograd.grad((out * weight).sum(), params))
    torch.testing.assert_close(results["sdpa"][0], results["eager"][0], rtol=1e-10, atol=1e-12)
    for g, w in zip(results["sdpa"][1], results["eager"][1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)
    assert results["eager"][1][-1].abs().max() > 0  # the bank gets a gradient
    with torch.no_grad():
        full = layer(x)
        cache = posenc.KVCache()
        steps = [layer(x[:, :5], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="token_states"), posenc.backends.use_backend("blocked"):
        layer(x)


@pytest.mark.parametrize(
    "spec,name",
    [
        ("relproj:extent=0", "extent"),
        ("relproj:d_rel=0", "d_rel"),
        ("relproj:log_scaling_n_floor=0", "log_scaling_n_floor"),
        ("relproj:log_scaling_alpha=nan", "log_scaling_alpha"),
    ],
)
def test_bad_options_name_the_option(spec, name):
    with pytest.raises(ValueError, match=name):
        posenc.build(spec, num_heads=H, dim=E)


def test_cross_attention_is_refused():
    layer = posenc.MultiheadAttention(E, H, "relproj")
    with pytest.raises(ValueError, match="self-attention"):
        layer(torch.randn(1, 3, E), torch.randn(1, 4, E))
