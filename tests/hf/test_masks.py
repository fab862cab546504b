"""posenc's entry in HF's AttentionMaskInterface (posenc.hf._masks): a plain sliding window is read only off
HF's own unpadded sliding prefill, and models whose attention is not told its window (PhiMoE) or adds the
mask itself (MPNet) are served exactly."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf  # the posenc.hf seam: CI runs these at both ends of the transformers range

transformers = pytest.importorskip("transformers")

import posenc.hf as posenc_hf  # noqa: E402
from posenc.hf._masks import own_attention_model, plain_window  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _registered():
    posenc_hf.register()
    yield
    posenc_hf.register()  # back to the "auto" backend


# ----------------------------------------------------------------------------
# posenc's mask interface in HF: a plain sliding window reaches posenc as its window, never built dense.


mu = pytest.importorskip("transformers.masking_utils")

WINDOW_VOCAB, WINDOW_LEN, WINDOW = 50, 19, 5

EXACT = {"rtol": 1e-9, "atol": 1e-9}


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


def _logits(model, impl, ids, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kwargs).logits


def test_plain_window_is_read_only_off_hf_s_own_unpadded_sliding_prefill():
    # What the skip stands for: HF's dense mask is causal with the last 4 keys (written out here).
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    assert torch.equal(mu.sdpa_mask(**_mask_kwargs())[0, 0], (j <= i) & (j > i - 4))
    assert plain_window(_mask_kwargs()) == 4
    assert plain_window(_mask_kwargs(attention_mask=torch.ones(1, 12, dtype=torch.bool))) == 4
    padded = torch.ones(1, 12, dtype=torch.bool)
    padded[0, 0] = False
    refused = {
        "chunked (chunk 4)": _mask_kwargs(mask_function=mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))),
        "another window": _mask_kwargs(mask_function=mu.sliding_window_causal_mask_function(5)),
        "padding": _mask_kwargs(attention_mask=padded),
        "a cache before": _mask_kwargs(q_offset=3, kv_length=15),
        "keys past the queries": _mask_kwargs(kv_length=15),
        "a kv offset": _mask_kwargs(kv_offset=2),
        "packed or overlaid": _mask_kwargs(allow_is_causal_skip=False),
        "an or/and mask function": _mask_kwargs(use_vmap=True),
        "a full-attention layer": _mask_kwargs(local_size=None, mask_function=mu.causal_mask_function),
        "no q_offset argument": {k: v for k, v in _mask_kwargs().items() if k != "q_offset"},
    }  # fmt: skip
    assert {name: plain_window(kwargs) for name, kwargs in refused.items()} == dict.fromkeys(refused)


def test_decoding_after_an_unbuilt_window_prefill_equals_hf():
    """The prefill's None mask fills HF's sliding cache; the decode steps after it get HF's masks."""
    model = _gemma3()
    ids = torch.randint(0, WINDOW_VOCAB, (1, WINDOW_LEN), generator=torch.Generator().manual_seed(2))
    steps = {}
    for impl in ("sdpa", "posenc"):
        model.set_attn_implementation(impl)
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :12], use_cache=False)  # shows the window reaches the attention: the next is unbuilt
            out = [model(ids[:, :12], past_key_values=cache, use_cache=True).logits]
            for t in range(12, WINDOW_LEN):
                out.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
        steps[impl] = torch.cat(out, dim=1)
    torch.testing.assert_close(steps["posenc"], steps["sdpa"], **EXACT)


# ----------------------------------------------------------------------------
# posenc's HF mask interface hands each model the mask form its attention reads (issue 49, items 1, 2).


reachmu = pytest.importorskip("transformers.masking_utils")

REACH_VOCAB, REACH_LEN, REACH_WINDOW = 50, 13, 4


def _phimoe():
    torch.manual_seed(0)
    config = transformers.PhimoeConfig(
        vocab_size=REACH_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=REACH_WINDOW,
        max_position_embeddings=128,
    )  # fmt: skip
    config._experts_implementation = "eager"  # (HF's grouped_mm experts take no float64)
    return transformers.PhimoeForCausalLM(config).double().eval()


def _mistral():
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=REACH_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=128, sliding_window=REACH_WINDOW,
    )  # fmt: skip
    return transformers.MistralForCausalLM(config).double().eval()


def _qwen2():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=REACH_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, use_sliding_window=True, sliding_window=REACH_WINDOW,
        max_window_layers=0,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config).double().eval()


def _ids(batch: int = 2):
    return torch.randint(0, REACH_VOCAB, (batch, REACH_LEN), generator=torch.Generator().manual_seed(1))


