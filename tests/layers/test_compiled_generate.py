"""A whole TransformerLM decoding in fixed shapes (``KVCache.fixed_shapes()``) and
``TransformerLM.generate(compiled=True)``, which compiles the model's own forward on those steps:
each step's logits equal the model's own forward over the whole sequence (no cache), the compiled
generate gives the eager generate's tokens for any number of shapes and models, and what the fixed
shapes cannot serve is refused with the reason and ``compiled=False`` to pass."""

from __future__ import annotations

import warnings

import pytest
import torch

import posenc
from posenc.layers import step as step_module

ENCODINGS = ["rope", "alibi", "sinusoidal", ["rope", "t5", "nope"]]


def _model(encoding, **options) -> posenc.TransformerLM:
    torch.manual_seed(0)
    layers = len(encoding) if isinstance(encoding, list) else 2
    return posenc.TransformerLM(37, 24, layers, 4, encoding, num_kv_heads=2, max_len=64, **options).eval()


@pytest.fixture
def traced_only(monkeypatch):
    """generate's compiled function traced by dynamo and run without inductor (seconds, not minutes);
    dynamo's caches reset before and after."""
    torch._dynamo.reset()
    compiled = torch.compile(step_module.next_logits, fullgraph=True, backend="eager")
    monkeypatch.setattr(step_module, "_COMPILED", [compiled])
    monkeypatch.setattr(step_module, "_WARNED", [])
    yield compiled
    torch._dynamo.reset()


@pytest.mark.parametrize("encoding", ENCODINGS, ids=str)
def test_each_step_gives_the_logits_of_the_whole_sequence(encoding):
    model = _model(encoding)
    tokens = torch.randint(0, 37, (2, 9))
    cache = posenc.KVCache(max_length=12)
    with torch.no_grad():
        model(tokens[:, :5], cache=cache)
        with cache.fixed_shapes():
            for t in range(5, 9):
                got = model(tokens[:, t : t + 1], cache=cache)[:, -1]
                want = model(tokens[:, : t + 1])[:, -1]  # no cache: the model's own full pass
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert cache.length(0, cross=False) == 9


def test_what_the_fixed_shapes_cannot_serve_is_refused_with_the_reason():
    tokens = torch.randint(0, 37, (1, 4))
    windowed = posenc.TransformerLM(37, 24, 2, 4, pattern="gemma3:window=4", max_len=64).eval()
    with pytest.raises(ValueError, match=r"layer 0: layers with window=4 .*pass compiled=False"):
        windowed.generate(tokens, 3, compiled=True)
    shaw = _model("shaw")
    with pytest.raises(
        ValueError, match=r"'shaw' \(content\) computes logits .*pass compiled=False to decode it eagerly"
    ):
        shaw.generate(tokens, 3, compiled=True)
    with pytest.raises(ValueError, match="use_cache=True"):
        _model("rope").generate(tokens, 3, compiled=True, use_cache=False)


def test_any_number_of_shapes_decodes_without_a_dynamo_error(traced_only):
    """Issue: one process-wide compiled step met torch's recompile limit after 8 distinct (batch,
    prompt length, max_new_tokens) shapes and every later call raised FailOnRecompileLimitHit."""
    model = _model("rope")
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback either: dynamic shapes serve them all
        for i in range(12):
            prompt = torch.randint(0, 37, (1 + i % 3, 3 + i))
            new = 2 + i % 4
            assert torch.equal(model.generate(prompt, new, compiled=True), model.generate(prompt, new))


def test_past_the_recompile_limit_it_warns_once_and_decodes_eagerly(traced_only):
    prompt = torch.randint(0, 37, (2, 5))
    models = [_model(encoding) for encoding in ("rope", "alibi", "sinusoidal")]
    # dynamo's own patch: a monkeypatch of its config module deleted the entry on undo in CI's run,
    # and every later compile in that worker failed on "recompile_limit does not exist"
    with (
        torch._dynamo.config.patch(recompile_limit=1),
        pytest.warns(RuntimeWarning, match="recompile limit") as caught,
    ):
        for model in models:
            assert torch.equal(model.generate(prompt, 4, compiled=True), model.generate(prompt, 4))
    assert len([w for w in caught if "recompile limit" in str(w.message)]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ENCODINGS, ids=str)
def test_compiled_generate_gives_the_eager_tokens_and_compiles_once(encoding):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
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
