"""Per-layer attention recipes (posenc.layers.patterns): pattern options decoded with a cache equal the full
pass, bad options are named; the presets' layouts against HF's configurations."""

from __future__ import annotations

import pytest
import torch

import posenc
from _patterns import EMBED, HEADS, _grads, _layer
from posenc.layers.patterns import LayerSpec, QueryTemperature, layer_pattern


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "shaw", "learned", "cope"])
@pytest.mark.parametrize(
    "options",
    [{"window": 4}, {"chunk": 5}, {"documents": True}, {"prefix": 6}],
    ids=["window", "chunk", "documents", "prefix"],
)
def test_cached_decoding_equals_full_pass(name, options):
    length = 15
    layer_options = {k: v for k, v in options.items() if k in ("window", "chunk")}
    layer = _layer(name, **layer_options)
    if options.get("prefix") and layer.encoding.causal_only:
        pytest.skip(f"{name} is causal only: no prefix LM")
    x = torch.randn(2, length, EMBED, dtype=torch.float64)
    docs = torch.tensor([[0] * 6 + [1] * 9, [0] * 2 + [3] * 13]) if options.get("documents") else None
    prefix = options.get("prefix")
    full = layer(x, document_ids=docs, prefix_len=prefix)
    cache = posenc.KVCache()
    pieces, start = [], 0
    for size in [prefix, 4, 1, length - prefix - 5] if prefix else [4, 1, 6, 4]:
        step_docs = None if docs is None else docs[:, start : start + size]
        pieces.append(
            layer(x[:, start : start + size], document_ids=step_docs, prefix_len=prefix, cache=cache)
        )
        start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "blocked"])
def test_blocked_skips_keys_outside_the_window_and_documents(backend):
    """Key ranges with a start (windows, later documents) give what eager gives, gradients included."""
    layer = _layer("t5", window=5)
    x = torch.randn(2, 37, EMBED, dtype=torch.float64, requires_grad=True)
    docs = torch.tensor([[0] * 20 + [1] * 17, [0] * 3 + [1] * 30 + [2] * 4])
    with posenc.use_backend("eager"):
        ref = layer(x, document_ids=docs)
    with posenc.use_backend(backend):
        out = layer(x, document_ids=docs)
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-9)
    params = [x, *layer.parameters()]
    for g, w in zip(_grads(out, params), _grads(ref, params)):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "options,call,match",
    [
        ({"window": 0}, {}, "window must be a positive int"),
        ({"window": -3}, {}, "window must be a positive int"),
        ({"chunk": 0}, {}, "chunk must be a positive int"),
        ({"window": 2.5}, {}, "window must be a positive int"),
        ({"chunk": 4, "causal": False}, {}, "chunk=4 needs causal=True"),
        ({}, {"document_ids": torch.zeros(2, 5)}, "document_ids must be an integer tensor"),
        ({}, {"document_ids": torch.zeros(2, 4, dtype=torch.long)}, r"document_ids must have shape \[B, T\]"),
        ({}, {"document_ids": torch.tensor([[0, 1, 0, 1, 1]] * 2)}, "non-decreasing"),
        ({}, {"prefix_len": 6}, r"prefix_len must be in \[0, 5\]"),
        ({}, {"prefix_len": -1}, r"prefix_len must be in \[0, 5\]"),
        ({}, {"prefix_len": torch.tensor([1, 2, 3])}, r"prefix_len must have shape \[B\]"),
        ({"causal": False}, {"prefix_len": 2}, "prefix_len needs a causal layer"),
    ],
)
def test_bad_pattern_options_name_the_parameter(options, call, match):
    causal = options.pop("causal", True)
    with pytest.raises(ValueError, match=match):
        layer = posenc.MultiheadAttention(EMBED, HEADS, "rope", causal=causal, **options)
        layer(torch.randn(2, 5, EMBED), **call)


# ----------------------------------------------------------------------------
# Per-layer recipes and packed documents in the model.


