"""posenc as an HF transformers attention implementation: equal to the model's own sdpa / eager.

Tiny random configs (nothing downloaded). The reference is the same model run with HF's ``sdpa``
implementation in float64 (HF's eager gives nan on left-padded rows in float64), or ``eager`` in
float32 for gpt-oss (no sdpa, and its experts take no float64): logits at the real tokens,
gradients of every parameter, and greedy ``generate()``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf  # the posenc.hf seam: CI runs these at both ends of the transformers range

transformers = pytest.importorskip("transformers")
import posenc.hf as posenc_hf  # noqa: E402

VOCAB, LEN = 50, 19


def _llama(**kw):
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, **kw,
        )
    )  # fmt: skip


def _mistral():  # a sliding window shorter than the sequence
    return transformers.MistralForCausalLM(
        transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=128, sliding_window=6,
        )
    )  # fmt: skip


def _qwen2():
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128,
        )
    )  # fmt: skip


def _gpt_oss():  # attention sinks (s_aux) and alternating sliding / full layers
    return transformers.GptOssForCausalLM(
        transformers.GptOssConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
            max_position_embeddings=128, layer_types=["sliding_attention", "full_attention"],
        )
    )  # fmt: skip


def _gemma3():  # local (sliding) and global layers
    return transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
        )
    )  # fmt: skip


MODELS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "gpt_oss": _gpt_oss, "gemma3": _gemma3}
#: name: (HF implementation to compare with, dtype, tolerance)
EXACT = {"rtol": 1e-9, "atol": 1e-9}
REFERENCE = {name: ("sdpa", torch.float64, EXACT) for name in MODELS}
REFERENCE["gpt_oss"] = ("eager", torch.float32, {"rtol": 1e-4, "atol": 1e-5})


@pytest.fixture(scope="module", autouse=True)
def _registered():
    posenc_hf.register()
    yield
    posenc_hf.register()  # back to the "auto" backend


def _model(name: str, dtype=None):
    dtype = dtype or REFERENCE[name][1]
    torch.manual_seed(0)
    model = MODELS[name]().to(dtype)
    with torch.no_grad():  # gpt-oss initialises its sinks to zero: give them values that matter
        for param_name, param in model.named_parameters():
            if param_name.endswith("sinks"):
                param.normal_(0.0, 1.0)
    return model.eval()


def _inputs():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, LEN), generator=generator)
    mask = torch.ones(2, LEN, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    return ids, mask


def _run(model, impl: str, ids, mask, grads: bool = False):
    model.set_attn_implementation(impl)
    model.zero_grad()
    logits = model(ids, attention_mask=mask).logits
    real = mask.bool()
    if not grads:
        return logits.detach()[real], []
    (logits[real] * torch.linspace(-1, 1, logits[real].numel()).view_as(logits[real])).sum().backward()
    return logits.detach()[real], [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_gradients_equal_hf(name):
    impl, _, tolerance = REFERENCE[name]
    model = _model(name)
    ids, mask = _inputs()
    want, want_grads = _run(model, impl, ids, mask, grads=True)
    got, got_grads = _run(model, posenc_hf.ATTN_IMPLEMENTATION, ids, mask, grads=True)
    assert posenc_hf.last_backend() is not None
    torch.testing.assert_close(got, want, **tolerance)
    assert len(got_grads) == len(want_grads)
    grad_tolerance = {k: v * 10 for k, v in tolerance.items()}
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **grad_tolerance)


def test_logits_equal_hf_eager_in_float32():
    model = _model("llama", torch.float32)
    ids, mask = _inputs()
    torch.testing.assert_close(
        _run(model, posenc_hf.ATTN_IMPLEMENTATION, ids, mask)[0], _run(model, "eager", ids, mask)[0],
        rtol=1e-4, atol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["eager", "blocked", "sdpa"])
def test_every_forced_posenc_backend_gives_the_same_logits(backend):
    impl, _, tolerance = REFERENCE["gpt_oss"]
    model = _model("gpt_oss")
    ids, mask = _inputs()
    want = _run(model, impl, ids, mask)[0]
    posenc_hf.register(backend=backend)
    try:
        got = _run(model, posenc_hf.ATTN_IMPLEMENTATION, ids, mask)[0]
        assert posenc_hf.last_backend() == backend
    finally:
        posenc_hf.register()
    torch.testing.assert_close(got, want, **tolerance)


def test_generate_with_hf_static_cache_equals_sdpa():
    """HF's StaticCache hands attention every preallocated slot, the empty ones masked: the same tokens."""
    model = _model("llama")
    ids, mask = _inputs()
    options = {
        "attention_mask": mask,
        "max_new_tokens": 6,
        "do_sample": False,
        "cache_implementation": "static",
    }
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, **options)
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    assert torch.equal(model.generate(ids, **options), want)


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt_oss"])
def test_generate_equals_hf(name):
    model = _model(name)
    ids, mask = _inputs()
    model.set_attn_implementation(REFERENCE[name][0])
    want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


