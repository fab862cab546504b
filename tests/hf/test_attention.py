"""posenc as an HF transformers attention implementation (posenc.hf._attention): equal to the model's own
sdpa / eager, its plain decode step, and the sliding windows it reads off HF's calls.

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

import posenc  # noqa: E402
import posenc.hf as posenc_hf  # noqa: E402
from _hf_models import (  # noqa: E402  # noqa: E402
    EXACT,
    LEN,
    MODELS,
    REFERENCE,
    VOCAB,
    _inputs,
    _model,
    _run,
)
from posenc.backends.dispatch import PRIORITY, set_priority  # noqa: E402
from posenc.hf import _attention as bridge  # noqa: E402


@pytest.fixture(autouse=True)
def _registered():  # each test: the plain decode step's tests start from register()'s "auto"
    posenc_hf.register()
    yield
    posenc_hf.register()  # back to the "auto" backend


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


# ----------------------------------------------------------------------------
# The HF bridge's plain decode step (``posenc.hf._attention._plain_decode``): one query on CPU without
# gradients, no mask, bias, sinks or window, whose signature the dispatcher answered with sdpa, runs without
# building a request. It must give the full path's logits bit for bit, still send a nan in the new tokens
# (or in the cache) to a backend that propagates it, and follow a forced backend or a new priority order at
# once.


PLAIN_VOCAB = 50


def _llama(num_kv_heads: int = 2, dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=PLAIN_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    return model


def _served(monkeypatch) -> list[bool]:
    """One entry per layer call: whether the plain decode step served it."""
    served: list[bool] = []
    real = bridge._plain_decode
    monkeypatch.setattr(bridge, "_plain_decode", lambda *a: served.append(True) or real(*a))
    return served


def _decode(model, ids: torch.Tensor, prompt: int) -> list[torch.Tensor]:
    """The logits of a prompt, then of one token at a time."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits]
        for t in range(prompt, ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    return logits


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plain_decode_step_gives_the_full_path_s_logits_bit_for_bit(num_kv_heads, dtype, monkeypatch):
    model = _llama(num_kv_heads, dtype)
    ids = torch.randint(0, PLAIN_VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    served = _served(monkeypatch)
    fast = _decode(model, ids, 5)
    assert len(served) >= 2 * 5, "the plain decode step served the later steps"
    with monkeypatch.context() as full:
        full.setattr(bridge, "_plain_call", lambda *a: None)
        want = _decode(model, ids, 5)
    for got, expected in zip(fast, want, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("where", ["query", "new key", "new value"])
def test_a_nan_in_a_plain_decode_step_goes_to_eager_and_stays_nan(where, monkeypatch):
    model = _llama()
    ids = torch.randint(1, PLAIN_VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    cache = transformers.DynamicCache(config=model.config)
    layer = model.model.layers[1].self_attn
    projection = {"query": layer.q_proj, "new key": layer.k_proj, "new value": layer.v_proj}[where]
    with torch.no_grad():
        model(ids[:, :5], past_key_values=cache, use_cache=True)
        served = _served(monkeypatch)
        for t in (5, 6):  # the first remembers the signature, the second is served plainly
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        assert served and posenc_hf.last_backend() == "sdpa"
        handle = projection.register_forward_hook(
            lambda m, i, out: out.index_fill(-1, torch.tensor([0]), torch.nan)
        )
        out = model(ids[:, 7:8], past_key_values=cache, use_cache=True).logits
        handle.remove()
        assert not torch.isfinite(out).any() and posenc_hf.last_backend() == "eager"
        if where != "query":  # the nan now sits in layer 1's cache: every later step there is eager
            out = model(ids[:, 8:9], past_key_values=cache, use_cache=True).logits
            assert not torch.isfinite(out).any() and posenc_hf.last_backend() == "eager"


def test_a_forced_backend_and_a_new_order_take_effect_on_the_next_plain_step(monkeypatch):
    model = _llama()
    ids = torch.randint(0, PLAIN_VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    cache = transformers.DynamicCache(config=model.config)
    before = PRIORITY["cpu"]

    def step(t: int) -> str:
        model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        return posenc_hf.last_backend()

    with torch.no_grad():
        model(ids[:, :5], past_key_values=cache, use_cache=True)
        assert step(5) == step(6) == "sdpa"
        with posenc.use_backend("eager"):
            assert step(7) == "eager"
        assert step(8) == "sdpa"
        try:
            set_priority("cpu", ("eager", *(n for n in before if n != "eager")))
            assert step(9) == "eager"
        finally:
            set_priority("cpu", before)
        assert step(10) == "sdpa"


def test_gradients_masks_and_windows_take_the_full_path(monkeypatch):
    """The plain step serves no call that needs more than sdpa over every key: under grad, with a
    padding mask, or in a layer that names a sliding window."""
    model = _llama()
    ids = torch.randint(0, PLAIN_VOCAB, (1, 8), generator=torch.Generator().manual_seed(6))
    served = _served(monkeypatch)
    cache = transformers.DynamicCache(config=model.config)
    model(ids[:, :5], past_key_values=cache, use_cache=True)
    for t in (5, 6):  # grad enabled
        model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
    assert served == []
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 0] = 0
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :5], attention_mask=mask[:, :5], past_key_values=cache, use_cache=True)
        for t in (5, 6):
            model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache, use_cache=True)
    assert served == []


def test_keys_inserted_before_the_new_one_are_checked(monkeypatch):
    """The plain step links a call to the last one only when exactly one key was added: keys put
    into a cache by other means (here one whose key repeats the last checked one, so the keys
    before the new token still end as the last call's did, and whose value holds a nan) are read
    by the full path's check, which sends the call to eager."""
    model = _llama()
    module = model.model.layers[0].self_attn
    torch.manual_seed(8)
    q = torch.randn(1, 4, 1, 16)
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)

    def call(k: torch.Tensor, v: torch.Tensor) -> str:
        bridge.attention_forward(module, q, k, v, None, scaling=0.25)
        return posenc_hf.last_backend()

    served = _served(monkeypatch)
    with torch.no_grad():
        for _ in range(3):  # the first remembers the signature, the next are served plainly
            k, v = torch.cat([k, torch.randn(1, 2, 1, 16)], 2), torch.cat([v, torch.randn(1, 2, 1, 16)], 2)
            assert call(k, v) == "sdpa"
        assert len(served) == 2
        inserted_v = torch.full((1, 2, 1, 16), float("nan"))
        k = torch.cat([k, k[:, :, -1:], torch.randn(1, 2, 1, 16)], 2)
        v = torch.cat([v, inserted_v, torch.randn(1, 2, 1, 16)], 2)
        assert call(k, v) == "eager"


