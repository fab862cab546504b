"""posenc's HF mask interface hands each model the mask form its attention reads (issue 49, items 1, 2).

* A sliding window is left unbuilt (None) only for a model whose attention calls carry
  ``sliding_window``: PhiMoE's attention passes none, so a None reached it as plain causal (logits
  0.118 off HF's sdpa on prefill, 0.525 after generate, in the probe that found it).
* A model whose own attention adds the mask to its scores (MPNet: not routed through
  ``AttentionInterface``) gets HF's eager mask, as it would with ``attn_implementation="eager"``
  (posenc's bool mask added as numbers put a padded batch 0.13-0.16 off eager).

References: the same tiny random models (nothing downloaded) run with HF's ``sdpa`` / ``eager`` in
float64.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")
import posenc.hf as posenc_hf  # noqa: E402

mu = pytest.importorskip("transformers.masking_utils")

VOCAB, LEN, WINDOW = 50, 13, 4
EXACT = {"rtol": 1e-9, "atol": 1e-9}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    posenc_hf.register()


def _phimoe():
    torch.manual_seed(0)
    config = transformers.PhimoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=128,
    )  # fmt: skip
    config._experts_implementation = "eager"  # (HF's grouped_mm experts take no float64)
    return transformers.PhimoeForCausalLM(config).double().eval()


def _mistral():
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=128, sliding_window=WINDOW,
    )  # fmt: skip
    return transformers.MistralForCausalLM(config).double().eval()


def _qwen2():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=0,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config).double().eval()


def _ids(batch: int = 2):
    return torch.randint(0, VOCAB, (batch, LEN), generator=torch.Generator().manual_seed(1))


def _logits(model, impl, ids, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kwargs).logits


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
        interface = mu.ALL_MASK_ATTENTION_FUNCTIONS
        original = interface[posenc_hf.ATTN_IMPLEMENTATION]

        def mask(*args, **kwargs):
            built = original(*args, **kwargs)
            if isinstance(built, torch.Tensor) and kwargs.get("local_size") is not None:
                self.sizes.append(kwargs["local_size"])
            return built

        monkeypatch.setitem(interface._local_mapping, posenc_hf.ATTN_IMPLEMENTATION, mask)


def test_phimoe_whose_attention_is_not_told_its_window_gets_the_window_built(monkeypatch):
    """PhiMoE's attention call passes no ``sliding_window``: every prefill's window is built dense."""
    model = _phimoe()
    ids = _ids()
    want = _logits(model, "sdpa", ids)
    hidden = (torch.arange(LEN)[:, None] - torch.arange(LEN)[None, :]) >= WINDOW
    assert hidden.any()  # the window hides keys: a plain causal mask would differ
    dense = _DenseWindows(monkeypatch)
    for _ in range(3):  # the first forward and those after it (the model is known by then)
        torch.testing.assert_close(_logits(model, posenc_hf.ATTN_IMPLEMENTATION, ids), want, **EXACT)
    assert dense.sizes == [WINDOW] * 3


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
    assert dense.sizes == [WINDOW]  # the first forward only
    want_tokens, want_logits = _generate(model, "sdpa", ids)
    tokens, logits = _generate(model, posenc_hf.ATTN_IMPLEMENTATION, ids)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, **EXACT)


def _mpnet(impl: str):
    torch.manual_seed(0)
    config = transformers.MPNetConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    return transformers.MPNetModel._from_config(config, attn_implementation=impl).double().eval()


def test_mpnet_whose_attention_adds_the_mask_itself_runs_exactly_as_eager():
    """MPNet's attention is its own (it adds the mask to its scores), and HF builds its mask under
    ``attn_implementation="posenc"``: it gets HF's eager form, so a padded batch equals eager."""
    ids = torch.randint(3, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
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
    from posenc.hf._masks import own_attention_model

    assert own_attention_model(transformers.MPNetConfig) == "MPNetModel"
    assert own_attention_model(transformers.LlamaConfig) is None
    assert own_attention_model(transformers.PhimoeConfig) is None
    assert own_attention_model(type("UnmappedConfig", (), {})) is None  # unknown: served as before