def test_unknown_backend_and_a_bad_softcap_are_refused():
    with pytest.raises(ValueError, match="unknown backend"):
        posenc_hf.register(backend="fastest")
    q = torch.zeros(1, 2, 3, 4)
    for bad in (0.0, -30.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="attn_logit_softcapping"):
            posenc_hf.attention_forward(torch.nn.Module(), q, q, q, None, softcap=bad)


# ---------------------------------------------------------------------------- Gemma 2: logit soft-capping
def _gemma2(softcap: float | None = 1.0, dtype=torch.float32):
    """Gemma 2 with local and global layers and a small cap on logits made large (q/k projections
    ten times HF's initial scale): with HF's initial weights the logits are near 0, where the cap
    changes nothing. HF serves Gemma 2 with eager attention only."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=5,
        query_pre_attn_scalar=16, attn_logit_softcapping=softcap, final_logit_softcapping=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(10.0)
    return model.to(dtype).eval()


#: HF's eager attention takes its softmax in float32 (then casts back), in float64 too.
GEMMA2 = {"rtol": 1e-4, "atol": 1e-5}
GEMMA2_GRADS = {"rtol": 1e-3, "atol": 1e-4}


@pytest.mark.parametrize("padded", [False, True])
def test_gemma2_soft_capping_equals_hf_eager(padded):
    """Logits and every gradient equal HF's eager attention, which caps ``q·k·scaling`` before the mask.
    float64 without padding (HF's eager gives nan on left-padded rows in float64), float32 with it;
    HF's eager takes its softmax in float32 whatever the dtype, hence float32's tolerance."""
    dtype = torch.float32 if padded else torch.float64
    model = _gemma2(dtype=dtype)
    ids, mask = _inputs()
    if not padded:
        mask = torch.ones_like(mask)
    want, want_grads = _run(model, "eager", ids, mask, grads=True)
    got, got_grads = _run(model, posenc_hf.ATTN_IMPLEMENTATION, ids, mask, grads=True)
    assert posenc_hf.last_backend() == "blocked"  # sdpa cannot cap; blocked forms explicit logits
    torch.testing.assert_close(got, want, **GEMMA2)
    assert len(got_grads) == len(want_grads) > 0
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **GEMMA2_GRADS)
    # the cap matters here: the uncapped model's logits are far from these
    uncapped = _gemma2(softcap=None, dtype=dtype)
    assert (_run(uncapped, "eager", ids, mask)[0] - want).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["eager", "blocked"])
def test_gemma2_forced_backends_cap_and_sdpa_refuses(backend):
    model = _gemma2(dtype=torch.float64)
    ids, mask = _inputs()
    mask = torch.ones_like(mask)
    want = _run(model, "eager", ids, mask)[0]
    posenc_hf.register(backend=backend)
    try:
        got = _run(model, posenc_hf.ATTN_IMPLEMENTATION, ids, mask)[0]
        assert posenc_hf.last_backend() == backend
    finally:
        posenc_hf.register()
    torch.testing.assert_close(got, want, **GEMMA2)
    posenc_hf.register(backend="sdpa")
    try:
        with pytest.raises(ValueError, match=r"soft-capping \(softcap\) needs each logit"):
            _run(model, posenc_hf.ATTN_IMPLEMENTATION, ids, mask)
    finally:
        posenc_hf.register()


def test_gemma2_generates_hf_eager_s_greedy_tokens():
    model = _gemma2()
    ids, mask = _inputs()
    model.set_attn_implementation("eager")
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------- swap_encoding, set_rope_scaling
def _logits(model, ids, mask):
    return model(ids, attention_mask=mask).logits.detach()[mask.bool()]


def _scaled_twin(name: str, rope_parameters: dict):
    """The same weights in a model built with ``rope_parameters`` in its config (HF's own scaling)."""
    model = _model(name)
    config = model.config
    config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], **rope_parameters}
    twin = type(model)(config).to(torch.float64).eval()
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_swapping_in_posenc_rope_equals_the_model_s_own_rope(name):
    """posenc's RoPE at HF's positions, keys cached unrotated: logits, gradients and generate() equal."""
    model, swapped = _model(name), _model(name)
    posenc_hf.swap_encoding(swapped, f"rope:base={model.config.rope_parameters['rope_theta']}")
    ids, mask = _inputs()
    model.set_attn_implementation("sdpa")
    want, want_grads = _run(model, "sdpa", ids, mask, grads=True)
    got, got_grads = _run(swapped, posenc_hf.ATTN_IMPLEMENTATION, ids, mask, grads=True)
    torch.testing.assert_close(got, want, **EXACT)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-8)
    generated = swapped.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize(
    "rope_parameters,spec",
    [
        ({"rope_type": "linear", "factor": 2.0}, "scaling=linear,factor=2.0"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
            "scaling=yarn,factor=4.0,original_max_position_embeddings=32",
        ),
    ],
)
def test_set_rope_scaling_equals_loading_with_it_and_a_swapped_scaled_rope_too(rope_parameters, spec):
    twin = _scaled_twin("llama", rope_parameters)
    model = _model("llama")
    ids, mask = _inputs()
    unscaled = _logits(model, ids, mask)
    posenc_hf.set_rope_scaling(model, dict(rope_parameters))
    want = _logits(twin, ids, mask)
    assert not torch.allclose(unscaled, want)  # the scaling changes the logits
    torch.testing.assert_close(_logits(model, ids, mask), want, **EXACT)
    swapped = _model("llama")
    posenc_hf.swap_encoding(swapped, f"rope:base={swapped.config.rope_parameters['rope_theta']},{spec}")
    torch.testing.assert_close(_logits(swapped, ids, mask), want, **EXACT)