def test_values_of_another_width_are_served_bit_for_bit(monkeypatch):
    """MLA's values are narrower than its queries and keys: the plain step tests the three apart and
    gives the full path's output."""
    model = _llama()
    module = model.model.layers[0].self_attn
    torch.manual_seed(9)
    q = torch.randn(1, 4, 1, 16)
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 8)
    steps = [(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 8)) for _ in range(4)]

    def decode() -> list[torch.Tensor]:
        keys, values, outs = k, v, []
        with torch.no_grad():
            for new_k, new_v in steps:
                keys, values = torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2)
                outs.append(bridge.attention_forward(module, q, keys, values, None, scaling=0.25)[0])
        return outs

    served = _served(monkeypatch)
    got = decode()
    assert len(served) == 3 and posenc_hf.last_backend() == "sdpa"
    bridge._CHECKED.pop(module, None)
    with monkeypatch.context() as full:
        full.setattr(bridge, "_plain_call", lambda *a: None)
        want = decode()
    for out, expected in zip(got, want, strict=True):
        assert out.shape == (1, 1, 4, 8) and torch.equal(out, expected)


# ----------------------------------------------------------------------------
# posenc's entry in HF's AttentionMaskInterface (posenc.hf._masks): where HF's mask is exactly a plain
# sliding window, the layer gets posenc's window instead of a dense mask.


# ----------------------------------------------------------------------------
# posenc's mask interface in HF: a plain sliding window reaches posenc as its window, never built dense.


mu = pytest.importorskip("transformers.masking_utils")


WINDOW_VOCAB, WINDOW_LEN, WINDOW = 50, 19, 5


def _gemma3():
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=WINDOW_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    return transformers.Gemma3ForCausalLM(config).double().eval()


def _mask_kwargs(**changes):
    kwargs = dict(
        batch_size=1, q_length=12, kv_length=12, q_offset=0, kv_offset=0, attention_mask=None,
        mask_function=mu.sliding_window_causal_mask_function(4), local_size=4, allow_is_causal_skip=True,
        use_vmap=False, device="cpu",
    )  # fmt: skip
    kwargs.update(changes)
    return kwargs


class _Spies:
    """The windows HF built dense through posenc's mask interface, and what posenc's ``attend`` got."""

    def __init__(self, monkeypatch):
        self.windows_built, self.attends = [], []
        interface = mu.ALL_MASK_ATTENTION_FUNCTIONS
        original_mask, original_attend = interface[posenc_hf.ATTN_IMPLEMENTATION], bridge.attend

        def mask(*args, **kwargs):
            built = original_mask(*args, **kwargs)
            if isinstance(built, torch.Tensor) and kwargs.get("local_size") is not None:
                self.windows_built.append(kwargs["local_size"])
            return built

        def attend(*args, **kwargs):
            self.attends.append((kwargs["mask"], kwargs["attn_mask"]))
            return original_attend(*args, **kwargs)

        monkeypatch.setitem(interface._local_mapping, posenc_hf.ATTN_IMPLEMENTATION, mask)
        monkeypatch.setattr(bridge, "attend", attend)

    def window_sizes(self):
        from posenc.masks.attention_mask import SlidingWindowMask

        return [
            c.window
            for m, _ in self.attends
            if m is not None
            for c in m.components
            if isinstance(c, SlidingWindowMask)
        ]


