"""RoPE scaling types (posenc.encodings.rope_scaling) against HF ``ROPE_INIT_FUNCTIONS`` (transformers 5.23)
on tiny configs, plus properties: dynamic NTK against its formula and HF, the pretraining length required
and keys a type does not read refused (HF's own validation), every scaling type with an example that
builds and appears in the figure."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import posenc
import posenc.functional as F
from posenc.encodings import rope_scaling
from posenc.encodings.rope_scaling import RopeScaling, rope_scaling_example


def hf_config(head_dim: int, max_pos: int, params: dict) -> LlamaConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LlamaConfig(
            hidden_size=2 * head_dim,
            num_attention_heads=2,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rope_parameters=dict(params),
        )


def hf_init(head_dim: int, max_pos: int, params: dict, seq_len: int | None = None):
    config = hf_config(head_dim, max_pos, params)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, seq_len=seq_len)


LONG = [1.0, 2.0, 4.0, 8.0, 1.5, 3.0, 6.0, 12.0]

SHORT = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7]

CASES = [
    (16, 2048, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, None),
    (
        16,
        2048,
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5},
        None,
    ),
    (16, 2048, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, None),
    (16, 2048, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 1000),
    (16, 2048, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 4096),
    (16, 2048, {"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 3.0}, 9000),
    (
        128,
        4096,
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
        None,
    ),
    (
        128,
        16384,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        None,
    ),
    (
        64,
        16384,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        },
        None,
    ),
    (
        32,
        8192,
        {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 8.0,
            "original_max_position_embeddings": 1024,
            "attention_factor": 1.5,
        },
        None,
    ),
    (
        32,
        8192,
        {"rope_type": "yarn", "rope_theta": 1e4, "factor": None, "original_max_position_embeddings": 2048},
        None,
    ),
    (
        128,
        131072,
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        None,
    ),
    (
        32,
        8192,
        {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 2.0,
            "original_max_position_embeddings": 256,
            "partial_rotary_factor": 0.5,
        },
        None,
    ),
    (
        16,
        64,
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
            "short_factor": SHORT,
            "long_factor": LONG,
        },
        None,
    ),
    (
        16,
        64,
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
            "short_factor": SHORT,
            "long_factor": LONG,
        },
        17,
    ),
    (
        16,
        64,
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
            "short_factor": SHORT,
            "long_factor": LONG,
        },
        16,
    ),
    (
        16,
        64,
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
            "factor": 8.0,
            "short_factor": SHORT,
            "long_factor": LONG,
        },
        100,
    ),
    # p-RoPE (Gemma 4's global layers: partial_rotary_factor 0.25, base 1e6), other fractions and factors.
    (16, 2048, {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}, None),
    (
        64,
        2048,
        {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 8.0},
        None,
    ),
    (24, 2048, {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.3}, None),
    (32, 2048, {"rope_type": "proportional", "rope_theta": 10000.0, "factor": 2.0}, None),
    (32, 2048, {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.0}, None),
]


@pytest.mark.parametrize(("head_dim", "max_pos", "params", "seq_len"), CASES)
def test_matches_hf_rope_init_functions(head_dim, max_pos, params, seq_len):
    want_freq, want_scale = hf_init(head_dim, max_pos, params, seq_len)
    ours = {k: v for k, v in params.items() if v is not None}
    got_freq, got_scale = F.rope_inv_freq(
        head_dim, scaling={**ours, "max_position_embeddings": max_pos}, seq_len=seq_len
    )
    assert got_freq.dtype == torch.float32
    torch.testing.assert_close(got_freq, want_freq.float(), rtol=1e-6, atol=0)
    assert got_scale == pytest.approx(float(want_scale), rel=1e-12)


def test_default_matches_hf_llama_default():
    config = hf_config(64, 2048, {"rope_type": "default", "rope_theta": 500000.0})
    want, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    got, scale = F.rope_inv_freq(64, base=500000.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert scale == 1.0


def test_reference_numbers():
    """Hand-checked values of docs/conventions.md §7.5."""
    _, scale = F.rope_inv_freq(
        128, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    )
    assert scale == pytest.approx(1.138629, abs=1e-6)
    freq, scale = F.rope_inv_freq(
        8,
        scaling={
            "rope_type": "longrope",
            "original_max_position_embeddings": 16,
            "max_position_embeddings": 64,
            "short_factor": [1, 1, 1, 1],
            "long_factor": [1, 2, 4, 8],
        },
        seq_len=64,
    )
    torch.testing.assert_close(freq, torch.tensor([1.0, 0.05, 0.0025, 0.000125]))
    assert scale == pytest.approx(math.sqrt(1.5), abs=1e-6)
    freq, _ = F.rope_inv_freq(
        128,
        base=500000.0,
        scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    ratio = freq / F.rope_inv_freq(128, base=500000.0)[0]
    assert int((ratio == 1).sum()) == 29 and int((ratio == 0.125).sum()) == 29


def test_ntk_matches_rotary_embedding_torch_theta_rescale():
    import rotary_embedding_torch  # a test reference: the [test] extra installs it

    reference = rotary_embedding_torch.RotaryEmbedding(32, theta=10000, theta_rescale_factor=4.0)
    got, scale = F.rope_inv_freq(32, scaling={"rope_type": "ntk", "factor": 4.0})
    torch.testing.assert_close(got, reference.freqs.detach(), rtol=1e-6, atol=0)
    assert scale == 1.0
    # The formula written out: base' = base * factor^(d/(d-2)).
    base = 10000.0 * 4.0 ** (32 / 30)
    torch.testing.assert_close(
        got.double(), base ** (-torch.arange(0, 32, 2, dtype=torch.float64) / 32), rtol=1e-6, atol=0
    )


# ---------------------------------------------------------------------------- the module


def test_module_spec_string_and_rope_parameters_dict_agree_with_hf():
    params = {
        "rope_type": "yarn",
        "rope_theta": 500000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
    }
    want, want_scale = hf_init(64, 16384, params)
    enc = posenc.build(
        "rope:base=500000,scaling=yarn,factor=4,original_max_position_embeddings=4096", head_dim=64
    )
    torch.testing.assert_close(enc.inv_freq, want, rtol=1e-6, atol=0)
    assert enc.attention_scale == pytest.approx(want_scale)
    from_dict = posenc.build("rope", head_dim=64, rope_parameters=params)
    torch.testing.assert_close(from_dict.inv_freq, want, rtol=1e-6, atol=0)
    # Spec-string lists use '|'.
    lr = posenc.build(
        "rope:scaling=longrope,original_max_position_embeddings=16,max_position_embeddings=64,short_factor=1|1|1|1,long_factor=1|2|4|8",
        head_dim=8,
    )
    torch.testing.assert_close(lr.inv_freq, torch.tensor([1.0, 0.1, 0.01, 0.001]))


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
            "short_factor": SHORT,
            "long_factor": LONG,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
        {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "factor": 2.0},
    ],
)
@pytest.mark.parametrize("length", [10, 40])
def test_module_forward_matches_hf_rotary_embedding(params, length):
    """Forward-time behaviour (dynamic/longrope recompute from max(position)+1) equals HF's dynamic_rope_update."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    max_pos = 16 if params["rope_type"] != "yarn" else 64
    hf_rope = LlamaRotaryEmbedding(hf_config(16, max_pos, params))
    q = torch.randn(1, 2, length, 16)
    pos = torch.arange(length)[None]
    cos, sin = hf_rope(q, pos)
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    enc = posenc.build("rope", head_dim=16, rope_parameters=params, max_position_embeddings=max_pos)
    got, _ = enc.rotate(q, q, pos, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- NTK-alpha (HunYuan)
def _hunyuan_rotary(params: dict, head_dim: int = 16):
    """HF's own ``HunYuanDenseV1RotaryEmbedding`` on a tiny config."""
    hunyuan = pytest.importorskip("transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense")
    from transformers import HunYuanDenseV1Config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF warns that "dynamic" does not read alpha, then reads it
        config = HunYuanDenseV1Config(
            vocab_size=32, hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
            num_hidden_layers=1, intermediate_size=32, rope_parameters=dict(params),
        )  # fmt: skip
    return hunyuan.HunYuanDenseV1RotaryEmbedding(config), hunyuan.apply_rotary_pos_emb


#: HunYuan's checkpoints state NTK-alpha as "dynamic" with alpha (and a factor of 1.0 HF does not read).
HUNYUAN_ALPHA = {
    "rope_type": "dynamic",
    "alpha": 1000.0,
    "rope_theta": 10000.0,
    "factor": 1.0,
    "beta_fast": 32,
}


@pytest.mark.parametrize(
    "params", [HUNYUAN_ALPHA, {"rope_type": "ntk_alpha", "alpha": 50.0, "rope_theta": 500000.0}]
)
def test_ntk_alpha_equals_hf_hunyuan_rotary_embedding(params):
    hf_rope, apply_rotary = _hunyuan_rotary(params)
    assert hf_rope.rope_type == "ntk_alpha"  # HF relabels it: the same reading as posenc's
    q = torch.randn(2, 4, 23, 16)
    pos = torch.arange(100, 123)[None]
    cos, sin = hf_rope(q, pos)
    want, _ = apply_rotary(q, q, cos, sin)
    from_dict = posenc.build("rope", head_dim=16, rope_parameters=params)
    assert from_dict.scaling.type == "ntk" and from_dict.scaling.alpha == params["alpha"]
    alpha, base = params["alpha"], params["rope_theta"]
    spec = posenc.build(f"rope:base={base},scaling=ntk,alpha={alpha}", head_dim=16)
    for enc in (from_dict, spec):
        torch.testing.assert_close(enc.inv_freq, hf_rope.inv_freq, rtol=1e-6, atol=0)
        got, _ = enc.rotate(q, q, pos, pos)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the formula written out, float64: base * alpha^(d / (d - 2))
    stretched = base * alpha ** (16 / 14)
    formula = stretched ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    torch.testing.assert_close(spec.inv_freq.double(), formula, rtol=1e-6, atol=0)
    # alpha is the ntk type's s under HunYuan's name: the same frequencies as factor=alpha
    as_factor = posenc.build(f"rope:base={base},scaling=ntk,factor={alpha}", head_dim=16)
    torch.testing.assert_close(spec.inv_freq, as_factor.inv_freq, rtol=0, atol=0)
    assert posenc.build(spec.spec()).scaling == spec.scaling  # the spec round-trips


def test_ntk_alpha_bad_input_names_alpha():
    with pytest.raises(ValueError, match="alpha"):
        posenc.build("rope:scaling=ntk,alpha=0", head_dim=16)
    with pytest.raises(ValueError, match="alpha"):
        posenc.build("rope:scaling=ntk,alpha=-2", head_dim=16)
    with pytest.raises(ValueError, match="factor or alpha"):
        posenc.build("rope:scaling=ntk,alpha=4,factor=4", head_dim=16)
    with pytest.raises(ValueError, match="alpha"):
        F.rope_inv_freq(16, scaling={"rope_type": "ntk", "alpha": float("nan")})


def test_dynamic_in_attention_layer_uses_current_length():
    layer = posenc.MultiheadAttention(
        32, 2, encoding="rope:scaling=dynamic,factor=2,original_max_position_embeddings=8"
    )
    x = torch.randn(1, 20, 32)
    layer(x)
    want, _ = F.rope_inv_freq(
        16, scaling={"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 8}, seq_len=20
    )
    torch.testing.assert_close(layer.encoding.inv_freq, want)
    layer(x[:, :5])  # back below the original length: the paper's frequencies again
    torch.testing.assert_close(layer.encoding.inv_freq, F.rope_inv_freq(16)[0])


# ---------------------------------------------------------------------------- properties

head_dims = st.sampled_from([4, 8, 16, 64, 128])

bases = st.sampled_from([100.0, 10000.0, 500000.0])

factors = st.floats(min_value=1.01, max_value=64.0)


@settings(max_examples=40, deadline=None)
@given(head_dim=head_dims, base=bases, factor=factors)
def test_linear_is_default_divided_by_factor(head_dim, base, factor):
    got, _ = F.rope_inv_freq(head_dim, base, scaling={"rope_type": "linear", "factor": factor})
    plain, _ = F.rope_inv_freq(head_dim, base)
    torch.testing.assert_close(got, plain / factor, rtol=1e-6, atol=0)


@settings(max_examples=40, deadline=None)
@given(head_dim=head_dims, base=bases, original=st.integers(16, 8192))
def test_factor_one_is_identity(head_dim, base, original):
    plain, _ = F.rope_inv_freq(head_dim, base)
    common = {
        "factor": 1.0,
        "original_max_position_embeddings": original,
        "max_position_embeddings": original,
    }
    # Each type is given only the keys it reads (the pretraining length is not linear's or ntk's).
    lengths = ("original_max_position_embeddings", "max_position_embeddings")
    for rope_type in ("linear", "ntk", "dynamic", "yarn"):
        if rope_type == "ntk" and head_dim <= 2:
            continue
        keys = {k: v for k, v in common.items() if rope_type in ("dynamic", "yarn") or k not in lengths}
        got, scale = F.rope_inv_freq(
            head_dim, base, scaling={"rope_type": rope_type, **keys}, seq_len=original
        )
        torch.testing.assert_close(got, plain, rtol=1e-6, atol=0, msg=rope_type)
        assert scale == 1.0
    llama3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0, **common}
    torch.testing.assert_close(F.rope_inv_freq(head_dim, base, scaling=llama3)[0], plain, rtol=1e-6, atol=0)


@settings(max_examples=40, deadline=None)
@given(head_dim=head_dims, base=bases, factor=factors, original=st.integers(16, 8192), data=st.data())
def test_dynamic_is_default_below_original_length(head_dim, base, factor, original, data):
    seq_len = data.draw(st.one_of(st.none(), st.integers(1, original)))
    plain, _ = F.rope_inv_freq(head_dim, base)
    dyn = {"rope_type": "dynamic", "factor": factor, "original_max_position_embeddings": original}
    torch.testing.assert_close(
        F.rope_inv_freq(head_dim, base, scaling=dyn, seq_len=seq_len)[0], plain, rtol=1e-6, atol=0
    )
    longer, _ = F.rope_inv_freq(head_dim, base, scaling=dyn, seq_len=2 * original)
    assert bool((longer[1:] < plain[1:]).all())  # above the original length every slow pair slows down


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        ({"rope_type": "yarn", "factor": 0.0, "original_max_position_embeddings": 4096}, "factor"),
        ({"rope_type": "yarn", "factor": -2.0, "original_max_position_embeddings": 4096}, "factor"),
        ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
            "original_max_position_embeddings",
        ),
        (
            {"rope_type": "longrope", "short_factor": [1] * 4, "long_factor": [1] * 4},
            "original_max_position_embeddings",
        ),
        (
            {
                "rope_type": "longrope",
                "original_max_position_embeddings": 16,
                "short_factor": [1] * 3,
                "long_factor": [1] * 4,
            },
            "short_factor",
        ),
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "dynamic", "factor": 2.0}, "original_max_position_embeddings"),
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}, "low_freq_factor"),
        ({"rope_type": "linerar", "factor": 2.0}, "rope_type"),
    ],
)
def test_bad_scaling_parameters(scaling, match):
    with pytest.raises(ValueError, match=match):
        F.rope_inv_freq(8, scaling=scaling)


