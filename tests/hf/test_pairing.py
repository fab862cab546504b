"""posenc.hf.switch_rope_pairing_ (posenc.hf._pairing): the q/k rows and norms permuted with the pairing keep
the logits; what cannot be permuted is refused and nothing changes."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf  # the posenc.hf seam: CI runs these at both ends of the transformers range

transformers = pytest.importorskip("transformers")

import posenc.hf as posenc_hf  # noqa: E402
from _hf_models import (  # noqa: E402
    EXACT,
    VOCAB,
    _inputs,
    _model,
)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    posenc_hf.register()
    yield
    posenc_hf.register()  # back to the "auto" backend


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