@pytest.mark.parametrize(
    "spec", ["alibi", "nope", ["alibi", "rope:base=500.0"], "t5:num_buckets=8,max_distance=16"]
)
def test_a_swapped_model_decodes_as_it_runs_and_ignores_padding(spec):
    """No HF reference exists for Llama with ALiBi: check what must hold for any correct positions.
    Greedy decoding (keys cached unrotated, positions remembered) gives the logits of the full pass,
    and a left-padded row's real tokens equal the row run alone."""
    model = _model("llama")
    posenc_hf.swap_encoding(model, spec)
    ids, mask = _inputs()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    full_mask = torch.cat([mask, torch.ones(2, 5, dtype=torch.long)], dim=1)
    full = model(out.sequences, attention_mask=full_mask).logits
    steps = torch.stack(out.logits, dim=1)  # [B, 5, V]: the logits that chose tokens LEN..LEN+4 (float32)
    torch.testing.assert_close(steps, full[:, LEN - 1 : LEN + 4].to(steps.dtype), rtol=1e-5, atol=1e-6)
    alone = model(ids[1:, 4:]).logits  # positions 0.. instead of 4.. (HF counts pads without position_ids)
    # RoPE's tables are float32 whatever the model dtype: shifted positions agree to float32 rounding.
    torch.testing.assert_close(model(ids, attention_mask=mask).logits[1:, 4:], alone, rtol=1e-6, atol=1e-7)


def test_swap_and_scaling_refuse_what_they_cannot_do():
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not a Llama-family decoder"):
        posenc_hf.swap_encoding(gpt2, "alibi")
    model = _model("llama")
    with pytest.raises(ValueError, match="adds positions to the input embeddings"):
        posenc_hf.swap_encoding(model, "sinusoidal")
    with pytest.raises(ValueError, match="3 specs for a model of 2 layers"):
        posenc_hf.swap_encoding(model, ["alibi"] * 3)
    with pytest.raises(ValueError, match="rope_type"):
        posenc_hf.set_rope_scaling(model, {"factor": 2.0})
    posenc_hf.swap_encoding(model, "alibi")
    with pytest.raises(ValueError, match="encoding was swapped"):
        posenc_hf.set_rope_scaling(model, {"rope_type": "linear", "factor": 2.0})