def test_bad_module_options():
    with pytest.raises(ValueError, match="factor"):
        posenc.build("rope:scaling=yarn,factor=0,original_max_position_embeddings=64", head_dim=8)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        posenc.build("rope:scaling=yarn,factor=4", head_dim=8)
    with pytest.raises(ValueError, match="scaling"):
        posenc.build("rope:factor=4", head_dim=8)
    with pytest.raises(ValueError, match="rope_parameters"):
        posenc.build(
            "rope", head_dim=8, scaling="linear", rope_parameters={"rope_type": "linear", "factor": 2.0}
        )


def test_spec_of_rope_parameters_dict_rebuilds_the_same_frequencies():
    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
        "partial_rotary_factor": 0.5,
    }
    enc = posenc.build("rope", head_dim=32, rope_parameters=params)
    again = posenc.build(enc.spec())
    assert "scaling=llama3" in enc.spec() and again.rotary_dim == 16
    torch.testing.assert_close(again.inv_freq, enc.inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(enc.inv_freq, hf_init(32, 4096, params)[0], rtol=1e-6, atol=0)


@pytest.mark.parametrize(("seq_len", "new_base"), [(4096, 30527.737), (8192, 72195.860)])
def test_dynamic_reference_bases(seq_len, new_base):
    """docs/conventions.md §7.5.3: factor 2, max_pos 2048, d = 128: the rescaled base at 4096 and 8192 tokens."""
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 2048}
    freq, _ = F.rope_inv_freq(128, scaling=scaling, seq_len=seq_len)
    assert float(freq[1]) == pytest.approx(new_base ** (-2 / 128), rel=1e-6)


