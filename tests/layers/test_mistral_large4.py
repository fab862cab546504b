"""Mistral Large 4's position terms against HF: the learned log-position query temperature
(``MistralLarge4TextSoftmaxScaling``), its attention (MLA with LeRoPE and the temperature) and the
``mistral-large4`` recipe's layout (``no_rope_layers``).

The references are HF transformers' Mistral Large 4 modules on tiny random configs (nothing is
downloaded), with random nonzero ``alpha``, ``scale`` and ``bias``.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.layers.mla import LatentCache, MultiLatentAttention
from posenc.layers.patterns import LearnedLogTemperature, LogPositionQueryScaling, layer_pattern

ml4 = pytest.importorskip("transformers.models.mistral_large4.modeling_mistral_large4")
from transformers import MistralLarge4TextConfig  # noqa: E402
from transformers.cache_utils import KVSharingDict  # noqa: E402

E, H = 32, 4


def _config(**overrides) -> MistralLarge4TextConfig:
    options = {
        "hidden_size": E,
        "num_attention_heads": H,
        "num_key_value_heads": H,
        "num_hidden_layers": 4,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 6,
        "v_head_dim": 10,
        "kv_lora_rank": 12,
        "index_topk": 64,  # more than any test's keys: DSA selects every key, attention is dense
        "index_head_dim": 16,
        "index_n_heads": 2,
        "max_position_embeddings": 4096,
        **overrides,
    }
    config = MistralLarge4TextConfig(**options)
    config._attn_implementation = "sdpa"
    return config


def _randomize(*modules: torch.nn.Module, seed: int = 0) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in modules:
            for param in module.parameters():
                param.normal_(0.0, 0.3)


# ---------------------------------------------------------------------------- the temperature


def test_temperature_equals_hf_softmax_scaling():
    hf = ml4.MistralLarge4TextSoftmaxScaling(H).double()
    _randomize(hf)
    mine = LogPositionQueryScaling(H).double()
    mine.load_state_dict(hf.state_dict())  # HF's names: scale, bias
    positions = torch.tensor([[0, 1, 2, 3, 100, 4095, 70000], [9, 10, 11, 500, 501, 502, 1 << 20]])
    q = torch.randn(2, H, positions.shape[1], 5, dtype=torch.float64)
    expected = hf(q, positions, head_dim_first=True)
    torch.testing.assert_close(mine(q, positions), expected, rtol=1e-12, atol=1e-12)
    # the layer's form: factors [B, H, T, 1]
    assert mine.factors(positions).shape == (2, H, positions.shape[1], 1)
    # float32 as well (HF casts to the query dtype, posenc computes in float32: the same numbers)
    hf32, mine32 = hf.float(), mine.float()
    torch.testing.assert_close(mine32(q.float(), positions), hf32(q.float(), positions, head_dim_first=True))


def test_temperature_starts_as_the_identity_as_hf_initialises_it():
    scaling = LogPositionQueryScaling(3)
    assert scaling.scale.tolist() == [0.0] * 3 and scaling.bias.tolist() == [1.0] * 3
    config = _config(num_hidden_layers=1)
    model = ml4.MistralLarge4TextModel(config)  # post_init runs HF's _init_weights
    hf_scaling = model.layers[0].self_attn.softmax_scaling
    torch.testing.assert_close(scaling.scale, hf_scaling.scale[:3].detach())
    torch.testing.assert_close(scaling.bias, hf_scaling.bias[:3].detach())
    assert bool((model.rotary_emb.alpha == 0).all())  # LeRoPE's alpha too
    layer = posenc.MultiheadAttention(E, H, "rope:learned_frequencies=true", causal=True)
    assert bool((layer.encoding.alpha == 0).all())


def test_layer_builds_its_own_temperature_and_saves_it():
    spec = posenc.layers.patterns.LayerSpec("rope", temperature=LearnedLogTemperature())
    first = posenc.MultiheadAttention(E, H, "rope", causal=True, pattern=spec)
    second = posenc.MultiheadAttention(E, H, "rope", causal=True, pattern=spec)
    assert isinstance(first.query_temperature, LogPositionQueryScaling)
    assert first.query_temperature is not second.query_temperature
    assert {"query_temperature.scale", "query_temperature.bias"} <= set(first.state_dict())
    assert first.pattern.temperature == LearnedLogTemperature()


def test_temperature_in_the_layer_equals_the_formula_at_cached_positions():
    """A decoding step scales its query with its own position: q · (s_h ln(p + 1) + b_h) written out."""
    torch.manual_seed(4)
    layer = posenc.MultiheadAttention(E, H, "nope", causal=True, query_temperature=LearnedLogTemperature())
    twin = posenc.MultiheadAttention(E, H, "nope", causal=True)
    twin.load_state_dict(layer.state_dict(), strict=False)
    with torch.no_grad():
        layer.query_temperature.scale.normal_()
        layer.query_temperature.bias.normal_()
    x = torch.randn(1, 6, E)
    weights = layer(x, need_weights=True)[1]
    s, b = layer.query_temperature.scale.detach(), layer.query_temperature.bias.detach()
    q = twin.q_proj(x).view(1, 6, H, -1).transpose(1, 2)
    k = twin.k_proj(x).view(1, 6, H, -1).transpose(1, 2)
    factor = (
        s[None, :, None, None] * torch.log(torch.arange(6.0) + 1)[None, None, :, None]
        + b[None, :, None, None]
    )
    logits = (q * factor) @ k.transpose(-1, -2) * twin.scale
    logits = logits.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(weights, logits.softmax(-1), atol=1e-5, rtol=1e-5)


def test_wrong_head_count_is_named():
    with pytest.raises(ValueError, match=r"query_temperature.*3 heads.*num_heads=4"):
        posenc.MultiheadAttention(E, H, "rope", causal=True, query_temperature=LogPositionQueryScaling(3))
    with pytest.raises(ValueError, match="query_temperature"):
        MultiLatentAttention.from_hf_config(_config(), query_temperature=LogPositionQueryScaling(2))
    with pytest.raises(ValueError, match="num_heads"):
        LogPositionQueryScaling(0)
    with pytest.raises(ValueError, match="query_temperature"):
        posenc.MultiheadAttention(E, H, "rope", causal=True, query_temperature="learned")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the attention (MLA)


def _mla_pair(seed: int = 0, dtype=torch.float64, **overrides):
    """HF ``MistralLarge4TextAttention`` (a RoPE layer), its model's rotary embedding, and posenc's MLA
    with LeRoPE and the learned temperature holding the same random weights."""
    config = _config(**overrides)
    hf = ml4.MistralLarge4TextAttention(config, layer_idx=0).to(dtype)
    rotary = ml4.MistralLarge4TextRotaryEmbedding(config)
    _randomize(hf, rotary, seed=seed)
    mla = MultiLatentAttention.from_hf_config(
        config,
        rope=posenc.encodings.rope.RoPE(
            head_dim=config.qk_rope_head_dim,
            rope_parameters=dict(config.rope_parameters),
            max_position_embeddings=config.max_position_embeddings,
            learned_frequencies=True,
        ),
        query_temperature=LearnedLogTemperature(),
        norm_eps=config.rms_norm_eps,
    ).to(dtype)
    state = {
        key.replace("softmax_scaling.", "query_temperature."): value
        for key, value in hf.state_dict().items()
        if not key.startswith("indexer.")
    }
    state["rope.alpha"] = rotary.alpha.detach()
    mla.load_state_dict(state)
    return hf, rotary, mla


def _hf_attention(hf, rotary, x, positions):
    cos_sin = rotary(x, positions)
    length = x.shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None, None].expand(x.shape[0], 1, -1, -1)
    out, _, _ = hf(x, cos_sin, allowed, KVSharingDict(), positions)
    return out


@pytest.mark.parametrize("positions", [torch.arange(9)[None], torch.arange(600, 609)[None]])
def test_mla_with_lerope_and_temperature_equals_hf_attention(positions):
    hf, rotary, mla = _mla_pair()
    assert bool((rotary.alpha != 0).all()) and bool((mla.query_temperature.scale != 0).all())
    x = torch.randn(2, 9, E, dtype=torch.float64)
    expected = _hf_attention(hf, rotary, x, positions.expand(2, -1))
    torch.testing.assert_close(mla(x, positions=positions), expected, rtol=1e-6, atol=1e-6)
    assert mla.scale == pytest.approx(hf.scaling, rel=1e-15)


def test_gradients_reach_alpha_scale_and_bias_as_hf():
    hf, rotary, mla = _mla_pair(seed=2)
    x = torch.randn(1, 7, E, dtype=torch.float64)
    grad_out = torch.randn(1, 7, E, dtype=torch.float64)
    (_hf_attention(hf, rotary, x, torch.arange(7)[None]) * grad_out).sum().backward()
    (mla(x) * grad_out).sum().backward()
    pairs = {
        "rope.alpha": rotary.alpha,
        "query_temperature.scale": hf.softmax_scaling.scale,
        "query_temperature.bias": hf.softmax_scaling.bias,
    }
    params = dict(mla.named_parameters())
    for name, reference in pairs.items():
        grad = params[name].grad
        assert grad is not None and bool((grad != 0).any()), name
        torch.testing.assert_close(grad, reference.grad.to(grad.dtype), rtol=1e-5, atol=1e-7, msg=name)


def test_mla_cached_decoding_equals_the_full_forward():
    _, _, mla = _mla_pair(seed=3)
    x = torch.randn(2, 8, E, dtype=torch.float64)
    full = mla(x)
    cache = LatentCache()
    steps = [mla(x[:, :3], cache=cache)] + [mla(x[:, t : t + 1], cache=cache) for t in range(3, 8)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------- the recipe


@pytest.mark.parametrize("num_layers", [4, 9, 12])
def test_recipe_layout_equals_hf(num_layers):
    config = MistralLarge4TextConfig(num_hidden_layers=num_layers)
    layers = layer_pattern("mistral-large4", num_layers)
    for layer, uses_rope in zip(layers, config.no_rope_layers, strict=True):
        assert (layer.encoding != "nope") == bool(uses_rope)
        assert layer.temperature == LearnedLogTemperature()  # every layer, RoPE and NoPE (HF)
    enc = posenc.build(layers[0].encoding, head_dim=config.qk_rope_head_dim)
    hf_rotary = ml4.MistralLarge4TextRotaryEmbedding(config)
    torch.testing.assert_close(enc.inv_freq, hf_rotary.inv_freq, rtol=0, atol=0)
    assert enc.attention_scale == hf_rotary.attention_scaling
    assert enc.pairing == "interleaved" and enc.alpha is not None


def test_recipe_model_decodes_with_the_cache_as_the_full_pass_and_trains_every_term():
    torch.manual_seed(5)
    model = posenc.TransformerLM(50, E, 8, H, pattern="mistral-large4")
    learned = [name for name, _ in model.named_parameters() if "alpha" in name or "query_temperature" in name]
    assert len([name for name in learned if "alpha" in name]) == 6  # the RoPE layers: 0-2, 4-6
    assert len([name for name in learned if "query_temperature" in name]) == 16
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in learned:
                param.normal_(0.0, 0.5)
    tokens = torch.randint(0, 50, (2, 10))
    model.eval()
    with torch.no_grad():
        full = model(tokens)
        cache = posenc.KVCache()
        steps = [model(tokens[:, :4], cache=cache)] + [
            model(tokens[:, t : t + 1], cache=cache) for t in range(4, 10)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
    model.train()
    model(tokens).logsumexp(-1).sum().backward()
    params = dict(model.named_parameters())
    for name in learned:
        assert params[name].grad is not None and bool((params[name].grad != 0).any()), name


def test_hf_alpha_loads_into_every_rope_layer_of_the_recipe():
    """HF keeps one alpha per model; posenc's recipe gives each RoPE layer its own: the same tensor
    loaded into each gives each HF's cos/sin (a model whose head size is HF's rotary slice, 8)."""
    config = _config()
    rotary = ml4.MistralLarge4TextRotaryEmbedding(config)
    _randomize(rotary, seed=6)
    model = posenc.TransformerLM(50, config.qk_rope_head_dim * H, 4, H, pattern="mistral-large4")
    positions = torch.tensor([[0, 1, 5, 511, 512, 2000]])
    hf_cos, hf_sin = rotary(torch.zeros(1), positions)
    half = config.qk_rope_head_dim // 2
    loaded = 0
    for block in model.blocks:
        if block.attn.encoding.name == "rope":
            enc = posenc.encodings.rope.load_lerope_alpha_(block.attn.encoding, rotary.alpha)
            cos, sin = enc.cos_sin(positions)
            torch.testing.assert_close(cos, hf_cos[..., :half], rtol=0, atol=1e-6)
            torch.testing.assert_close(sin, hf_sin[..., :half], rtol=0, atol=1e-6)
            loaded += 1
    assert loaded == 3


def test_worked_numbers_of_conventions_11_5():
    """docs/conventions.md §11.5: s = 0.2, b = 0.9 at p = 0, 7, 1023 (0.2 · ln(p + 1) + 0.9 by hand)."""
    scaling = LogPositionQueryScaling(1)
    with torch.no_grad():
        scaling.scale.fill_(0.2)
        scaling.bias.fill_(0.9)
    factors = scaling.factors(torch.tensor([[0, 7, 1023]])).flatten()
    torch.testing.assert_close(factors.detach(), torch.tensor([0.9, 1.3158883, 2.2862944]), atol=1e-6, rtol=0)