def test_t5_relative_bias_reaches_posenc_and_equals_hf():
    """T5 hands its (trainable) relative bias over as position_bias: logits, the bias table's and every
    other gradient, and generate() equal HF's sdpa (encoder padding, causal decoder, cross-attention)."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).double().eval()
    ids = torch.randint(1, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 9:] = 0
    decoder_ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    results = {}
    for impl in ("sdpa", posenc_hf.ATTN_IMPLEMENTATION):
        model.set_attn_implementation(impl)
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        results[impl] = (logits.detach(), grads, generated)
    (want, want_grads, want_gen), (got, got_grads, got_gen) = results.values()
    torch.testing.assert_close(got, want, **EXACT)
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-9)
    assert torch.equal(got_gen, want_gen)


def test_bloom_runs_on_posenc_alibi_and_equals_hf():
    """BLOOM has no AttentionInterface hook: use_posenc_attention swaps its attention forward. HF's
    BLOOM in float64 gives nan on left-padded rows, so the comparison is float32: logits at the real
    tokens, gradients, and generate()."""
    import copy

    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    model = transformers.BloomForCausalLM(config).eval()
    patched = posenc_hf.use_posenc_attention(copy.deepcopy(model))
    ids, mask = _inputs()
    (want, want_grads), (got, got_grads) = (_run(m, "eager", ids, mask, grads=True) for m in (model, patched))
    assert posenc_hf.last_backend() is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    generated = patched.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    with pytest.raises(ValueError, match="LlamaForCausalLM has no attention posenc patches"):
        posenc_hf.use_posenc_attention(_model("llama"))


def _hf_decode_counts(model, prompt_len: int, monkeypatch) -> tuple[list[int], object]:
    """Elements the nan check reduces in the last layer's call of one decode step after a prompt."""
    from posenc.backends import finite as finite_module
    from posenc.backends import request as request_module

    torch.manual_seed(0)
    ids = torch.randint(1, VOCAB, (1, prompt_len + 1))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :prompt_len], past_key_values=cache, use_cache=True)
        counted: list[int] = []
        real = request_module.all_finite_together
        real_block = finite_module.block_finite
        monkeypatch.setattr(  # the request's check
            request_module,
            "all_finite_together",
            lambda ts: counted.extend(t.numel() for t in ts) or real(ts),
        )
        monkeypatch.setattr(  # the plain decode step's
            finite_module, "block_finite", lambda block: counted.append(block.numel()) or real_block(block)
        )
        model(ids[:, prompt_len:], past_key_values=cache, use_cache=True)
        monkeypatch.setattr(request_module, "all_finite_together", real)
        monkeypatch.setattr(finite_module, "block_finite", real_block)
    return counted, cache


def test_hf_decode_step_checks_only_the_new_tokens(monkeypatch):
    """Through the HF bridge a decode step's nan check reads q and the new key and value, whatever
    the cache holds: the same count after 4 or 40 cached tokens (O(new tokens), not O(cache))."""
    model = _model("llama")
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    short, _ = _hf_decode_counts(model, 4, monkeypatch)
    long, _ = _hf_decode_counts(model, 40, monkeypatch)
    assert short and sum(short) == sum(long)
    # per layer: q [1, 4, 1, 16] and the new k, v [1, 2, 1, 16]
    assert sum(short) == 2 * (4 * 16 + 2 * 2 * 16)


def test_hf_cache_with_a_nan_is_checked_in_full_until_it_is_gone(monkeypatch):
    """A nan written into an HF cache by one step keeps every later step on a backend that
    propagates it, in every layer (the first included, whose new token is finite); a cache that
    belongs to another sequence is not linked to it."""
    import posenc.hf._attention as bridge

    served: list[str] = []
    real_note = bridge.note_backend
    monkeypatch.setattr(bridge, "note_backend", lambda name: served.append(name) or real_note(name))
    model = _model("llama")
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (1, 8))
    embed = model.get_input_embeddings()
    bad = embed(ids[:, 5:6]).detach().clone()
    bad[..., 0] = float("nan")
    cache = transformers.DynamicCache(config=model.config)
    other = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :5], past_key_values=cache, use_cache=True)
        model(ids[:, :5], past_key_values=other, use_cache=True)
        out = model(inputs_embeds=bad, past_key_values=cache, use_cache=True).logits
        assert not torch.isfinite(out).any() and posenc_hf.last_backend() == "eager"
        # another sequence of the same length through the same modules, all finite
        model(ids[:, 5:6], past_key_values=other, use_cache=True)
        assert posenc_hf.last_backend() == "sdpa"
        # back to the cache holding the nan: its keys are not linked to the other's, so all are checked
        served.clear()
        out = model(ids[:, 6:7], past_key_values=cache, use_cache=True).logits
        assert not torch.isfinite(out).any() and served == ["eager", "eager"]


