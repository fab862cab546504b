"""posenc on trained Whisper weights: whisper-base, a CTranslate2 model converted by
``posenc.pretrained.ctranslate2.convert_whisper`` (marker ``real``).

* The encoder's stored position table is posenc's ``sinusoidal:layout=concat,step=whisper`` rounded to
  float16, every entry (docs/conventions.md §2.1).
* The converted HF model is CTranslate2's model: its greedy tokens on synthetic audio are the ones
  CTranslate2 4.8.5 decodes from the same file (recorded here), and where ``ctranslate2`` is installed
  its encoder output and logits are compared with CTranslate2's own.
* Through ``attn_implementation="posenc"`` (encoder self-attention, the decoder's causal self-attention
  with HF's cache, the cross-attention), logits equal HF's and a plain greedy loop picks the same 20
  tokens; ``generate()`` too. Tolerance (float32), as tests/test_real_models.py: posenc may differ from
  HF sdpa by at most ``4 x`` HF eager's own distance from HF sdpa on the same input, plus 1e-5.

The audio: three sine tones (220, 440, 660 Hz, 5 s) through the converted folder's
``WhisperFeatureExtractor``. The model: ``posenc models fetch whisper-base`` (into ``$POSENC_MODELS``),
converted once by ``posenc.pretrained.loading.convert``; absent, these tests skip with that command, and
fail under ``POSENC_REQUIRE_REAL=1`` (CI).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.real

transformers = pytest.importorskip("transformers")

from _whisper import ROLES, RoleSpy, greedy  # noqa: E402

#: CI sets it: a missing model fails the tests instead of skipping them.
REQUIRE_REAL = os.environ.get("POSENC_REQUIRE_REAL") == "1"
NAME = "whisper-base"
#: <|startoftranscript|><|en|><|transcribe|><|notimestamps|>
PROMPT_TOKENS = ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")
#: CTranslate2 4.8.5's greedy decoding of the tones from this model.bin (beam 1, nothing suppressed):
#: " [Music]" and the end token.
CT2_TOKENS = [542, 8710, 60, 50257]


def _whisper_folder() -> Path:
    """The fetched CTranslate2 whisper-base folder (model.bin, config.json, tokenizer.json, vocabulary.txt)."""
    from posenc.pretrained.loading import fetch_command, model_path

    try:
        return model_path(NAME)
    except FileNotFoundError as err:
        if REQUIRE_REAL:
            pytest.fail(f"POSENC_REQUIRE_REAL=1 but {err}")
        pytest.skip(f"{NAME} is not fetched: run `{fetch_command([NAME])}`")


@pytest.fixture(scope="module")
def hf_folder() -> Path:
    """The converted HF folder (``posenc.pretrained.loading.convert``: once, beside the fetched model)."""
    from posenc.pretrained.loading import convert

    _whisper_folder()
    return convert(NAME)


def _model(folder: Path):
    model = transformers.WhisperForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def model(hf_folder):
    return _model(hf_folder)


@pytest.fixture(scope="module")
def features(hf_folder) -> torch.Tensor:
    """The log-mel of three sine tones, ``[1, 80, 3000]``."""
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(hf_folder)
    t = np.arange(16000 * 5) / 16000
    audio = sum(0.2 * np.sin(2 * np.pi * f * t) for f in (220, 440, 660)).astype(np.float32)
    return torch.from_numpy(extractor(audio, sampling_rate=16000, return_tensors="np").input_features)


@pytest.fixture(scope="module")
def prompt(hf_folder) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_folder)
    return tokenizer.convert_tokens_to_ids(list(PROMPT_TOKENS))


@pytest.fixture(autouse=True)
def _registered():
    import posenc.hf

    posenc.hf.register()
    yield
    posenc.hf.register()


def _logits(model, implementation: str, features, ids) -> torch.Tensor:
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(input_features=features, decoder_input_ids=ids).logits


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_the_stored_encoder_table_is_posenc_sinusoidal_whisper_in_float16():
    from posenc import functional as F
    from posenc.pretrained.ctranslate2 import read_ctranslate2

    stored = read_ctranslate2(_whisper_folder() / "model.bin").variables[
        "encoder/position_encodings/encodings"
    ]
    assert stored.dtype == np.float16 and stored.shape == (1500, 512)
    table = F.sinusoidal(torch.arange(1500), 512, layout="concat", step="whisper")
    assert torch.equal(table.half(), torch.from_numpy(stored.copy()))
    paper = F.sinusoidal(torch.arange(1500), 512, layout="concat")
    assert _max_diff(paper, torch.from_numpy(stored.astype(np.float32))) > 1  # the step is what matters


def test_the_converted_model_decodes_what_ctranslate2_decodes(model, features, prompt):
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        encoded = model.model.encoder(features).last_hidden_state
    tokens, _ = greedy(model, encoded, prompt, len(CT2_TOKENS))
    assert tokens == CT2_TOKENS


def test_the_converted_model_equals_ctranslate2_s_own_run(model, features, prompt):
    """CTranslate2's own kernels on the same file: float32 reduction orders differ over 6 + 6 layers,
    so each output is held to 1e-4 of its largest magnitude (measured: 1.7e-5 encoder, 7.8e-7 logits)."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    engine = ctranslate2.models.Whisper(
        str(_whisper_folder()), device="cpu", compute_type="float32", intra_threads=1
    )
    view = ctranslate2.StorageView.from_array(np.ascontiguousarray(features.numpy()))
    theirs = torch.from_numpy(np.array(engine.encode(view, to_cpu=True)))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ours = model.model.encoder(features).last_hidden_state
    assert _max_diff(ours, theirs) <= 1e-4 * ours.abs().max().item()
    result = engine.generate(
        view,
        [prompt],
        beam_size=1,
        max_length=24,
        suppress_blank=False,
        suppress_tokens=[],
        return_logits_vocab=True,
    )[0]
    assert result.sequences_ids[0] + [CT2_TOKENS[-1]] == CT2_TOKENS
    steps = torch.from_numpy(np.stack([np.array(step) for step in result.logits[0]])).reshape(
        len(CT2_TOKENS), -1
    )
    ids = torch.tensor([prompt + CT2_TOKENS[:-1]])
    logits = _logits(model, "sdpa", features, ids)[0, len(prompt) - 1 :]
    assert _max_diff(logits, steps) <= 1e-4 * logits.abs().max().item()


