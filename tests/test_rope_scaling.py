"""RoPE scaling types against HF ``ROPE_INIT_FUNCTIONS`` (transformers 5.23) on tiny configs, plus properties."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import posenc
from posenc import functional as F


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


@pytest.mark.parametrize("name", ["rope", "mrope"])
def test_scaling_is_one_value_and_its_flat_options_are_the_spec_form(name):
    """``scaling`` takes one value (type name, ``RopeScaling`` or a dict of its fields); the flat
    options of spec strings and keywords are gathered into it: one encoding, config and spec."""
    from posenc.encodings.rope_scaling import RopeScaling

    cls = posenc.encodings.registry.get_class(name)
    options = {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0}
    flat = posenc.build(
        f"{name}:scaling=yarn,factor=4,original_max_position_embeddings=64,beta_fast=16", head_dim=16
    )
    forms = [
        cls(head_dim=16, scaling=RopeScaling("yarn", **options)),
        cls(head_dim=16, scaling={"type": "yarn", **options}),
        cls(head_dim=16, scaling={"rope_type": "yarn", **options}),
        cls(head_dim=16, scaling="yarn", **options),
        posenc.build(name, head_dim=16, scaling=RopeScaling("yarn", **options)),
        posenc.build(name, head_dim=16, scaling="yarn", **options),
    ]
    q = torch.randn(1, 2, 40, 16)
    pos = torch.arange(40)[None]
    want = flat.rotate(q, q, pos, pos)
    for enc in forms:
        assert enc.scaling == RopeScaling("yarn", **options) == flat.scaling
        assert enc.config() == flat.config() and enc.spec() == flat.spec()
        assert all(torch.equal(a, b) for a, b in zip(enc.rotate(q, q, pos, pos), want))
    assert posenc.build(flat.spec()).config() == flat.config()
    with pytest.raises(ValueError, match="not both"):
        cls(head_dim=16, scaling=RopeScaling("yarn", factor=4.0), original_max_position_embeddings=64)
    with pytest.raises(ValueError, match="unknown option"):
        cls(head_dim=16, scaling={"type": "yarn", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="must be a type name"):
        cls(head_dim=16, scaling=4)
    with pytest.raises(ValueError, match="need a scaling type"):
        cls(head_dim=16, scaling={"factor": 4.0})
    with pytest.raises(ValueError, match="must be > 0"):
        cls(head_dim=16, scaling=RopeScaling("linear", factor=-1.0))  # the declared ranges, every form


def test_mrope_scaling_takes_only_fixed_length_options():
    from posenc.encodings.rope_scaling import RopeScaling

    with pytest.raises(ValueError, match=r"unknown option.*short_factor"):
        posenc.build("mrope", head_dim=16, scaling=RopeScaling("longrope", short_factor=[1.0] * 8))
    with pytest.raises(TypeError, match="short_factor"):
        posenc.encodings.registry.get_class("mrope")(head_dim=16, scaling="longrope", short_factor=[1.0] * 8)


def test_the_scaling_options_are_spelled_in_rope_scaling_only():
    """Issue 34 item 6: RoPE's scaling options are written once, in rope_scaling.py."""
    from pathlib import Path

    folder = Path(posenc.__file__).parent / "encodings"
    spelled = sorted(p.name for p in folder.glob("*.py") if "beta_fast" in p.read_text(encoding="utf-8"))
    assert spelled == ["rope_scaling.py"]
