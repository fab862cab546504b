"""A whole TransformerLM's decode step in fixed shapes (posenc.layers.decode.ModelDecodeStep) and
``TransformerLM.generate(compiled=True)``: each step's logits equal the model's own forward over the
whole sequence (no cache), the compiled generate gives the eager generate's tokens and a second call
compiles nothing new, and what the step cannot serve is refused with the reason."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.layers.decode import ModelDecodeStep

ENCODINGS = ["rope", "alibi", "sinusoidal", ["rope", "t5", "nope"]]


def _model(encoding, **options) -> posenc.TransformerLM:
    torch.manual_seed(0)
    layers = len(encoding) if isinstance(encoding, list) else 2
    return posenc.TransformerLM(37, 24, layers, 4, encoding, num_kv_heads=2, max_len=64, **options).eval()


@pytest.mark.parametrize("encoding", ENCODINGS, ids=str)
def test_each_step_gives_the_logits_of_the_whole_sequence(encoding):
    model = _model(encoding)
    tokens = torch.randint(0, 37, (2, 9))
    cache = posenc.KVCache(max_length=12)
    with torch.no_grad():
        model(tokens[:, :5], cache=cache)
        step = ModelDecodeStep(model, cache)
        for t in range(5, 9):
            got = step(tokens[:, t : t + 1], step.next_position())
            want = model(tokens[:, : t + 1])[:, -1]  # no cache: the model's own full pass
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        step.sync()
        assert cache.length(0, cross=False) == 9


def test_what_the_step_cannot_serve_is_refused_with_the_reason():
    tokens = torch.randint(0, 37, (1, 4))
    windowed = posenc.TransformerLM(37, 24, 2, 4, pattern="gemma3:window=4", max_len=64).eval()
    cache = posenc.KVCache(max_length=8)
    with torch.no_grad():
        windowed(tokens, cache=cache)
    with pytest.raises(ValueError, match="window"):
        ModelDecodeStep(windowed, cache)
    with pytest.raises(ValueError, match="window"):
        windowed.generate(tokens, 3, compiled=True)
    model = _model("rope").train()
    with pytest.raises(ValueError, match=r"training mode; call model\.eval\(\)"):
        ModelDecodeStep(model, cache)
    with pytest.raises(ValueError, match="use_cache=True"):
        _model("rope").generate(tokens, 3, compiled=True, use_cache=False)
    with pytest.raises(ValueError, match=r"must be a posenc\.TransformerLM"):
        ModelDecodeStep(torch.nn.Linear(2, 2), cache)


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ENCODINGS, ids=str)
def test_compiled_generate_gives_the_eager_tokens_and_compiles_once(encoding):
    from torch._dynamo.utils import counters

    model = _model(encoding)
    prompt = torch.randint(0, 37, (2, 6))
    eager = model.generate(prompt, 10)
    assert torch.equal(model.generate(prompt, 10, compiled=True), eager)  # compiles
    counters.clear()
    other = torch.randint(0, 37, (2, 6))
    assert torch.equal(model.generate(other, 10, compiled=True), model.generate(other, 10))
    assert dict(counters["stats"]) == {} and dict(counters["graph_break"]) == {}
    # eos: rows stop as the eager path stops them
    eos = int(eager[0, 8])
    assert torch.equal(
        model.generate(prompt, 10, compiled=True, eos_token=eos), model.generate(prompt, 10, eos_token=eos)
    )