def _generate(model, impl, ids):
    model.set_attn_implementation(impl)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=8,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )  # fmt: skip  (the mask given: HF would read the random ids equal to pad_token_id as padding)
    return out.sequences, torch.stack(out.logits, dim=1)


class _DenseWindows:
    """The windows HF built dense through posenc's mask interface (their ``local_size``)."""

    def __init__(self, monkeypatch):
        self.sizes = []
        interface = reachmu.ALL_MASK_ATTENTION_FUNCTIONS
        original = interface[posenc_hf.ATTN_IMPLEMENTATION]

        def mask(*args, **kwargs):
            built = original(*args, **kwargs)
            if isinstance(built, torch.Tensor) and kwargs.get("local_size") is not None:
                self.sizes.append(kwargs["local_size"])
            return built

        monkeypatch.setitem(interface._local_mapping, posenc_hf.ATTN_IMPLEMENTATION, mask)


def _mpnet(impl: str):
    torch.manual_seed(0)
    config = transformers.MPNetConfig(
        vocab_size=REACH_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    return transformers.MPNetModel._from_config(config, attn_implementation=impl).double().eval()


def test_phimoe_whose_attention_is_not_told_its_window_gets_the_window_built(monkeypatch):
    """PhiMoE's attention call passes no ``sliding_window``: every prefill's window is built dense."""
    model = _phimoe()
    ids = _ids()
    want = _logits(model, "sdpa", ids)
    hidden = (torch.arange(REACH_LEN)[:, None] - torch.arange(REACH_LEN)[None, :]) >= REACH_WINDOW
    assert hidden.any()  # the window hides keys: a plain causal mask would differ
    dense = _DenseWindows(monkeypatch)
    for _ in range(3):  # the first forward and those after it (the model is known by then)
        torch.testing.assert_close(_logits(model, posenc_hf.ATTN_IMPLEMENTATION, ids), want, **EXACT)
    assert dense.sizes == [REACH_WINDOW] * 3


def test_phimoe_greedy_generate_equals_hf_sdpa():
    model = _phimoe()
    ids = _ids()
    want_tokens, want_logits = _generate(model, "sdpa", ids)
    for _ in range(2):
        tokens, logits = _generate(model, posenc_hf.ATTN_IMPLEMENTATION, ids)
        assert torch.equal(tokens, want_tokens)
        torch.testing.assert_close(logits, want_logits, **EXACT)


@pytest.mark.parametrize("build", [_mistral, _qwen2], ids=["mistral", "qwen2"])
def test_models_told_their_window_stay_exact_and_skip_it_once_known(build, monkeypatch):
    """Mistral and Qwen2 hand their attention ``sliding_window``: after the first forward shows it,
    the window is no longer built dense, and logits and greedy generation equal HF's sdpa."""
    model = build()
    ids = _ids()
    want = _logits(model, "sdpa", ids)
    dense = _DenseWindows(monkeypatch)
    for _ in range(2):
        torch.testing.assert_close(_logits(model, posenc_hf.ATTN_IMPLEMENTATION, ids), want, **EXACT)
    assert dense.sizes == [REACH_WINDOW]  # the first forward only
    want_tokens, want_logits = _generate(model, "sdpa", ids)
    tokens, logits = _generate(model, posenc_hf.ATTN_IMPLEMENTATION, ids)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, **EXACT)


def test_mpnet_whose_attention_adds_the_mask_itself_runs_exactly_as_eager():
    """MPNet's attention is its own (it adds the mask to its scores), and HF builds its mask under
    ``attn_implementation="posenc"``: it gets HF's eager form, so a padded batch equals eager."""
    ids = torch.randint(3, REACH_VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0  # right padding (an encoder)
    mask[2, :3] = 0  # left padding
    eager = _mpnet("eager")
    posenc = _mpnet(posenc_hf.ATTN_IMPLEMENTATION)
    assert posenc.config._attn_implementation == posenc_hf.ATTN_IMPLEMENTATION
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).last_hidden_state
        posenc_hf._masks._warn_own_attention.cache_clear()
        with pytest.warns(UserWarning, match="MPNetModel does not route its attention"):
            got = posenc(ids, attention_mask=mask).last_hidden_state
        unpadded = posenc(ids).last_hidden_state
        want_unpadded = eager(ids).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], **EXACT)
    torch.testing.assert_close(unpadded, want_unpadded, **EXACT)


def test_only_models_outside_hf_s_attention_interface_get_the_eager_form():

    assert own_attention_model(transformers.MPNetConfig) == "MPNetModel"
    assert own_attention_model(transformers.LlamaConfig) is None
    assert own_attention_model(transformers.PhimoeConfig) is None
    assert own_attention_model(type("UnmappedConfig", (), {})) is None  # unknown: served as before