# ---------------------------------------------------------------------------- swapped models under HF's crop
#: Swapped encodings that read the keys' positions, one of each kind: rotary, bias (ALiBi, T5's
#: buckets) and content (Shaw's relative keys).
CROP_SPECS = ["rope:base=10000.0", "alibi", "t5:num_buckets=8,max_distance=16", "shaw"]
#: float64 run through calls of other shapes (another summation order): rounding is ~1e-15 relative;
#: one key at a wrong position moved these logits by 1e-3 to 1e-1 (the positions kept before a crop).
CROP_EXACT = {"rtol": 1e-10, "atol": 1e-10}
#: ``generate``'s logits are float32 copies of the float64 ones: equal float64 logits round to
#: float32 values one ulp apart at most.
FLOAT32_ROUNDING = {"rtol": 1e-6, "atol": 1e-7}


def _swapped(name: str, spec: str, seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[name]().to(torch.float64).eval()
    return posenc_hf.swap_encoding(model, spec)


@pytest.mark.parametrize("spec", CROP_SPECS)
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_a_swapped_model_s_cropped_cache_continues_as_the_full_pass(name, spec):
    """HF's assisted and speculative generation crop the cache after a rejected draft. After a crop,
    the keys a swapped layer is handed are the cache's own, at their own positions (read off the
    cache's length): multi-token continuations equal the full pass, in full layers and in a sliding
    window (mistral's 6 < the 9 tokens prefilled), for a left-padded batch."""
    model = _swapped(name, spec)
    ids, mask = _inputs()
    cache = transformers.DynamicCache(config=model.config)
    cache.activate_past_recording()  # what HF's generate does before it crops (a sliding layer needs it)
    got = {}
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        model(ids[:, :9], attention_mask=mask[:, :9], past_key_values=cache, use_cache=True)
        # (tokens to crop, then the next tokens to run): a rejected draft of 3 and a continuation of
        # 6, one of 2 and a continuation of 3, none (HF's crop(0) between steps) and the rest
        for crop, stop in ((-3, 12), (-2, 13), (0, LEN)):
            cache.crop(crop)
            start = cache.get_seq_length()
            out = model(
                ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache, use_cache=True
            )
            got[start, stop] = out.logits
    assert list(got) == [(6, 12), (10, 13), (13, LEN)]
    for (start, stop), logits in got.items():
        torch.testing.assert_close(logits, full[:, start:stop], **CROP_EXACT)


def _prompt_with_repeats():
    """A prompt whose n-grams repeat, so prompt lookup proposes drafts (which the model rejects)."""
    return torch.tensor([[3, 14, 15, 9, 26, 5, 35] * 3])


@pytest.mark.parametrize("assistant", ["draft_model", "prompt_lookup"])
@pytest.mark.parametrize("spec", CROP_SPECS[:3])
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_assisted_generation_of_a_swapped_model_equals_its_greedy_generation(
    name, spec, assistant, monkeypatch
):
    """``generate(assistant_model=...)`` and prompt lookup verify a draft in one call and crop what
    was rejected: the tokens and every step's logits equal the same swapped model's plain greedy
    generation and its full pass (a swapped draft model crops its own cache too)."""
    from transformers.cache_utils import Cache

    crops: list[int] = []
    real_crop = Cache.crop
    monkeypatch.setattr(Cache, "crop", lambda cache, n: crops.append(int(n)) or real_crop(cache, n))
    model = _swapped(name, spec)
    if assistant == "draft_model":
        ids, extra = _inputs()[0][:1], {"assistant_model": _swapped(name, spec, seed=1)}
    else:
        ids, extra = _prompt_with_repeats(), {"prompt_lookup_num_tokens": 3}
    options = {
        "max_new_tokens": 10,
        "do_sample": False,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    with torch.no_grad():
        assisted = model.generate(ids, **extra, **options)
        assert any(n < 0 for n in crops)  # a draft was rejected and cropped
        greedy = model.generate(ids, **options)
        full = model(assisted.sequences).logits[:, ids.shape[1] - 1 : -1]
    assert torch.equal(assisted.sequences, greedy.sequences)
    steps = torch.stack(assisted.logits, 1)  # [1, 10, V]
    torch.testing.assert_close(steps, torch.stack(greedy.logits, 1), **FLOAT32_ROUNDING)
    torch.testing.assert_close(steps, full.to(steps.dtype), **FLOAT32_ROUNDING)


def test_a_swapped_model_refuses_a_cache_whose_keys_it_cannot_place():
    """Nothing silent: a static cache hands over empty slots, a cache written by the unswapped model
    holds keys at positions nobody kept, an object without ``get_seq_length`` tells no length."""
    from posenc.hf._positions import swapped_positions

    model = _swapped("llama", "alibi")
    ids = _inputs()[0][:1]
    with pytest.raises(ValueError, match=r"StaticCache \(layer 0: StaticLayer\), counts only 19 tokens"):
        model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
    plain = _model("llama")
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        plain(ids[:, :5], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="layer 0 kept the positions of none"):
            model(ids[:, 5:], past_key_values=cache, use_cache=True)

    class NoLength:
        pass

    attention = model.model.layers[0].self_attn
    attention.__dict__["_posenc_call_cache"] = NoLength()
    with pytest.raises(ValueError, match=r"NoLength, does not tell its length \(get_seq_length\(0\)"):
        swapped_positions(attention, torch.arange(3)[None], 3, 3, torch.device("cpu"))


# ---------------------------------------------------------------------------- HF's sliding window as posenc's


@pytest.mark.parametrize("name", ["mistral", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("padded", [False, True])
def test_a_sliding_layer_gets_posenc_s_window_mask_when_hf_s_mask_is_exactly_that(name, padded, monkeypatch):
    """The bridge reads HF's ``sliding_window``: an unpadded sliding layer reaches posenc's dispatcher
    with a structured window (so the window backends can serve it), not HF's dense mask; a padded
    batch keeps the dense mask (the window alone would be wrong). Logits equal HF either way, and a
    window one wider than HF's would differ (the test can fail)."""
    import posenc.hf._attention as bridge
    from posenc.masks.attention_mask import SlidingWindowMask, UserBoolMask

    seen = []
    original_attend = bridge.attend

    def spy(*args, **kwargs):
        seen.append(kwargs["mask"])
        return original_attend(*args, **kwargs)

    monkeypatch.setattr(bridge, "attend", spy)
    model = _model(name)
    ids, mask = _inputs()
    if not padded:
        mask = torch.ones_like(mask)
    reference, _ = _run(model, REFERENCE[name][0], ids, mask)
    got, _ = _run(model, "posenc", ids, mask)
    torch.testing.assert_close(got, reference, **REFERENCE[name][2])
    windows = [
        m for m in seen if m is not None and any(isinstance(c, SlidingWindowMask) for c in m.components)
    ]
    window = model.config.sliding_window
    if padded:
        assert windows == []
    else:
        layer_types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * 2
        assert len(windows) == layer_types.count("sliding_attention")
        assert all(not any(isinstance(c, UserBoolMask) for c in m.components) for m in windows)
        assert {c.window for m in windows for c in m.components if isinstance(c, SlidingWindowMask)} == {
            window
        }
        # A wider window is not what HF computes: the comparison that admits the structured mask
        # would refuse it.
        query = torch.zeros(1, 1, LEN, 4)
        hf_mask = torch.ones(LEN, LEN, dtype=torch.bool).tril()
        hf_mask &= ~torch.ones(LEN, LEN, dtype=torch.bool).tril(-window)
        assert bridge._window_mask(hf_mask[None, None], window, query, query) is not None
        assert bridge._window_mask(hf_mask[None, None], window + 1, query, query) is None


# ---------------------------------------------------------------------------- the RoPE pairing of a swapped model


def test_switching_a_swapped_model_s_rope_pairing_keeps_its_logits_and_refuses_an_old_cache():
    """``posenc.hf.switch_rope_pairing_``: q/k rows permuted and the encoding interleaved, the logits
    of the half-pairing model to float64 rounding; keys cached before the switch are in the old
    layout, so continuing that cache is refused; ``posenc.switch_rope_pairing_`` points to it."""
    import posenc
    from posenc.encodings.rope import RoPE

    model = _model("llama")
    posenc_hf.swap_encoding(model, "rope:base=10000")
    ids, mask = _inputs()
    before = model(ids, attention_mask=mask).logits.detach()
    rows = model.model.layers[0].self_attn.q_proj.weight.clone()
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :10], attention_mask=mask[:, :10], past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"posenc\.hf\.switch_rope_pairing_"):
        posenc.switch_rope_pairing_(model)
    assert posenc_hf.switch_rope_pairing_(model, "interleaved") == 2
    assert posenc_hf.switch_rope_pairing_(model, "interleaved") == 0
    assert all(
        isinstance(layer.self_attn.posenc_encoding, RoPE)
        and layer.self_attn.posenc_encoding.pairing == "interleaved"
        for layer in model.model.layers
    )
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, rows)
    after = model(ids, attention_mask=mask).logits.detach()
    real = mask.bool()
    torch.testing.assert_close(after[real], before[real], **EXACT)
    with pytest.raises(ValueError, match=r"before posenc\.hf\.switch_rope_pairing_"), torch.no_grad():
        model(ids[:, 10:12], attention_mask=mask[:, :12], past_key_values=cache, use_cache=True)
    fresh = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :10], attention_mask=mask[:, :10], past_key_values=fresh, use_cache=True)
        step = model(ids[:, 10:12], attention_mask=mask[:, :12], past_key_values=fresh, use_cache=True).logits
    torch.testing.assert_close(step[:, -1], before[:, 11], **EXACT)