# ---------------------------------------------------------------------------- p-RoPE ("proportional")


def test_proportional_reference_numbers():
    """docs/conventions.md §7.5.7: d = 16, base 10^6, p = 0.25 -> 2 rotating pairs [1, 10^(-6·2/16)], then zeros."""
    freq, scale = F.rope_inv_freq(
        16, scaling={"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}
    )
    want = torch.tensor([1.0, 1e6 ** (-2 / 16), 0, 0, 0, 0, 0, 0])
    torch.testing.assert_close(freq, want, rtol=1e-6, atol=0)
    assert scale == 1.0 and want[1].item() == pytest.approx(0.177828, abs=1e-6)


def test_proportional_spec_string_equals_hf_and_round_trips():
    params = {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "factor": 2.0}
    want, want_scale = hf_init(64, 4096, params)
    from_spec = posenc.build("rope:base=1000000,scaling=proportional,rotary_dim=16,factor=2", head_dim=64)
    from_dict = posenc.build("rope", head_dim=64, rope_parameters=params)
    for enc in (from_spec, from_dict, posenc.build(from_dict.spec()), posenc.build(from_spec.spec())):
        torch.testing.assert_close(enc.inv_freq, want, rtol=1e-6, atol=0)
        assert enc.attention_scale == want_scale == 1.0 and enc.rotary_dim == 64


def test_proportional_pairs_with_zero_frequency_are_not_rotated():
    """Half pairing over the whole head: channels (k, k + d/2) of the non-rotating pairs k pass unchanged."""
    enc = posenc.build("rope:scaling=proportional,rotary_dim=4", head_dim=16)
    q = torch.randn(1, 1, 5, 16, dtype=torch.float64)
    got, _ = enc.rotate(q, q, torch.arange(5)[None] + 3, torch.arange(5)[None])
    still = torch.tensor([2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15])
    torch.testing.assert_close(got[..., still], q[..., still], rtol=0, atol=0)
    assert not torch.allclose(got[..., [0, 1, 8, 9]], q[..., [0, 1, 8, 9]])


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        ({"rope_type": "proportional", "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"rope_type": "proportional", "partial_rotary_factor": -0.25}, "partial_rotary_factor"),
        ({"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 0.0}, "factor"),
        ({"rope_type": "proportional", "factor": -2.0}, "factor"),
    ],
)
def test_bad_proportional_parameters(scaling, match):
    with pytest.raises(ValueError, match=match):
        F.rope_inv_freq(16, scaling=scaling)


def test_bad_proportional_module_options():
    with pytest.raises(ValueError, match="rotary_dim"):
        posenc.build("rope:scaling=proportional,rotary_dim=5", head_dim=16)
    with pytest.raises(ValueError, match="rotary_dim"):
        posenc.build("rope:scaling=proportional,rotary_dim=18", head_dim=16)
    with pytest.raises(ValueError, match="head_dim"):
        F.rope_inv_freq(15, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5})


@pytest.mark.parametrize("name", ["rope", "mrope"])
def test_scaling_names_come_from_one_list(name):
    """RoPE's and M-RoPE's scaling types, typed options and their ranges are those rope_scaling lists."""
    from posenc.encodings import rope_scaling

    options = rope_scaling.RopeScaling.OPTIONS if name == "rope" else rope_scaling.FIXED_LENGTH_OPTIONS
    params = posenc.encodings.registry.options(name)
    assert set(options) <= set(params)
    assert not (set(rope_scaling.RopeScaling.OPTIONS) - set(options)) & set(params)
    ranges = posenc.encodings.registry.get_class(name).option_ranges
    assert all(ranges[k] == rope_scaling.SCALING_OPTION_RANGES[k] for k in options if k != "truncate")
    assert set(rope_scaling.SCALING_TYPES) == set(rope_scaling.rope_scaling_types())
    with pytest.raises(ValueError, match="unknown RoPE scaling") as error:
        posenc.build(f"{name}:scaling=yarm", head_dim=16)
    assert all(t in str(error.value) for t in rope_scaling.SCALING_TYPES)


def _hf_frequencies(config, layer_type=None):
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / base ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim), 1.0
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)


