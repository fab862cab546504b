"""posenc.hf.swap_encoding and set_rope_scaling (posenc.hf._swap) on tiny random HF models: posenc's RoPE
swapped in equals the model's own, a scaling set in place equals loading with it, and what they cannot do
is refused."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf  # the posenc.hf seam: CI runs these at both ends of the transformers range

transformers = pytest.importorskip("transformers")

import posenc.hf as posenc_hf  # noqa: E402
from _hf_models import (  # noqa: E402
    EXACT,
    LEN,
    VOCAB,
    _inputs,
    _logits,
    _model,
    _run,
)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    posenc_hf.register()
    yield
    posenc_hf.register()  # back to the "auto" backend


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