def test_posenc_logits_equal_hf_on_every_whisper_attention(model, features, prompt, monkeypatch):
    ids = torch.tensor([prompt + CT2_TOKENS[:-1] * 3])
    sdpa = _logits(model, "sdpa", features, ids)
    gap = _max_diff(_logits(model, "eager", features, ids), sdpa)
    spy = RoleSpy(monkeypatch, model)
    try:
        got = _logits(model, "posenc", features, ids)
    finally:
        spy.remove()
    assert _max_diff(got, sdpa) <= 4 * gap + 1e-5
    assert {role: spy.served(role) for role in ROLES} == dict.fromkeys(ROLES, 6)


@pytest.mark.parametrize("backend", ["sdpa", "eager", "blocked", "segments"])
def test_each_backend_serves_whisper_base(model, features, prompt, backend):
    """Forced in turn, on the 1500-token encoder, the decoder and the 1500-key cross-attention."""
    import posenc.hf

    ids = torch.tensor([prompt + CT2_TOKENS[:-1]])
    sdpa = _logits(model, "sdpa", features, ids)
    gap = _max_diff(_logits(model, "eager", features, ids), sdpa)
    posenc.hf.register(backend=backend)
    got = _logits(model, "posenc", features, ids)
    assert _max_diff(got, sdpa) <= (1e-5 if backend == "sdpa" else 4 * gap + 1e-5)


def test_cached_greedy_tokens_equal_hf(model, features, prompt, monkeypatch):
    """20 tokens, one a step with HF's cache; the end and timestamp tokens are never chosen, so all 20
    are text (" [Music]" repeated)."""
    never = tuple(range(CT2_TOKENS[-1], model.config.vocab_size))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        encoded = model.model.encoder(features).last_hidden_state
    want, want_logits = greedy(model, encoded, prompt, 20, never)
    model.set_attn_implementation("eager")
    _, eager_logits = greedy(model, encoded, prompt, 20, never)
    model.set_attn_implementation("posenc")
    spy = RoleSpy(monkeypatch, model)
    try:
        got, got_logits = greedy(model, encoded, prompt, 20, never)
    finally:
        spy.remove()
    assert got == want and got[:3] == CT2_TOKENS[:3]
    assert _max_diff(got_logits, want_logits) <= 4 * _max_diff(eager_logits, want_logits) + 1e-5
    assert spy.served("decoder self") == spy.served("cross") == 20 * 6


def test_generate_through_posenc_equals_hf(model, features):
    settings = {"language": "en", "task": "transcribe", "max_new_tokens": 20, "return_dict_in_generate": True}
    model.set_attn_implementation("sdpa")
    want = model.generate(features, **settings).sequences
    model.set_attn_implementation("posenc")
    assert torch.equal(model.generate(features, **settings).sequences, want)


def test_swap_encoding_refuses_whisper_base(hf_folder):
    import posenc.hf

    with pytest.raises(ValueError, match=r"absolute tables .*model\.decoder\.embed_positions"):
        posenc.hf.swap_encoding(_model(hf_folder), "alibi")