def _qk_norm_model(kind: str):
    """A float64 model whose q/k norms carry trained-looking per-channel weights (HF initialises them
    to a constant, which any permutation leaves alone and which would hide a missed norm)."""
    sizes = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    builders = {
        "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **sizes)),
        "gemma3": lambda: transformers.Gemma3ForCausalLM(
            transformers.Gemma3TextConfig(head_dim=16, sliding_window=8, **sizes)
        ),
        "olmo2": lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**sizes)),  # [H*D] norms
        "cohere": lambda: transformers.CohereForCausalLM(
            transformers.CohereConfig(use_qk_norm=True, **sizes)
        ),
    }
    torch.manual_seed(0)
    model = builders[kind]().to(torch.float64).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                param.add_(torch.randn_like(param))
    return model


@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "olmo2", "cohere"])
def test_switching_the_pairing_permutes_the_q_and_k_norms_with_the_rows(kind):
    """q_norm/k_norm weights index the channels the switch renames ([D] per head, [H*D] for OLMo 2,
    [H, D] for Cohere): left in place they changed the logits by 0.1-0.3; permuted with the rows,
    the logits stay to HF's float32 norm arithmetic."""
    model = _qk_norm_model(kind)
    posenc_hf.swap_encoding(model, "rope:base=10000")
    ids, mask = _inputs()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        assert posenc_hf.switch_rope_pairing_(model, "interleaved") == 2
        after = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(after[real], before[real], rtol=1e-6, atol=1e-6)


