"""HF's static cache with posenc: a swapped model decodes with it as with the dynamic cache (its key
positions kept in a tensor beside HF's ``StaticLayer``), HF's ``StaticLayer`` still writes slots as
posenc reads them (the seam's canary), and ``torch.compile(fullgraph=True)`` of a model's forward
with a static cache traces posenc's paths whole: after one warm-up ``generate`` a second one traces
no new frame (``slow``: each compiles a model)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf  # the posenc.hf seam: CI runs these at both ends of the transformers range

transformers = pytest.importorskip("transformers")

import posenc.hf as posenc_hf  # noqa: E402
from _hf_models import _inputs, _model, _swapped  # noqa: E402

#: One swapped encoding of each kind that reads the keys' positions: rotary with a scaling, ALiBi's
#: and T5's biases.
SPECS = [
    "rope:scaling=yarn,factor=2,original_max_position_embeddings=64",
    "alibi",
    "t5:num_buckets=8,max_distance=16",
]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    posenc_hf.register()
    yield
    posenc_hf.register()


def _generate(model, ids, mask, cache: str | None, new: int = 6):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0, cache_implementation=cache,
        )  # fmt: skip
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("spec", SPECS)
def test_a_swapped_model_decodes_with_a_static_cache_as_with_the_dynamic_one(spec):
    """Left-padded rows (positions differ per row): the static cache's tokens and step logits equal the
    dynamic cache's, which the bridge's other tests hold equal to a full pass."""
    model = _swapped("llama", spec)
    ids, mask = _inputs()
    dynamic = _generate(model, ids, mask, None)
    static = _generate(model, ids, mask, "static")
    assert torch.equal(static[0], dynamic[0])
    torch.testing.assert_close(static[1], dynamic[1], rtol=1e-5, atol=1e-5)
    layer = model.model.layers[0].self_attn
    assert layer.__dict__["_posenc_call_cache"] is not None  # the static path ran with a cache


def test_hf_static_layer_writes_the_slots_posenc_reads():
    """The seam's canary: HF's ``StaticLayer.update`` writes a call's keys at slots
    ``cumulative_length .. + T`` and advances ``cumulative_length`` before the attention runs, and
    hands over every slot (posenc writes the positions of the same slots)."""
    from transformers.cache_utils import StaticLayer

    layer = StaticLayer(max_cache_len=8)
    keys = torch.arange(2 * 3 * 2, dtype=torch.float32).view(1, 2, 3, 2)
    layer.update(keys, keys)
    out, _ = layer.update(keys[:, :, :1] + 100, keys[:, :, :1])
    assert int(layer.cumulative_length) == 4 and out.shape[2] == 8
    torch.testing.assert_close(out[:, :, :3], keys)
    torch.testing.assert_close(out[:, :, 3], keys[:, :, 0] + 100)
    assert not bool(out[:, :, 4:].any())


def test_a_sliding_static_cache_decodes_as_the_dynamic_one():
    """A sliding static layer (Mistral's window, shorter than the sequence) hands over its window's
    keys in order, placed by the cache's length as a dynamic sliding layer's: the same tokens."""
    model = posenc_hf.swap_encoding(_model("mistral"), "alibi")
    ids, mask = _inputs()
    dynamic = _generate(model, ids, mask, None, new=8)
    static = _generate(model, ids, mask, "static", new=8)
    assert torch.equal(static[0], dynamic[0])
    torch.testing.assert_close(static[1], dynamic[1], rtol=1e-5, atol=1e-5)


def _compiled_twice(model, ids, mask):
    """The forward compiled with fullgraph=True before any call (posenc's first-call bookkeeping then
    runs traced): a warm-up generate, and a second one with dynamo's counters cleared; then the
    uncompiled forward's tokens. Returns (uncompiled, compiled tokens, counters)."""
    from torch._dynamo.utils import counters

    eager_forward = model.forward
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True)
    _generate(model, ids, mask, "static")
    counters.clear()
    got = _generate(model, ids, mask, "static")[0]
    counted = {k: dict(v) for k, v in counters.items() if v}
    model.forward = eager_forward
    return _generate(model, ids, mask, "static")[0], got, counted


COMPILED = {
    "llama": lambda: _model("llama"),
    "llama-alibi": lambda: _swapped("llama", "alibi"),
    "llama-yarn": lambda: _swapped("llama", SPECS[0]),
    "gemma3-hybrid": lambda: _model("gemma3"),  # sliding and global layers, HF's static hybrid cache
    # tt-xla 3688 (reported 2026): a window cache recompiled on every decode step of compiled generation
    "tt_xla_3688-mistral-sliding-window": lambda: _model("mistral"),
}


@pytest.mark.slow
@pytest.mark.filterwarnings("error::UserWarning")  # a path that cannot compile must not only warn
@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_static_generation_traces_once(name):
    model = COMPILED[name]().float()
    model.config._attn_implementation = "posenc"
    ids, mask = _inputs()
    want, got, counted = _compiled_twice(model, ids, mask)
    assert torch.equal(got, want)
    assert counted == {}, counted  # no frame traced, no graph compiled, no break: every call a cache hit
