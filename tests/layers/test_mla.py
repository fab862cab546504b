"""MultiLatentAttention (DeepSeek MLA, decoupled RoPE) against HF ``DeepseekV3Attention`` with copied weights.

The reference is HF transformers' DeepSeek-V3 attention (and V2's, whose rotary layout differs by
a permutation of the rotary channels) on tiny random configs, run in float64 through HF's sdpa path
(HF's eager path takes the softmax in float32 whatever the dtype). Nothing is downloaded.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.backends import NoBackendError, available_backends
from posenc.layers.mla import LatentCache, MultiLatentAttention

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV2Config, DeepseekV3Config, DynamicCache  # noqa: E402
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (  # noqa: E402
    DeepseekV2Attention,
    DeepseekV2RotaryEmbedding,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

E, H = 32, 4

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 0.8,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

CONFIGS = {
    "v3": {},
    "no_q_lora": {"q_lora_rank": None},
    "rope_interleave_false": {"rope_interleave": False},
    "yarn": {"rope_parameters": YARN},
    "bias_no_nope": {"attention_bias": True, "qk_nope_head_dim": 0},
}


def _config(cls=DeepseekV3Config, **overrides):
    options = {
        "hidden_size": E,
        "num_attention_heads": H,
        "num_key_value_heads": H,
        "q_lora_rank": 16,
        "kv_lora_rank": 12,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 6,
        "v_head_dim": 10,
        "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        **overrides,
    }
    config = cls(**options)
    config._attn_implementation = "sdpa"
    return config


def _pair(seed: int = 0, dtype=torch.float64, **overrides):
    """HF attention, its rotary embedding and the posenc layer holding the same random weights."""
    config = _config(**overrides)
    torch.manual_seed(seed)
    hf = DeepseekV3Attention(config, layer_idx=0).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    mla = MultiLatentAttention.from_hf_config(config).to(dtype)
    mla.load_state_dict(hf.state_dict())
    return hf, DeepseekV3RotaryEmbedding(config), mla


def _hf_mask(q_len: int, past: int, padding=None, dtype=torch.float64):
    """HF's 4-D additive mask: causal with the cache offset, padding keys hidden."""
    k_len = past + q_len
    allowed = torch.arange(k_len)[None, :] <= torch.arange(past, k_len)[:, None]
    allowed = allowed[None, None]
    if padding is not None:
        allowed = allowed & ~padding[:, None, None, :]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))


def _hf(hf, rotary, x, positions, padding=None, cache=None, past=0):
    cos_sin = rotary(x, positions.expand(x.shape[0], -1))
    out, _ = hf(x, cos_sin, _hf_mask(x.shape[1], past, padding, x.dtype), past_key_values=cache)
    return out


# ---------------------------------------------------------------------------- forward, gradients


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_equals_hf(name):
    hf, rotary, mla = _pair(**CONFIGS[name])
    x = torch.randn(2, 9, E, dtype=torch.float64)
    positions = torch.arange(9)[None]
    torch.testing.assert_close(mla(x), _hf(hf, rotary, x, positions), rtol=0, atol=1e-12)
    assert mla.scale == pytest.approx(hf.scaling, rel=1e-15)
    # far positions (past YaRN's original length 16) through the positions argument
    far = torch.arange(40, 49)[None]
    torch.testing.assert_close(mla(x, positions=far), _hf(hf, rotary, x, far), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["v3", "no_q_lora", "yarn"])
def test_gradients_equal_hf(name):
    hf, rotary, mla = _pair(seed=1, **CONFIGS[name])
    x = torch.randn(2, 7, E, dtype=torch.float64)
    grad_out = torch.randn(2, 7, E, dtype=torch.float64)
    x_hf, x_mla = x.clone().requires_grad_(), x.clone().requires_grad_()
    (_hf(hf, rotary, x_hf, torch.arange(7)[None]) * grad_out).sum().backward()
    (mla(x_mla) * grad_out).sum().backward()
    torch.testing.assert_close(x_mla.grad, x_hf.grad, rtol=0, atol=1e-12)
    hf_params = dict(hf.named_parameters())
    mla_params = dict(mla.named_parameters())
    assert sorted(mla_params) == sorted(hf_params)
    for key, param in mla_params.items():
        assert param.grad is not None, key
        torch.testing.assert_close(param.grad, hf_params[key].grad, rtol=0, atol=1e-12, msg=key)