def _tiny(cls, **options):
    sizes = {"hidden_size": 64, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2}
    return cls(**sizes, **options)


def test_yarn_without_factor_or_pretraining_length_is_an_error():
    """The issue's case: it gave the default frequencies and scale 1.0; HF raises a KeyError."""
    with pytest.raises(KeyError, match="factor"):  # HF refuses the same dict
        transformers.LlamaConfig(rope_parameters={"rope_type": "yarn"}, max_position_embeddings=2048)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        F.rope_inv_freq(128, 1e4, {"rope_type": "yarn", "max_position_embeddings": 2048})


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "max_position_embeddings": 8192},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "max_position_embeddings": 8192,
        },
        {
            "rope_type": "longrope",
            "factor": 4.0,
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4,
            "max_position_embeddings": 64,
        },
    ],
    ids=["yarn", "llama3", "longrope"],
)
def test_the_model_length_does_not_stand_in_for_the_pretraining_length(scaling):
    """README: leaving original_max_position_embeddings out "is an error, not a guess"."""
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        F.rope_inv_freq(8, 1e4, scaling)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        posenc.build("rope", head_dim=8, rope_parameters=scaling)


def test_an_option_of_another_type_is_refused_naming_it_and_the_accepted_keys():
    """``short_factor`` on yarn was dropped without a word."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    for build in (
        lambda: F.rope_inv_freq(8, 1e4, {**yarn, "short_factor": [1.0] * 4}),
        lambda: posenc.build("rope", head_dim=8, rope_parameters={**yarn, "short_factor": [1.0] * 4}),
        lambda: posenc.build(
            "rope:scaling=yarn,factor=4,original_max_position_embeddings=64,short_factor=1|1|1|1", head_dim=8
        ),
    ):
        with pytest.raises(ValueError, match=r"'yarn' does not take 'short_factor'.*beta_fast"):
            build()


def test_a_key_no_one_reads_is_refused():
    """Phi-3.5-MoE's ``short_mscale`` changes HF's attention scale; posenc does not read it, so it is refused."""
    longrope = {
        "rope_type": "longrope",
        "original_max_position_embeddings": 16,
        "factor": 4.0,
        "short_factor": [1.0] * 4,
        "long_factor": [2.0] * 4,
        "short_mscale": 1.24,
    }
    with pytest.raises(ValueError, match="'short_mscale'"):
        posenc.build("rope", head_dim=8, rope_parameters=longrope)


def test_an_option_left_at_none_is_not_given():
    F.rope_inv_freq(8, 1e4, {"rope_type": "linear", "factor": 2.0, "beta_fast": None})


@pytest.mark.parametrize(
    "make",
    [
        # Llama 3.1: llama3 scaling, rope_theta inside rope_parameters (transformers 5).
        lambda: _tiny(
            transformers.LlamaConfig,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        lambda: _tiny(transformers.LlamaConfig, rope_theta=100000.0),  # SmolLM2
        # Qwen2.5 long-context card: the legacy "type" beside HF's added "rope_type".
        lambda: _tiny(
            transformers.Qwen2Config,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        ),
        # Ministral 3: llama_4_scaling_beta and max_position_embeddings inside rope_parameters.
        lambda: _tiny(transformers.Ministral3Config),
    ],
    ids=["llama3.1", "smollm2", "qwen2.5-yarn", "ministral3"],
)
def test_real_configs_build_with_hf_frequencies(make):
    config = make()
    want, scale = _hf_frequencies(config)
    rope = posenc.build(
        "rope",
        head_dim=config.head_dim,
        rope_parameters=dict(config.rope_parameters),
        max_position_embeddings=config.max_position_embeddings,
    )
    torch.testing.assert_close(rope.inv_freq, want.float(), rtol=1e-6, atol=0)
    assert rope.attention_scale == pytest.approx(scale)


def test_gemma3_per_layer_dicts_build():
    config = _tiny(
        transformers.Gemma3TextConfig,
        num_hidden_layers=2,
        intermediate_size=32,
        vocab_size=32,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    for layer_type in ("sliding_attention", "full_attention"):
        want, _ = _hf_frequencies(config, layer_type)
        params = dict(config.rope_parameters[layer_type])
        rope = posenc.build("rope", head_dim=16, rope_parameters=params)
        torch.testing.assert_close(rope.inv_freq, want.float(), rtol=1e-6, atol=0)


def test_qwen2_vl_sections_pass_to_mrope():
    """``mrope_section`` is read by M-RoPE, not by the frequencies: HF ignores it at validation too."""
    params = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    enc = posenc.build("mrope", head_dim=16, rope_parameters=params)
    assert enc.mrope_section == [2, 3, 3]


def _dynamic_inv_freq(base: float, dim: int, factor: float, trained: int, seq_len: int) -> torch.Tensor:
    """The dynamic-NTK formula (bloc97 / emozilla, as HF states it), in float64."""
    longest = max(seq_len, trained)
    scaled = base * (factor * longest / trained - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / scaled ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def _rotate_half(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """HF's ``x·cos + rotate_half(x)·sin`` for ``x [B, H, T, D]``, ``positions [T]``, in float64."""
    angles = positions.double()[:, None] * inv_freq.double()[None]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.double() * cos + rotated.double() * sin).to(x.dtype)