def _rope_base(layer: LayerSpec) -> float | None:
    return (
        float(posenc.encodings.registry.resolve(layer.encoding).options.get("base", 10000.0))
        if "rope" in layer.encoding
        else None
    )


def _lm(pattern: str, num_layers: int) -> posenc.TransformerLM:
    """A tiny model with the recipe: d_model 64, 4 heads, so head_dim 16 as in :func:`_tiny`."""
    return posenc.TransformerLM(16, 64, num_layers, 4, pattern=pattern)


def _tiny(config_cls, num_layers: int, **extra):
    """An HF config with head_dim 16 (hidden 64, 4 heads) and ``num_layers`` layers; nothing else
    changed from its defaults, so layer types, windows and RoPE parameters are HF's."""
    return config_cls(
        num_hidden_layers=num_layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=32, vocab_size=16, **extra,
    )  # fmt: skip


def _inv_freq(block) -> torch.Tensor:
    return block.attn.encoding.tables.inv_freq.double()


def test_gemma3_layout_equals_hf():
    config = pytest.importorskip("transformers").Gemma3TextConfig(num_hidden_layers=12)
    layers = layer_pattern("gemma3", 12)
    for layer, kind in zip(layers, config.layer_types, strict=True):
        local = kind == "sliding_attention"
        assert (layer.window is not None) == local
        assert _rope_base(layer) == config.rope_parameters[kind]["rope_theta"]


def test_llama4_layout_equals_hf():
    config = pytest.importorskip("transformers").Llama4TextConfig(num_hidden_layers=8)
    layers = layer_pattern("llama4", 8)
    for layer, uses_rope, kind in zip(layers, config.no_rope_layers, config.layer_types, strict=True):
        assert (layer.encoding != "nope") == bool(uses_rope)
        assert (layer.chunk == config.attention_chunk_size) == (kind == "chunked_attention")
        assert (layer.temperature is not None) == (not uses_rope)  # HF tunes NoPE layers only
        if layer.temperature is not None:
            assert layer.temperature == QueryTemperature(config.floor_scale, config.attn_scale)


def test_smollm3_and_gpt_oss_layouts_equal_hf():
    transformers = pytest.importorskip("transformers")
    smol = transformers.SmolLM3Config(num_hidden_layers=8)
    for layer, uses_rope in zip(layer_pattern("smollm3", 8), smol.no_rope_layers, strict=True):
        assert (layer.encoding != "nope") == bool(uses_rope)
        if uses_rope:
            assert _rope_base(layer) == smol.rope_parameters["rope_theta"]
    oss = transformers.GptOssConfig(num_hidden_layers=6)
    for layer, kind in zip(layer_pattern("gpt-oss", 6), oss.layer_types, strict=True):
        assert layer.sinks
        assert layer.window == (oss.sliding_window if kind == "sliding_attention" else None)
        assert _rope_base(layer) == oss.rope_parameters["rope_theta"]