def test_non_causal_equals_hf_without_mask():
    hf, rotary, mla = _pair(seed=7, **CONFIGS["v3"])
    encoder = MultiLatentAttention.from_hf_config(hf.config, causal=False).double()
    encoder.load_state_dict(mla.state_dict())
    x = torch.randn(2, 6, E, dtype=torch.float64)
    cos_sin = rotary(x, torch.arange(6)[None].expand(2, -1))
    ref, _ = hf(x, cos_sin, torch.zeros(1, 1, 6, 6, dtype=torch.float64))  # every key visible
    torch.testing.assert_close(encoder(x), ref, rtol=0, atol=1e-12)


def test_float32_equals_hf_eager():
    hf, rotary, mla = _pair(dtype=torch.float32, **CONFIGS["yarn"])
    hf.config._attn_implementation = "eager"
    x = torch.randn(2, 8, E)
    positions = torch.arange(8)[None]
    cos_sin = rotary(x, positions.expand(2, -1))
    ref, ref_weights = hf(x, cos_sin, _hf_mask(8, 0, dtype=torch.float32))
    out, weights = mla(x, need_weights=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=2e-6)


def test_deepseek_v2_layout_gives_the_same_outputs():
    """V2 rotates the interleaved pairs in place; V3 (rope_interleave) de-interleaves first: same logits."""
    config = _config(DeepseekV2Config, rope_parameters=YARN)
    torch.manual_seed(2)
    hf = DeepseekV2Attention(config, layer_idx=0).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    mla = MultiLatentAttention.from_hf_config(config).double()
    mla.load_state_dict(hf.state_dict())
    x = torch.randn(2, 9, E, dtype=torch.float64)
    freqs = DeepseekV2RotaryEmbedding(config)(x, torch.arange(9)[None].expand(2, -1))
    ref, _ = hf(x, _hf_mask(9, 0), position_embeddings=freqs)
    # V2 rotates in float32 (``xq.float()``) whatever the dtype: float32 round-off, not float64's
    torch.testing.assert_close(mla(x), ref, rtol=0, atol=1e-7)


def test_softmax_scale_is_deepseek_yarn_mscale():
    # DeepSeek-V3: yarn, factor 40, mscale = mscale_all_dim = 1; q/k head 128 + 64.
    rope = "rope:scaling=yarn,factor=40,original_max_position_embeddings=4096,mscale=1,mscale_all_dim=1"
    mla = MultiLatentAttention(
        64, 2, kv_lora_rank=8, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=8, rope=rope
    )
    mscale = 0.1 * 1.0 * math.log(40.0) + 1.0
    assert mla.scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-15)
    assert mla.rope.attention_scale == pytest.approx(1.0)  # mscale / mscale_all_dim = 1
    plain = MultiLatentAttention(
        64, 2, kv_lora_rank=8, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=8
    )
    assert plain.scale == pytest.approx(192**-0.5, rel=1e-15)


# ---------------------------------------------------------------------------- cache


