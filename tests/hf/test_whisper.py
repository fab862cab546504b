"""posenc's attention in HF's Whisper (an encoder-decoder: encoder self-attention, causal decoder
self-attention with a KV cache, cross-attention on the encoder's keys), on a tiny random Whisper that
went through CTranslate2's form and posenc's converter (tests/_ctranslate2.py).

The reference is the same model under HF's own ``sdpa`` implementation in float64 (and ``eager`` for the
attention weights): logits of a full pass, each forced posenc backend, a left-padded decoder batch, a
plain greedy loop with HF's ``EncoderDecoderCache`` and HF's ``generate()``. A spy counts which
attention calls posenc served, so a Whisper attention that bypassed the bridge fails the tests.
``swap_encoding`` refuses Whisper, naming its absolute position tables.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf  # the posenc.hf seam: CI runs these at both ends of the transformers range

transformers = pytest.importorskip("transformers")

import posenc.hf as posenc_hf  # noqa: E402
from _ctranslate2 import TIMESTAMPS, tiny_vocabulary, tiny_whisper, write_whisper_folder  # noqa: E402
from _hf_models import EXACT  # noqa: E402
from _whisper import ROLES, RoleSpy, greedy  # noqa: E402
from posenc.pretrained.ctranslate2 import convert_whisper  # noqa: E402

VOCAB = tiny_vocabulary()
PROMPT = [VOCAB.index(t) for t in ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")]


@pytest.fixture(autouse=True)
def _registered():
    posenc_hf.register()
    yield
    posenc_hf.register()  # back to the "auto" backend


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The converted HF folder of a tiny random Whisper (weights N(0, 1), seed 2: greedy tokens that vary)."""
    tmp = tmp_path_factory.mktemp("whisper")
    source = write_whisper_folder(tmp / "ct2", tiny_whisper(seed=2, weight_std=1.0))
    convert_whisper(source, tmp / "tiny.hf")
    return tmp / "tiny.hf"


def _load(folder):
    model = transformers.WhisperForConditionalGeneration.from_pretrained(folder, dtype=torch.float64)
    return model.eval()


def _features(model, batch: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    frames = 2 * model.config.max_source_positions
    return torch.randn(batch, model.config.num_mel_bins, frames, generator=generator, dtype=torch.float64)


IDS = torch.tensor([[*PROMPT, 3, 4, 11, 12, 5], [*PROMPT, 13, 7, 0, 1, 2]])


def _forward(model, implementation: str, **kwargs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(input_features=_features(model), decoder_input_ids=IDS, **kwargs)


def test_every_whisper_attention_runs_through_posenc_and_equals_hf_sdpa(folder, monkeypatch):
    model = _load(folder)
    want = _forward(model, "sdpa").logits
    spy = RoleSpy(monkeypatch, model)
    got = _forward(model, posenc_hf.ATTN_IMPLEMENTATION).logits
    torch.testing.assert_close(got, want, **EXACT)
    layers = model.config.encoder_layers
    assert {role: spy.served(role) for role in ROLES} == dict.fromkeys(ROLES, layers)
    gap = (_forward(model, "eager").logits - want).abs().max().item()
    assert gap < 1e-9  # (HF's own eager and sdpa agree to float64 rounding here too)


@pytest.mark.parametrize("backend", ["sdpa", "eager", "blocked", "segments"])
def test_each_posenc_backend_serves_whisper(folder, monkeypatch, backend):
    """Forced in turn: the encoder's non-causal, the decoder's causal and the cross-attention's
    rectangular calls (8 queries on 12 encoder keys) on each backend that runs plain attention."""
    model = _load(folder)
    want = _forward(model, "sdpa").logits
    posenc_hf.register(backend=backend)
    spy = RoleSpy(monkeypatch, model)
    got = _forward(model, posenc_hf.ATTN_IMPLEMENTATION).logits
    torch.testing.assert_close(got, want, **EXACT)
    assert {role for role, name in spy.counts if name == backend} == set(ROLES)
    assert {name for _, name in spy.counts} == {backend}


def test_a_left_padded_decoder_batch_equals_hf_sdpa_at_the_real_tokens(folder):
    model = _load(folder)
    mask = torch.ones_like(IDS)
    mask[1, :3] = 0
    want = _forward(model, "sdpa", decoder_attention_mask=mask).logits
    got = _forward(model, posenc_hf.ATTN_IMPLEMENTATION, decoder_attention_mask=mask).logits
    torch.testing.assert_close(got[0], want[0], **EXACT)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], **EXACT)


def test_attention_weights_equal_hf_eager_s(folder):
    model = _load(folder)
    want = _forward(model, "eager", output_attentions=True)
    got = _forward(model, posenc_hf.ATTN_IMPLEMENTATION, output_attentions=True)
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        for g, w in zip(getattr(got, name), getattr(want, name), strict=True):
            assert g is not None and g.shape == w.shape, name
            torch.testing.assert_close(g, w, **EXACT)


def test_cached_greedy_decoding_equals_hf_sdpa(folder, monkeypatch):
    """A plain greedy loop, one token a step with HF's EncoderDecoderCache: the decoder's cached keys
    and the cross-attention's keys (written once, then handed back each step) through posenc."""
    model = _load(folder)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        encoded = model.model.encoder(_features(model, 1)).last_hidden_state
    want_tokens, want_logits = greedy(model, encoded, PROMPT, 12)
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    spy = RoleSpy(monkeypatch, model)
    tokens, logits = greedy(model, encoded, PROMPT, 12)
    assert tokens == want_tokens
    assert len(set(tokens)) > 1  # (not stuck on one token: that would prove less)
    torch.testing.assert_close(logits, want_logits, **EXACT)
    layers = model.config.decoder_layers
    assert spy.served("decoder self") == spy.served("cross") == 12 * layers
    assert spy.served("encoder self") == 0  # (the encoder ran once, under sdpa, before the loop)


def test_generate_equals_hf_sdpa(folder):
    model = _load(folder)
    features = _features(model)
    # A random model emits timestamp tokens, which HF reads as segments that do not advance (its
    # long-form loop then never ends): they are suppressed here.
    timestamps = [VOCAB.index(t) for t in TIMESTAMPS]
    settings = {
        "language": "en",
        "task": "transcribe",
        "max_new_tokens": 10,
        "return_dict_in_generate": True,
        "suppress_tokens": [*model.generation_config.suppress_tokens, *timestamps],
    }
    model.set_attn_implementation("sdpa")
    want = model.generate(features, **settings).sequences
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    got = model.generate(features, **settings).sequences
    assert torch.equal(got, want) and got[0, :4].tolist() == PROMPT


def test_swap_encoding_refuses_whisper_naming_its_absolute_tables(folder):
    """Whisper has no rotary embedding: its encoder adds a fixed sinusoid, its decoder a learned table,
    both to the input embeddings. swap_encoding cannot take those out, so it refuses, and changes nothing."""
    model = _load(folder)
    model.set_attn_implementation("sdpa")
    tables = r"\(model\.encoder\.embed_positions, model\.decoder\.embed_positions\)"
    with pytest.raises(
        ValueError,
        match=rf"WhisperForConditionalGeneration is not a Llama-family .*absolute tables.*{tables}",
    ):
        posenc_hf.swap_encoding(model, "rope")
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(module, "posenc_encoding") for module in model.modules())