def test_switching_refuses_what_it_cannot_permute_and_changes_nothing():
    """A parameter outside the known projections and norms, a norm of another size, and K = V are
    refused by name, before any layer is changed."""
    model = _qk_norm_model("qwen3")
    posenc_hf.swap_encoding(model, "rope:base=10000")
    attentions = [layer.self_attn for layer in model.model.layers]
    weights = [a.q_proj.weight.clone() for a in attentions]
    attentions[1].gate = torch.nn.Linear(4, 4).double()
    with pytest.raises(ValueError, match="submodule 'gate'"):
        posenc_hf.switch_rope_pairing_(model, "interleaved")
    assert all(torch.equal(a.q_proj.weight, w) for a, w in zip(attentions, weights, strict=True))
    del attentions[1].gate
    attentions[1].k_norm.weight = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"k_norm.weight has shape \[3\]"):
        posenc_hf.switch_rope_pairing_(model, "interleaved")
    assert all(torch.equal(a.q_proj.weight, w) for a, w in zip(attentions, weights, strict=True))
    model = _model("llama")
    posenc_hf.swap_encoding(model, "rope:base=10000")
    model.model.layers[0].self_attn.v_proj = None
    with pytest.raises(ValueError, match=r"K = V"):
        posenc_hf.switch_rope_pairing_(model, "interleaved")