@pytest.mark.parametrize("name", ["v3", "yarn"])
@pytest.mark.parametrize("chunks", [(1,) * 7, (3, 1, 2, 1)])
def test_cached_decoding_equals_full_pass_and_hf_cache(name, chunks):
    hf, rotary, mla = _pair(seed=3, **CONFIGS[name])
    x = torch.randn(2, sum(chunks), E, dtype=torch.float64)
    full = _hf(hf, rotary, x, torch.arange(x.shape[1])[None])
    cache, hf_cache = LatentCache(), DynamicCache(config=hf.config)
    steps, start = [], 0
    for size in chunks:
        part = x[:, start : start + size]
        steps.append(mla(part, cache=cache))
        hf_step = _hf(hf, rotary, part, torch.arange(start, start + size)[None], cache=hf_cache, past=start)
        torch.testing.assert_close(steps[-1], hf_step, rtol=0, atol=1e-12)
        start += size
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)
    # the cache holds the normalised latent and the rotated rotary key, as HF's does, and nothing else
    entry = cache.get(0)
    assert len(cache) == x.shape[1]
    assert cache.numel_per_token() == mla.kv_lora_rank + mla.qk_rope_head_dim == 12 + 6
    torch.testing.assert_close(entry.latent, hf_cache.layers[0].keys[:, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(entry.k_rope, hf_cache.layers[0].values[:, 0], rtol=0, atol=1e-12)


def test_left_padding_with_cache_equals_hf():
    hf, rotary, mla = _pair(seed=4, **CONFIGS["yarn"])
    x = torch.randn(2, 8, E, dtype=torch.float64)
    padding = torch.zeros(2, 8, dtype=torch.bool)
    padding[1, :3] = True  # left padding of the second sequence
    positions = (~padding).long().cumsum(1).sub(1).clamp(min=0)
    ref = _hf(hf, rotary, x, positions, padding=padding)
    cache = LatentCache()
    first = mla(x[:, :5], key_padding_mask=padding[:, :5], cache=cache)
    rest = mla(x[:, 5:], cache=cache)
    out = torch.cat([first, rest], dim=1)
    real = ~padding
    torch.testing.assert_close(out[real], ref[real], rtol=0, atol=1e-12)
    assert out[padding].abs().max() == 0  # rows that see no key are zeros (posenc's rule)


# ---------------------------------------------------------------------------- backends


def test_every_backend_that_accepts_it_is_exact():
    """q/k width (d_n + d_r = 14) differs from v's (10): each backend states a reason or gets it right."""
    hf, rotary, mla = _pair(seed=5, **CONFIGS["v3"])
    x = torch.randn(2, 6, E, dtype=torch.float64)
    ref = _hf(hf, rotary, x, torch.arange(6)[None])
    mla(x)
    assert mla.last_backend == "sdpa"
    served = []
    for name in available_backends("cpu"):
        with posenc.use_backend(name):
            try:
                out = mla(x)
            except NoBackendError:
                continue
        served.append(name)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12, msg=name)
    assert {"sdpa", "eager"} <= set(served)


def test_bfloat16_runs_and_stays_close():
    hf, rotary, mla = _pair(seed=6, dtype=torch.float32, **CONFIGS["v3"])
    x = torch.randn(1, 5, E)
    ref = _hf(hf, rotary, x, torch.arange(5)[None])
    out = mla.to(torch.bfloat16)(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()


# ---------------------------------------------------------------------------- bad input


def _layer(**overrides):
    options = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, **overrides}
    return MultiLatentAttention(16, 2, **options)


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"qk_rope_head_dim": 3}, "qk_rope_head_dim"),
        ({"qk_rope_head_dim": 0}, "qk_rope_head_dim"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"kv_lora_rank": -4}, "kv_lora_rank"),
        ({"q_lora_rank": 0}, "q_lora_rank"),
        ({"v_head_dim": 0}, "v_head_dim"),
        ({"qk_nope_head_dim": -1}, "qk_nope_head_dim"),
        ({"dropout": 1.0}, "dropout"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"rope": "alibi"}, "rope"),
        ({"rope": "rope:pairing=interleaved"}, "rope_interleave"),
        ({"rope": "rope:head_dim=8"}, "head_dim"),
        ({"rope": "rope:rotary_dim=2"}, "qk_rope_head_dim"),
    ],
)
def test_bad_options_name_the_parameter(overrides, name):
    with pytest.raises(ValueError, match=name):
        _layer(**overrides)


def test_bad_calls_name_the_argument():
    mla = _layer()
    with pytest.raises(ValueError, match="x must have shape"):
        mla(torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match="cache must be a LatentCache"):
        mla(torch.randn(1, 3, 16), cache=posenc.KVCache())
    with pytest.raises(ValueError, match="positions"):
        mla(torch.randn(1, 3, 16), positions=torch.arange(4))
    with pytest.raises(ValueError, match="key_padding_mask"):
        mla(torch.randn(1, 3, 16), key_padding_mask=torch.zeros(1, 3))