NOMIC = {"base": 1000.0, "head_dim": 64, "factor": 2.0, "served": 512, "trained": 2048}


def _layer_rope(trained: int = 16, factor: float = 2.0, cache_size: int = 2048):
    return posenc.build(
        f"rope:scaling=dynamic,factor={factor},original_max_position_embeddings={trained},cache_size={cache_size}",
        head_dim=8,
    )


@pytest.mark.parametrize("seq_len", [None, 1, 100, 512, 1000, 2048, 4096])
def test_a_served_length_below_the_trained_one_does_not_scale(seq_len):
    """vLLM issue 52665 (nomic-embed-text-v1 served at 512, trained at 2048, factor 2): vLLM's
    ``2·512/2048 − 1 = −0.5`` made the base negative, a fractional power of it complex, then 1e38
    and nan. Here the larger of the two lengths is the trained one: no scaling up to 2048."""
    n = NOMIC
    scaling = {
        "rope_type": "dynamic",
        "factor": n["factor"],
        "original_max_position_embeddings": n["trained"],
        "max_position_embeddings": n["served"],
    }
    got, scale = F.rope_inv_freq(n["head_dim"], n["base"], scaling, seq_len=seq_len)
    want = _dynamic_inv_freq(n["base"], n["head_dim"], n["factor"], n["trained"], seq_len or 1)
    assert torch.isfinite(got).all() and scale == 1.0
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_dynamic_matches_hf_at_and_past_the_trained_length():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters

    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0},
    )
    for seq_len in (100, 2048, 4096, 10000):
        want, _ = _compute_dynamic_ntk_parameters(config, "cpu", seq_len=seq_len)
        got, _ = F.rope_inv_freq(
            64, 1000.0, {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 2048}, seq_len
        )
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def test_after_a_long_call_a_short_one_equals_a_fresh_module():
    """HF PR 46624: HF's dynamic update kept the grown frequencies after a long call until a call fell
    below the original length, so a shorter call rotated unlike a fresh module. Here every call uses
    its own length: below and above the trained length, the second call equals a fresh module's."""
    torch.manual_seed(0)
    for short in (8, 24):
        rope = _layer_rope()
        long_q = torch.randn(1, 2, 64, 8)
        rope.rotate(long_q, long_q, torch.arange(64)[None], torch.arange(64)[None])
        q = torch.randn(1, 2, short, 8)
        pos = torch.arange(short)[None]
        after_long, _ = rope.rotate(q, q, pos, pos)
        fresh, _ = _layer_rope().rotate(q, q, pos, pos)
        torch.testing.assert_close(after_long, fresh, rtol=0, atol=0)
        want = _rotate_half(q, pos[0], _dynamic_inv_freq(10000.0, 8, 2.0, 16, short))
        torch.testing.assert_close(after_long, want, rtol=1e-5, atol=1e-5)


def test_positions_past_factor_times_the_trained_length_are_rotated_by_the_formula():
    """vLLM PR 55910: vLLM's cache held ``factor × max_position_embeddings`` positions, and a longer
    sequence read past it. Here the tables grow: position 200 of a model trained at 16 with factor 2
    (cache built for 32 rows) gets the formula's rotation at the call's length 201."""
    torch.manual_seed(0)
    rope = _layer_rope(trained=16, factor=2.0, cache_size=32)
    q = torch.randn(1, 1, 201, 8)
    pos = torch.arange(201)[None]
    got, _ = rope.rotate(q, q, pos, pos)
    want = _rotate_half(q, pos[0], _dynamic_inv_freq(10000.0, 8, 2.0, 16, 201))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(got.abs().max()))


# ----------------------------------------------------------------------------
# One contract per kind: the kind bases checked by ``@register``, the LayerContext a layer hands its
# encoding, derived float32 buffers that survive casts, ``to_empty()`` and meta-device construction, the one
# RoPE cos/sin cache, the scaling registry's examples and the parsed :class:`Spec`.


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