# ---------------------------------------------------------------------------- Gemma 4: K = V and KV-shared layers
def _gemma4():
    """Gemma 4 with K = V on its global layers (``attention_k_eq_v``: V is the key projection before
    its norm and RoPE) and the last two layers reusing the K/V of the last unshared layer of their type."""
    pytest.importorskip("transformers.models.gemma4")  # a release of the hf range without Gemma 4 skips
    config = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        max_position_embeddings=128, sliding_window=5, attention_k_eq_v=True, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config).to(torch.float64).eval()
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.use_alternative_attention for a in attention] == [False, True, False, True]
    assert [a.is_kv_shared_layer for a in attention] == [False, False, True, True]
    return model


def test_gemma4_k_equals_v_and_shared_kv_layers_equal_hf():
    """HF computes K = V and hands the shared layers the producer's K/V; posenc serves every call:
    logits, every gradient and greedy tokens equal HF's sdpa."""
    model = _gemma4()
    ids, mask = _inputs()
    want, want_grads = _run(model, "sdpa", ids, mask, grads=True)
    got, got_grads = _run(model, posenc_hf.ATTN_IMPLEMENTATION, ids, mask, grads=True)
    torch.testing.assert_close(got, want, **EXACT)
    assert len(got_grads) == len(want_grads) > 0
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-8)
    options = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False}
    model.set_attn_implementation("sdpa")
    tokens = model.generate(ids, **options)
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    assert torch.equal(model.generate(ids, **options), tokens)


def test_gemma4_logits_to_keep_above_one_equals_hf():
    """Gemma 4 cuts its KV-shared layers' queries to the last logits_to_keep tokens and leaves HF's mask
    None (it skips that only for sdpa, flex and flash, by name): the bridge read such a call as HF's
    sdpa does (causal from the first key, keys past Tq dropped), 0.2 off; the queries are the last ones."""
    model = _gemma4()
    ids = _inputs()[0]
    model.set_attn_implementation("sdpa")
    want = model(ids, logits_to_keep=3).logits.detach()
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    torch.testing.assert_close(model(ids, logits_to_keep=3).logits.detach(), want, **EXACT)


# ---------------------------------------------------------------------------- Inkling: relative-projection bias, log temperature
def test_inkling_equals_hf_eager():
    """Inkling hands its dense relative-projection bias (log-temperature scaled on global layers) as
    ``position_bias``: logits and every gradient equal HF's eager (float32 softmax, hence the tolerance)."""
    inkling = pytest.importorskip("transformers.models.inkling.modeling_inkling")
    from transformers.models.inkling.configuration_inkling import InklingTextConfig

    config = InklingTextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=16, sliding_window_size=5,
        layer_types=["hybrid_sliding", "hybrid"], log_scaling_n_floor=4, log_scaling_alpha=0.3, rel_extent=8,
        d_rel=4, intermediate_size=48, mlp_layer_types=["dense", "dense"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = inkling.InklingForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("rel_logits_proj.proj"):
                param.normal_(0.0, 1.0)  # initialised to 0 otherwise: the bias would be 0
    ids = _inputs()[0]
    mask = torch.ones_like(ids)
    want, want_grads = _run(model, "eager", ids, mask, grads=True)
    got, got_grads = _run(model, posenc_hf.ATTN_IMPLEMENTATION, ids, mask, grads=True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert len(got_grads) == len(want_grads) > 0
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_the_bridges_kept_positions_survive_a_write_into_them():
    """The positions of an encoding-free call are views of a kept ``arange``; a write into one (by
    anyone) must not reach the next call's positions."""
    from posenc.kernels.position_ranges import counting_positions as _counting

    cpu = torch.device("cpu")
    first = _counting(5, cpu)
    assert torch.equal(first, torch.arange(5)[None])
    first += 7
    assert torch.equal(_counting(5, cpu), torch.arange(5)[None])
    assert torch.equal(_counting(9000, cpu), torch.arange(9000)[None])  # grows past the kept length


def test_generate_under_inference_mode_equals_no_grad(monkeypatch):
    """Under ``torch.inference_mode`` tensors count no in-place writes: the bridge's kept positions
    (a version-checked table) and the swapped RoPE's positions are made as normal tensors there."""
    from posenc.kernels import position_ranges

    monkeypatch.setattr(position_ranges, "_COUNTING", {})  # the table is first made under inference_mode
    model = _model("llama")
    swapped = posenc_hf.swap_encoding(_model("llama"), "rope")
    ids, mask = _inputs()
    options = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    for m in (model, swapped):
        m.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
        with torch.inference_mode():
            got = m.generate(ids, **options)
        with torch.no_grad():
            want = m.generate(ids, **options)
        assert torch.equal(got, want)