@pytest.mark.parametrize("num_layers", [8, 6])
def test_cohere2_layout_equals_hf(num_layers):
    """Command R7B / Command A: HF's attention layer applies RoPE only where it has a sliding window,
    so the full layers are NoPE; the rotary frequencies and the interleaved pairing equal HF's."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.cohere2 import modeling_cohere2 as hf

    config = _tiny(transformers.Cohere2Config, num_layers)
    model = _lm("cohere2", num_layers)
    rotary = hf.Cohere2RotaryEmbedding(config)
    for index, (block, kind) in enumerate(zip(model.blocks, config.layer_types, strict=True)):
        window = hf.Cohere2Attention(config, layer_idx=index).sliding_window
        assert block.attn.window == window, (index, kind)
        assert (block.attn.encoding.name == "nope") == (window is None) == (kind == "full_attention")
        if window is not None:
            torch.testing.assert_close(_inv_freq(block), rotary.inv_freq.double(), rtol=1e-7, atol=0)
    assert config.sliding_window == 4096 and config.layer_types[:4] == ["sliding_attention"] * 3 + [
        "full_attention"
    ]
    # Pairing: posenc's rotation of q and k equals HF's apply_rotary_pos_emb with Cohere's tables.
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 4, 9, 16, dtype=torch.float64).unbind(0)
    positions = torch.arange(9)
    cos, sin = rotary(q, positions[None])
    want = hf.apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    got = model.blocks[0].attn.encoding.rotate(q, k, positions, positions)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    half = posenc.TransformerLM(16, 64, 1, 4, pattern=[LayerSpec("rope")]).blocks[0].attn.encoding
    assert not torch.allclose(half.rotate(q, k, positions, positions)[0], want[0])  # pairing matters


@pytest.mark.parametrize("num_layers", [8, 12, 4])
def test_gemma4_layout_equals_hf(num_layers):
    """Gemma 4: 5 local : 1 global with the last layer forced global, the window, and each layer
    type's inverse frequencies (global: p-RoPE, ``proportional``) equal to HF's rotary embedding."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma4 import modeling_gemma4 as hf

    config = _tiny(transformers.Gemma4TextConfig, num_layers, head_dim=16, global_head_dim=16)
    assert config.layer_types[-1] == "full_attention"
    model = _lm("gemma4", num_layers)
    rotary = hf.Gemma4TextRotaryEmbedding(config)
    for index, (block, kind) in enumerate(zip(model.blocks, config.layer_types, strict=True)):
        assert block.attn.window == hf.Gemma4TextAttention(config, layer_idx=index).sliding_window, index
        assert block.attn.window == (config.sliding_window if kind == "sliding_attention" else None)
        want = getattr(rotary, f"{kind}_inv_freq").double()
        torch.testing.assert_close(_inv_freq(block), want, rtol=1e-7, atol=0)
        options = posenc.encodings.registry.resolve(block.attn.encoding.spec()).options
        assert float(options["base"]) == config.rope_parameters[kind]["rope_theta"]
    full = config.rope_parameters["full_attention"]
    assert full["rope_type"] == "proportional" and int((rotary.full_attention_inv_freq > 0).sum()) == int(
        full["partial_rotary_factor"] * 16 // 2
    )  # some pairs do not rotate, so the frequency check above can fail


