"""Nothing silent where posenc meets HF models (``posenc.hf``): key positions kept with their
cache, RoPE scaling changed all or nothing.

* Two conversations in two caches, interleaved, with an uncached pass between: each one's next
  logits equal the conversation decoded alone (ALiBi, RoPE, T5 swapped into Llama).
* ``set_rope_scaling`` with bad parameters is refused and changes nothing (config, rotary
  embedding, frequencies); the model still saves and loads.

The expected values come from a fresh run of the same model on one conversation alone, and from
the model's config and rotary embedding as they were before a refused call.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
import posenc.hf as posenc_hf  # noqa: E402

pytestmark = pytest.mark.hf


VOCAB = 40


def _llama(spec: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(torch.float64).eval()
    return posenc_hf.swap_encoding(model, spec) if spec else model


def _cache(model):
    return transformers.DynamicCache(config=model.config)


def _step(model, ids, cache, start):
    positions = torch.arange(start, start + ids.shape[1])[None]
    return model(ids, past_key_values=cache, position_ids=positions, use_cache=True).logits[:, -1]


def _conversations():
    generator = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (1, 7), generator=generator), torch.randint(
        0, VOCAB, (1, 12), generator=generator
    )


def _alone(model, ids):
    """The logits of the last token of ``ids`` decoded after its prefix, in a cache of its own."""
    cache = _cache(model)
    _step(model, ids[:, :-1], cache, 0)
    return _step(model, ids[:, -1:], cache, ids.shape[1] - 1)


@pytest.mark.parametrize("spec", ["alibi", "rope:base=10000", "t5:num_buckets=8,max_distance=16"])
def test_two_caches_keep_their_own_key_positions(spec):
    """Two conversations in two caches, interleaved, with an uncached scoring pass between: each
    one's next logits equal the conversation decoded alone."""
    model = _llama(spec)
    a, b = _conversations()
    cache_a, cache_b = _cache(model), _cache(model)
    _step(model, a[:, :-1], cache_a, 0)
    _step(model, b[:, :-1], cache_b, 0)  # another conversation, longer
    model(b)  # an uncached pass in between
    got_a = _step(model, a[:, -1:], cache_a, a.shape[1] - 1)
    got_b = _step(model, b[:, -1:], cache_b, b.shape[1] - 1)
    torch.testing.assert_close(got_a, _alone(model, a), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_b, _alone(model, b), rtol=1e-10, atol=1e-10)


def _rope_state(model):
    decoder = model.model
    return (
        copy.deepcopy(model.config.rope_parameters),
        decoder.rotary_emb,
        decoder.rotary_emb.inv_freq.clone(),
    )


@pytest.mark.parametrize(
    ("rope_parameters", "key"),
    [
        ({"rope_type": "yarnn", "factor": 2.0}, "yarnn"),
        ({"rope_type": "yarn"}, "factor"),
        ({"rope_type": "linear", "factor": -2.0}, "factor"),
        ({"rope_type": "linear", "factor": float("nan")}, "factor"),
    ],
)
def test_set_rope_scaling_refuses_bad_parameters_and_changes_nothing(rope_parameters, key):
    model = _llama("")
    config_before, rotary_before, inv_freq_before = _rope_state(model)
    with pytest.raises(ValueError, match=key):
        posenc_hf.set_rope_scaling(model, rope_parameters)
    assert model.config.rope_parameters == config_before
    assert model.model.rotary_emb is rotary_before
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv_freq_before, rtol=0, atol=0)


def test_a_refused_scaling_leaves_a_model_that_saves_and_loads(tmp_path):
    model = _llama("")
    with pytest.raises(ValueError):
        posenc_hf.set_rope_scaling(model, {"rope_type": "yarn"})
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    ids = torch.randint(0, VOCAB, (1, 9))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-10, atol=1e-10)