def _logits(model, impl, ids, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kwargs).logits


# ---------------------------------------------------------------------------- HF's sliding window as posenc's


@pytest.mark.parametrize("name", ["mistral", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("padded", [False, True])
def test_a_sliding_layer_gets_posenc_s_window_mask_when_hf_s_mask_is_exactly_that(name, padded, monkeypatch):
    """The bridge reads HF's ``sliding_window``: an unpadded sliding layer reaches posenc's dispatcher
    with a structured window (so the window backends can serve it), not HF's dense mask; a padded
    batch keeps the dense mask (the window alone would be wrong). Logits equal HF either way, and a
    window one wider than HF's would differ (the test can fail)."""
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


def test_causal_window_applies_only_a_window_that_hides_keys():
    q = torch.zeros(1, 2, 7, 4, dtype=torch.float64)
    assert bridge._causal_window(7, q, q, 0) is None  # 7 queries, window 7: plain causal hides as much
    assert bridge._causal_window(None, q, q, 0) is None
    mask = bridge._causal_window(3, q, q, 0)
    hf = mu.sdpa_mask(**_mask_kwargs(q_length=7, kv_length=7, mask_function=mu.sliding_window_causal_mask_function(3), local_size=3))  # fmt: skip
    assert torch.equal(mask.dense().reshape(7, 7), hf[0, 0])
    k = torch.zeros(
        1, 2, 10, 4, dtype=torch.float64
    )  # queries are the last 7 of 10 keys (Gemma 4's shared layers)
    hf = mu.sdpa_mask(**_mask_kwargs(q_length=7, kv_length=10, q_offset=3, mask_function=mu.sliding_window_causal_mask_function(3), local_size=3))  # fmt: skip
    assert torch.equal(bridge._causal_window(3, q, k, 3).dense().reshape(7, 10), hf[0, 0])


@pytest.mark.parametrize("with_ones_mask", [False, True])
def test_an_unpadded_gemma3_prefill_builds_no_dense_mask_for_its_sliding_layers(with_ones_mask, monkeypatch):
    model = _gemma3()
    ids = torch.randint(0, WINDOW_VOCAB, (2, WINDOW_LEN), generator=torch.Generator().manual_seed(1))
    kwargs = {"attention_mask": torch.ones(2, WINDOW_LEN, dtype=torch.long)} if with_ones_mask else {}
    want = _logits(model, "sdpa", ids, **kwargs)
    # The model's first posenc forward shows that its attention is handed sliding_window (until then
    # the window is built dense: a model like PhiMoE's would not get it, tests/hf/test_masks.py).
    first = _Spies(monkeypatch)
    torch.testing.assert_close(_logits(model, "posenc", ids, **kwargs), want, **EXACT)
    assert first.windows_built == [WINDOW]
    spies = _Spies(monkeypatch)
    got = _logits(model, "posenc", ids, **kwargs)
    torch.testing.assert_close(got, want, **EXACT)
    assert spies.windows_built == []  # no dense window built
    assert [dense for _, dense in spies.attends] == [None, None, None]  # nor handed to posenc
    assert spies.window_sizes() == [WINDOW, WINDOW]  # the two sliding layers, as their window


def test_padded_and_packed_gemma3_batches_keep_hf_s_dense_window(monkeypatch):
    model = _gemma3()
    ids = torch.randint(0, WINDOW_VOCAB, (2, WINDOW_LEN), generator=torch.Generator().manual_seed(1))
    padded = torch.ones(2, WINDOW_LEN, dtype=torch.long)
    padded[1, :4] = 0
    packed = torch.cat([torch.arange(10), torch.arange(WINDOW_LEN - 10)])[None].expand(2, -1)
    # (HF reads restarting position_ids as packed documents only without a cache)
    for kwargs in ({"attention_mask": padded}, {"position_ids": packed, "use_cache": False}):
        want = _logits(model, "sdpa", ids, **kwargs)
        spies = _Spies(monkeypatch)
        got = _logits(model, "posenc", ids, **kwargs)
        real = kwargs.get("attention_mask", torch.ones(2, WINDOW_LEN)).bool()
        torch.testing.assert_close(got[real], want[real], **EXACT)
        assert WINDOW in spies.windows_built  # HF built the window's dense mask: posenc used it
        assert spies.window_sizes() == []