def test_gemma4_wider_global_heads_equal_hf():
    """``global_head_dim`` and ``num_global_key_value_heads`` (with ``attention_k_eq_v``, which gates
    the second in HF): each layer's head size, KV heads, q/k/out projection shapes and, on the global
    layers, the p-RoPE frequencies of the wider head equal HF's attention layers."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma4 import modeling_gemma4 as hf

    config = _tiny(
        transformers.Gemma4TextConfig, 6, head_dim=16, global_head_dim=32, num_global_key_value_heads=2,
        attention_k_eq_v=True,
    )  # fmt: skip
    model = posenc.TransformerLM(16, 64, 6, 4, pattern="gemma4:global_head_dim=32,global_kv_heads=2")
    rotary = hf.Gemma4TextRotaryEmbedding(config)
    for index, (block, kind) in enumerate(zip(model.blocks, config.layer_types, strict=True)):
        ours, theirs = block.attn, hf.Gemma4TextAttention(config, layer_idx=index)
        assert ours.head_dim == theirs.head_dim == (32 if kind == "full_attention" else 16), index
        assert ours.num_kv_heads == theirs.k_proj.out_features // theirs.head_dim, index
        for mine, hfs in (
            (ours.q_proj, theirs.q_proj),
            (ours.k_proj, theirs.k_proj),
            (ours.out_proj, theirs.o_proj),
        ):
            assert mine.weight.shape == hfs.weight.shape, index
        want = getattr(rotary, f"{kind}_inv_freq").double()
        torch.testing.assert_close(_inv_freq(block), want, rtol=1e-7, atol=0)
    assert [b.attn.head_dim for b in _lm("gemma4", 6).blocks] == [16] * 6  # off by default


@pytest.mark.parametrize("shared", [0, 2])
def test_gemma4_k_eq_v_layers_equal_hf(shared):
    """``k_eq_v`` (HF ``attention_k_eq_v``): K = V on exactly the layers where HF's attention uses it
    (``use_alternative_attention``: the full layers, KV-shared ones included) and, on the unshared
    ones, no ``v_proj`` where HF has none. Off by default, as HF's config."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma4 import modeling_gemma4 as hf

    assert transformers.Gemma4TextConfig().attention_k_eq_v is False
    assert not any(layer.value_from_key for layer in layer_pattern("gemma4", 8))
    config = _tiny(
        transformers.Gemma4TextConfig, 8, head_dim=16, global_head_dim=16, attention_k_eq_v=True,
        num_kv_shared_layers=shared,
    )  # fmt: skip
    model = _lm(f"gemma4:k_eq_v=true,kv_shared_layers={shared}" if shared else "gemma4:k_eq_v=true", 8)
    flags = []
    for index, block in enumerate(model.blocks):
        theirs = hf.Gemma4TextAttention(config, layer_idx=index)
        assert (
            block.attn.pattern.value_from_key == block.attn.value_from_key == theirs.use_alternative_attention
        )
        assert block.attn.pattern.kv_shared == theirs.is_kv_shared_layer, index
        if not theirs.is_kv_shared_layer:
            assert (block.attn.v_proj is None) == (theirs.v_proj is None), index
        flags.append(theirs.use_alternative_attention)
    assert flags == [False] * 5 + [True, False, True]  # the check can fail: both kinds present


def test_gemma4_k_eq_v_model_equals_a_twin_with_the_key_weights_as_values():
    """The recipe's K = V model equals (1) the same layers written out by hand with
    ``value_from_key=True`` and (2) the recipe without K = V whose global layers' ``v_proj`` holds
    their ``k_proj`` weights (values from a separate projection: an independent reference)."""
    torch.manual_seed(0)
    recipe = "gemma4:window=3,global_every=3,global_head_dim=32,global_kv_heads=2"
    model = posenc.TransformerLM(16, 64, 6, 4, pattern=recipe + ",k_eq_v=true").double().eval()
    local, wide = "rope:base=10000.0", "rope:base=1000000.0,scaling=proportional,partial_rotary_factor=0.25"
    by_hand = [
        LayerSpec(wide, head_dim=32, num_kv_heads=2, value_from_key=True)
        if i in (2, 5)
        else LayerSpec(local, window=3)
        for i in range(6)
    ]
    assert model.layers == by_hand
    built = posenc.TransformerLM(16, 64, 6, 4, pattern=by_hand).double().eval()
    built.load_state_dict(model.state_dict())  # strict: the same parameters, no v_proj on layers 2, 5
    twin = posenc.TransformerLM(16, 64, 6, 4, pattern=recipe).double().eval()
    state = model.state_dict()
    for i in (2, 5):
        for name in ("weight", "bias"):
            state[f"blocks.{i}.attn.v_proj.{name}"] = state[f"blocks.{i}.attn.k_proj.{name}"]
    twin.load_state_dict(state)
    tokens = torch.randint(0, 16, (2, 11))
    with torch.no_grad():
        want = model(tokens)
        torch.testing.assert_close(built(tokens), want, rtol=0, atol=0)
        torch.testing.assert_close(twin(tokens), want, rtol=1e-12, atol=1e-12)
        twin.blocks[5].attn.v_proj.bias.add_(0.1)  # the check can fail: the global values matter
        assert not torch.allclose(twin(tokens), want)


@pytest.mark.parametrize("full_base", [10_000.0, 0.0])
def test_granite_swa_layout_equals_hf(full_base):
    """Granite SWA: full attention at ``i % 4 == 0``, a 128 window elsewhere, a sink logit per head in
    every layer, and HF's ``layer_rope_theta`` (0 is NoPE) as the recipe's bases."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.granite_swa import modeling_granite_swa as hf

    layer_types = transformers.GraniteSWAConfig(num_hidden_layers=8).layer_types
    thetas = [full_base if kind == "full_attention" else 10_000.0 for kind in layer_types]
    config = _tiny(transformers.GraniteSWAConfig, 8, layer_rope_theta=thetas)
    model = _lm(f"granite-swa:full_base={full_base}", 8)
    for index, (block, kind, theta) in enumerate(
        zip(model.blocks, config.layer_types, config.layer_rope_theta, strict=True)
    ):
        attention = hf.GraniteSWAAttention(config, layer_idx=index)
        assert block.attn.window == attention.sliding_window, (index, kind)
        assert block.attn.sinks is not None and attention.sinks.shape == (4,)
        assert (block.attn.encoding.name == "nope") == (theta == 0)
        if theta:
            assert _rope_base(LayerSpec(block.attn.encoding.spec())) == theta, index
    assert config.layer_types[0] == "full_attention" and model.blocks[0].attn.window is None


def test_olmo3_layout_equals_hf():
    transformers = pytest.importorskip("transformers")
    from transformers.models.olmo3 import modeling_olmo3 as hf

    config = _tiny(transformers.Olmo3Config, 8)
    model = _lm("olmo3", 8)
    rotary = hf.Olmo3RotaryEmbedding(config)
    for index, (block, kind) in enumerate(zip(model.blocks, config.layer_types, strict=True)):
        assert block.attn.window == hf.Olmo3Attention(config, layer_idx=index).sliding_window, index
        assert block.attn.window == (config.sliding_window if kind == "sliding_attention" else None)
        want = getattr(rotary, f"{kind}_inv_freq").double()
        torch.testing.assert_close(_inv_freq(block), want, rtol=1e-7, atol=0)
    assert config.rope_parameters["full_attention"]["rope_theta"] == 500_000.0


def test_swan_layout_follows_the_paper():
    """SWAN-GPT (Puvvada et al. 2025), written out: blocks of one global NoPE layer and three
    sliding-window (512) RoPE layers; there is no HF configuration."""
    layers = layer_pattern("swan", 8)
    nope = LayerSpec("nope")
    swa = LayerSpec("rope:base=10000.0", window=512)
    assert layers == [nope, swa, swa, swa, nope, swa, swa, swa]
    assert layer_pattern("swan:window=8,nope_every=2", 4) == [
        nope, LayerSpec("rope:base=10000.0", window=8), nope, LayerSpec("rope:base=10000.0", window=8)
    ]  # fmt: skip


def test_swan_log_scaling_follows_the_formula():
    """SWAN-GPT's dynamic scaling of its NoPE layers, ``s_p = log_a(p + a)`` (as arXiv 2601.22156,
    Eq. 11, restates it), written out in float64: the recipe's NoPE layers scale their queries so, the
    SWA-RoPE layers not at all; 1 at the first token, log_a(2a) at position a."""
    import math

    a = 6.0
    layers = layer_pattern(f"swan:window=8,log_base={a}", 8)
    assert [layer.temperature is not None for layer in layers] == [True, False, False, False] * 2
    positions = torch.tensor([[0, 1, 5, 6, 100, 4095]])
    want = torch.tensor([math.log(p + a) / math.log(a) for p in positions[0].tolist()], dtype=torch.float64)
    got = layers[0].temperature.factors(positions)[0, 0, :, 0].double()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert got[0] == 1.0 and abs(float(got[3]) - math.log(12) / math.log(6)) < 1e-6
    # a model built with it: the NoPE layer's queries scaled, the unscaled recipe differs
    torch.manual_seed(0)
    scaled = posenc.TransformerLM(16, 32, 4, 4, pattern=f"swan:window=3,log_base={a}").double()
    plain = posenc.TransformerLM(16, 32, 4, 4, pattern="swan:window=3").double()
    plain.load_state_dict(scaled.state_dict())
    tokens = torch.randint(0, 16, (1, 12))
    assert not torch.allclose(scaled(tokens), plain(tokens))
    assert torch.allclose(scaled(tokens[:, :1]), plain(tokens[:, :1]))  # factor 1 at position 0
    with pytest.raises(ValueError, match="log_base must be a number > 1"):
        layer_pattern("swan:log_base=0.5", 4)


def test_query_temperature_equals_hf_llama4_nope_layer():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    config = transformers.Llama4TextConfig(
        num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=16, intermediate_size_mlp=16, use_qk_norm=False, floor_scale=4, attn_scale=0.5,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Llama4TextAttention(config, layer_idx=3).double().eval()  # layer 3: a NoPE layer
    assert not hf.use_rope and hf.attn_temperature_tuning
    ours = posenc.MultiheadAttention(
        32, 4, "nope", causal=True, num_kv_heads=2, bias=False, query_temperature=QueryTemperature(4, 0.5)
    ).double()
    with torch.no_grad():
        for mine, theirs in ((ours.q_proj, hf.q_proj), (ours.k_proj, hf.k_proj), (ours.v_proj, hf.v_proj)):
            mine.weight.copy_(theirs.weight)
        ours.out_proj.weight.copy_(hf.o_proj.weight)
    length = 23
    x = torch.randn(1, length, 32, dtype=torch.float64)
    mask = torch.full((length, length), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[
        None, None
    ]
    unused = torch.ones(1, length, 4, dtype=torch.complex128)  # rotary tables: a NoPE layer ignores them
    want, _ = hf(x, position_embeddings=unused, attention_mask=mask)
    torch.testing.assert_close(ours(x), want, rtol=1e-10, atol=1e-12)
    plain = posenc.MultiheadAttention(32, 4, "nope", causal=True, num_kv_heads=2, bias=False).double()
    plain.load_state_dict(ours.state_dict())
    assert not torch.allclose(plain(x), want)  # the temperature matters at these positions


@pytest.mark.parametrize(
    "preset",
    [
        "gemma3:window=4,global_every=3",
        "llama4:chunk=5,floor_scale=4",
        "smollm3",
        "gpt-oss:window=3",
        "cohere2:window=4",
        "gemma4:window=4,global_every=3",
        "gemma4:window=4,global_every=3,k_eq_v=true",
        "gemma4:window=4,global_every=2,k_eq_v=true,kv_shared_layers=2",
        "granite-swa:window=3,full_base=0",
        "olmo3:window=5",
        "swan:window=4",
        "mistral-large4",
    ],
)
def test_preset_models_decode_with_the_cache_as_the_full_pass(preset):
    torch.manual_seed(0)
    model = posenc.TransformerLM(50, 32, 6, 4, pattern=preset).double().eval()
    tokens = torch.randint(0, 50, (2, 17))
    full = model(tokens)
    cache, pieces = posenc.KVCache(), []
    for a, b in ((0, 7), (7, 8), (8, 17)):
        pieces.append(model(tokens[:, a:b], cache=cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(
    "model_cls", [posenc.TransformerLM, posenc.TransformerEncoder], ids=["lm", "encoder"]
)
@pytest.mark.parametrize("encoding", ["rope", "alibi", "learned", "t5"])
def test_packed_documents_in_the_model_equal_separate_runs(model_cls, encoding):
    torch.manual_seed(0)
    if model_cls is posenc.TransformerEncoder and encoding == "alibi":
        encoding = "alibi:mode=symmetric"
    model = model_cls(40, 32, 2, 4, encoding, max_len=32).double().eval()
    lengths = [6, 3, 8]
    ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    tokens = torch.randint(0, 40, (1, sum(lengths)))
    packed = model(tokens, document_ids=ids)
    pieces, start = [], 0
    for n in lengths:
        pieces.append(model(tokens[:, start : start + n]))
        start += n
    torch.testing.assert_close(packed, torch.cat(pieces, dim=1), rtol=1e-9, atol=1e-10)


def test_bad_patterns_are_named():
    with pytest.raises(ValueError, match="unknown layer preset 'gemma9'"):
        posenc.TransformerLM(10, 16, 2, 2, pattern="gemma9")
    with pytest.raises(ValueError, match="unknown option 'windw'"):
        posenc.TransformerLM(10, 16, 2, 2, pattern="gemma3:windw=4")
    with pytest.raises(ValueError, match="option 'window' must be int"):
        posenc.TransformerLM(10, 16, 2, 2, pattern="gemma3:window=big")
    with pytest.raises(ValueError, match="layer preset 'swan': option 'window' must be positive"):
        posenc.TransformerLM(10, 16, 2, 2, pattern="swan:window=0")
    with pytest.raises(ValueError, match="layer preset 'granite-swa': option 'full_base' must be float"):
        posenc.TransformerLM(10, 16, 2, 2, pattern="granite-swa:full_base=none")
    with pytest.raises(ValueError, match="layer preset 'gemma4': option 'k_eq_v' must be true or false"):
        posenc.TransformerLM(10, 16, 2, 2, pattern="gemma4:k_eq_v=maybe")
    with pytest.raises(ValueError, match="k_eq_v must be True or False"):
        layer_pattern.__globals__["LAYER_PRESETS"]["gemma4"](2, k_eq_v="false")
    with pytest.raises(ValueError, match="value_from_key must be True or False"):
        posenc.TransformerLM(10, 16, 2, 2, pattern=[LayerSpec("rope", value_from_key=1)] * 2)
    with pytest.raises(ValueError, match="either encoding or pattern"):
        posenc.TransformerLM(10, 16, 2, 2, "rope", pattern="gemma3")
    with pytest.raises(ValueError, match=r"one posenc\.layers\.patterns\.LayerSpec per layer"):
        posenc.TransformerLM(10, 16, 2, 2, pattern=[LayerSpec("rope")])
    with pytest.raises(ValueError, match="floor_scale must be finite"):
        QueryTemperature(float("nan"), 0.1)


def test_query_temperature_equals_hf_llama_4_scaling_beta():
    """Ministral 3 / Mistral 4 scale queries by ``1 + beta * log(1 + floor(pos / original_max))``."""
    ministral = pytest.importorskip("transformers.models.ministral3.modeling_ministral3")
    from posenc.layers.positions import temperature_factors

    positions = torch.arange(0, 5000, 7)[None]
    want = ministral.get_llama_4_attn_scale(positions, 0.1, 1024)
    got = temperature_factors(
        QueryTemperature(floor_scale=1024, attn_scale=0.1, position_offset=0), positions
    )
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
    assert float(want.max()) > 1.1  # the scale grows at these positions, so the check can fail


def test_a_layer_takes_its_pattern_whole():
    """``pattern=LayerSpec(...)`` gives the layer the spec's window, chunk, sinks and temperature, as
    the four arguments do; giving both is refused."""
    spec = LayerSpec("rope", window=3, chunk=None, sinks=True, temperature=QueryTemperature(floor_scale=4.0))
    torch.manual_seed(0)
    whole = posenc.MultiheadAttention(16, 2, "rope", causal=True, pattern=spec)
    torch.manual_seed(0)
    apart = posenc.MultiheadAttention(
        16, 2, "rope", causal=True, window=3, sinks=True, query_temperature=spec.temperature
    )
    assert (whole.window, whole.chunk, whole.query_temperature) == (3, None, spec.temperature)
    assert whole.sinks is not None
    x = torch.randn(1, 7, 16)
    torch.testing.assert_close(whole(x), apart(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="either pattern or window"):
        posenc.MultiheadAttention(16, 2, "rope", causal=True, pattern=spec, window=4)
