"""CTranslate2 files (posenc.pretrained.ctranslate2): the reader on files written in tmp by the test's own
writer (tests/_ctranslate2.py, from the format's description), every refusal naming the file, and a tiny
random HF Whisper put into CTranslate2's form and converted back: the converted model's logits equal
the original's, bit for bit (float32 weights) or the original's with its weights rounded to float16."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest
import torch

from _ctranslate2 import (
    SPECIALS,
    TIMESTAMPS,
    ct2_bytes,
    tiny_vocabulary,
    tiny_whisper,
    whisper_variables,
    write_side_files,
    write_whisper_folder,
)
from posenc.pretrained import ctranslate2 as ct2

# ------------------------------------------------------------------------------------------- reader


def _write(tmp_path, data: bytes, name: str = "model.bin"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _sample() -> dict[str, tuple[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return {
        "a/weight": ("float32", rng.standard_normal((3, 4)).astype(np.float32)),
        "a/half": ("float16", rng.standard_normal((2, 5)).astype(np.float16)),
        "b/int8": ("int8", np.array([[-128, 0, 127]], dtype=np.int8)),
        "b/int16": ("int16", np.array([-3, 30000], dtype=np.int16)),
        "b/int32": ("int32", np.arange(6, dtype=np.int32).reshape(1, 2, 3) - 2**30),
        "c/num_heads": ("int16", np.array(8, dtype=np.int16)),
        "c/flag": ("int8", np.array(1, dtype=np.int8)),
        "c/bf16": ("bfloat16", np.array([1.0, -2.5, 3.140625, 2.0**100], dtype=np.float32)),
        "empty": ("float32", np.zeros((0, 4), dtype=np.float32)),
    }


def test_reads_every_dtype_scalars_and_aliases(tmp_path):
    sample = _sample()
    path = _write(tmp_path, ct2_bytes(sample, {"d/tied": "a/weight"}, spec="TransformerSpec", revision=7))
    spec, revision, variables, aliases = ct2.read_ctranslate2(path)
    assert (spec, revision, aliases) == ("TransformerSpec", 7, {"d/tied": "a/weight"})
    assert list(variables) == list(sample)
    for name, (dtype, want) in sample.items():
        got = variables[name]
        assert got.shape == want.shape, name
        if dtype == "bfloat16":  # widened to float32; these values are exact in bfloat16
            assert got.dtype == np.float32
        else:
            assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want)
    assert variables["c/num_heads"].shape == () and int(variables["c/num_heads"]) == 8


def test_bfloat16_keeps_the_high_half_of_float32(tmp_path):
    values = np.array([1.0 + 2**-7, 1.0 + 2**-9, -0.1], dtype=np.float32)  # 2**-9 is below bf16's step
    model = ct2.read_ctranslate2(_write(tmp_path, ct2_bytes({"x": ("bfloat16", values)})))
    truncated = (values.view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(model.variables["x"], truncated)


def test_the_tuple_is_a_named_tuple(tmp_path):
    model = ct2.read_ctranslate2(_write(tmp_path, ct2_bytes(_sample())))
    assert model.spec == "WhisperSpec" and model.revision == 3 and model.aliases == {}


@pytest.mark.parametrize(
    "data,match",
    [
        (b"", r"not a CTranslate2 model file: it has 0 bytes"),
        (b"\x06\x00", r"not a CTranslate2 model file: it has 2 bytes"),
        (
            b"GGUF\x03\x00\x00\x00" + b"\0" * 32,
            r"not a CTranslate2 model file: it starts with bytes 47 47 55 46",
        ),
        (struct.pack("<I", 6) + struct.pack("<H", 4) + b"\xff\xfe\x00\x01", r"not UTF-8"),
        (
            struct.pack("<I", 6) + struct.pack("<H", 4) + b"a b\0",
            r"not a CTranslate2 model file: the spec name",
        ),
    ],
)
def test_a_file_that_is_no_ctranslate2_model_is_refused_naming_it(tmp_path, data, match):
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=match) as raised:
        ct2.read_ctranslate2(path)
    assert str(path) in str(raised.value)


@pytest.mark.parametrize("version", [5, 1, 7])
def test_another_format_version_is_refused_naming_it(tmp_path, version):
    path = _write(tmp_path, ct2_bytes(_sample(), version=version))
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(str(path))}: CTranslate2 format version {version}; posenc reads version 6",
    ):
        ct2.read_ctranslate2(path)


def test_a_file_cut_anywhere_is_refused_as_truncated(tmp_path):
    whole = ct2_bytes(_sample(), {"d/tied": "a/weight"})
    # Every cut point in the header, inside a name, a shape, the data, and the aliases.
    for cut in range(4, len(whole)):
        path = _write(tmp_path, whole[:cut])
        with pytest.raises(
            ValueError, match=r"truncated CTranslate2 file: .* needs \d+ bytes at offset"
        ) as raised:
            ct2.read_ctranslate2(path)
        message = str(raised.value)
        assert str(path) in message and f"the file has {cut} bytes" in message and "fetch it again" in message


def test_a_byte_count_that_does_not_fit_the_shape_is_refused(tmp_path):
    good = ct2_bytes({"x": ("float32", np.zeros((2, 3), np.float32))})
    at = good.index(struct.pack("<I", 24))  # the byte count of 2 x 3 float32
    bad = good[:at] + struct.pack("<I", 20) + good[at + 4 : -4 - 4] + struct.pack("<I", 0)
    with pytest.raises(
        ValueError, match=r"'x' \(float32, shape \[2, 3\]\) states 20 bytes, but that shape holds 24"
    ):
        ct2.read_ctranslate2(_write(tmp_path, bad))


def test_an_unknown_dtype_code_is_refused_naming_the_variable(tmp_path):
    good = bytearray(ct2_bytes({"x": ("float32", np.zeros(2, np.float32))}))
    dims_end = good.index(b"x\0") + 2 + 1 + 4  # name, rank, one dim
    good[dims_end] = 9
    with pytest.raises(ValueError, match=r"variable 'x' has dtype code 9; CTranslate2's codes are 0 float32"):
        ct2.read_ctranslate2(_write(tmp_path, bytes(good)))


def test_bytes_after_the_aliases_and_an_alias_to_nothing_are_refused(tmp_path):
    whole = ct2_bytes(_sample())
    with pytest.raises(ValueError, match=r"3 bytes follow the aliases"):
        ct2.read_ctranslate2(_write(tmp_path, whole + b"abc"))
    with pytest.raises(ValueError, match=r"alias 'p' names 'nothing', which the file does not hold"):
        ct2.read_ctranslate2(_write(tmp_path, ct2_bytes(_sample(), {"p": "nothing"})))


def test_an_absent_file_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        ct2.read_ctranslate2(tmp_path / "model.bin")


# ---------------------------------------------------------------------------------------- converter

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny():
    return tiny_whisper()


def _features(model, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    frames = 2 * model.config.max_source_positions
    return torch.randn(2, model.config.num_mel_bins, frames, generator=generator)


def _logits(model, features, ids) -> torch.Tensor:
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        return model(input_features=features, decoder_input_ids=ids).logits


IDS = torch.tensor([[15, 16, 19, 23, 3, 4, 11, 12], [15, 17, 19, 23, 13, 7, 0, 1]])


def test_a_tiny_whisper_through_ctranslate2_form_gives_the_same_logits(tmp_path, tiny):
    source = write_whisper_folder(tmp_path / "ct2", tiny)
    out = tmp_path / "models" / "tiny.hf"
    lines: list[str] = []
    ct2.convert_whisper(source, out, log=lines.append)
    assert lines[-1].startswith("whisper: converted in") and str(out) in lines[-1]
    converted = transformers.WhisperForConditionalGeneration.from_pretrained(out).eval()
    assert next(converted.parameters()).dtype == torch.float32
    for name, want in tiny.state_dict().items():  # every weight, the k_proj's missing bias included
        torch.testing.assert_close(converted.state_dict()[name], want, rtol=0, atol=0, msg=name)
    assert converted.proj_out.weight.data_ptr() == converted.model.decoder.embed_tokens.weight.data_ptr()
    features = _features(tiny)
    assert torch.equal(_logits(converted, features, IDS), _logits(tiny, features, IDS))
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_float16_weights_give_the_original_with_its_weights_rounded_to_float16(tmp_path, tiny):
    source = write_whisper_folder(tmp_path / "ct2", tiny, dtype="float16")
    ct2.convert_whisper(source, tmp_path / "tiny.hf")
    converted = transformers.WhisperForConditionalGeneration.from_pretrained(tmp_path / "tiny.hf").eval()
    rounded = tiny_whisper()
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.half().float())
    features = _features(tiny)
    assert torch.equal(_logits(converted, features, IDS), _logits(rounded, features, IDS))
    assert not torch.equal(_logits(converted, features, IDS), _logits(tiny, features, IDS))


def test_the_config_and_generation_config_come_from_the_shapes_and_the_side_files(tmp_path, tiny):
    ct2.convert_whisper(write_whisper_folder(tmp_path / "ct2", tiny), tmp_path / "tiny.hf")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "tiny.hf")
    want = tiny.config
    for key in (
        "vocab_size",
        "num_mel_bins",
        "d_model",
        "encoder_layers",
        "decoder_layers",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "max_source_positions",
        "max_target_positions",
        "activation_function",
        "scale_embedding",
    ):
        assert getattr(config, key) == getattr(want, key), key
    vocab = tiny_vocabulary()
    assert config.decoder_start_token_id == vocab.index("<|startoftranscript|>")
    assert config.eos_token_id == config.pad_token_id == vocab.index("<|endoftext|>")
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "tiny.hf")
    assert generation.suppress_tokens == [2, 5]
    assert generation.begin_suppress_tokens == [10, vocab.index("<|endoftext|>")]
    assert generation.lang_to_id == {"<|en|>": vocab.index("<|en|>"), "<|de|>": vocab.index("<|de|>")}
    assert generation.task_to_id == {
        "transcribe": vocab.index("<|transcribe|>"),
        "translate": vocab.index("<|translate|>"),
    }
    assert generation.no_timestamps_token_id == vocab.index("<|notimestamps|>")
    assert generation.is_multilingual and generation.max_length == want.max_target_positions
    assert generation.alignment_heads == [[1, 0], [1, 3]]
    extractor = transformers.AutoFeatureExtractor.from_pretrained(tmp_path / "tiny.hf")
    assert type(extractor).__name__ == "WhisperFeatureExtractor" and extractor.feature_size == 8


def test_generate_runs_on_the_generation_config_it_writes(tmp_path, tiny):
    """HF's Whisper generate() reads the language and task tokens and the no-timestamps token."""
    ct2.convert_whisper(write_whisper_folder(tmp_path / "ct2", tiny), tmp_path / "tiny.hf")
    converted = transformers.WhisperForConditionalGeneration.from_pretrained(tmp_path / "tiny.hf").eval()
    vocab = tiny_vocabulary()
    # (a random model may emit timestamps, which HF's loop reads as segments that never advance)
    suppress = [*converted.generation_config.suppress_tokens, *(vocab.index(t) for t in TIMESTAMPS)]
    out = converted.generate(
        _features(tiny)[:1],
        language="de",
        task="transcribe",
        max_new_tokens=5,
        return_dict_in_generate=True,
        suppress_tokens=suppress,
    ).sequences
    prompt = [
        vocab.index(t) for t in ("<|startoftranscript|>", "<|de|>", "<|transcribe|>", "<|notimestamps|>")
    ]
    assert out[0, :4].tolist() == prompt and out.shape[1] == 9


def test_the_tokenizer_loads_and_covers_every_id(tmp_path, tiny):
    from tokenizers import Tokenizer

    source = write_whisper_folder(tmp_path / "ct2", tiny)
    ct2.convert_whisper(source, tmp_path / "tiny.hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tiny.hf")
    vocab = tiny_vocabulary()
    assert type(tokenizer).__name__ == "WhisperTokenizer" and len(tokenizer) == len(vocab)
    assert tokenizer.convert_ids_to_tokens(list(range(len(vocab)))) == vocab
    assert tokenizer.convert_tokens_to_ids(TIMESTAMPS) == [vocab.index(t) for t in TIMESTAMPS]
    # The source tokenizer.json, read by the tokenizers library itself, is the reference.
    reference = Tokenizer.from_file(str(source / "tokenizer.json"))
    text = "hello world"
    assert (
        tokenizer(text, add_special_tokens=False).input_ids
        == reference.encode(text, add_special_tokens=False).ids
    )
    assert tokenizer.decode(reference.encode(text, add_special_tokens=False).ids) == text
    assert set(SPECIALS) <= set(tokenizer.all_special_tokens)
    hello = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode([vocab.index("<|startoftranscript|>"), *hello], skip_special_tokens=True) == text


def test_a_missing_side_file_is_named(tmp_path, tiny):
    source = write_whisper_folder(tmp_path / "ct2", tiny)
    for name in ct2.WHISPER_FILES:
        kept = (source / name).read_bytes()
        (source / name).unlink()
        with pytest.raises(
            FileNotFoundError,
            match=rf"{re.escape(str(source))}: no {re.escape(name)} in the folder; a CTranslate2 Whisper",
        ):
            ct2.convert_whisper(source, tmp_path / "out")
        (source / name).write_bytes(kept)
    (source / "config.json").unlink()
    (source / "vocabulary.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json, vocabulary\.txt in the folder"):
        ct2.convert_whisper(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_spec_other_than_whisper_is_refused_naming_the_file(tmp_path, tiny):
    source = tmp_path / "ct2"
    write_side_files(source)
    variables, aliases = whisper_variables(tiny)
    (source / "model.bin").write_bytes(ct2_bytes(variables, aliases, spec="TransformerSpec", revision=7))
    with pytest.raises(
        ValueError,
        match=r"model.bin: a CTranslate2 TransformerSpec \(revision 7\); convert_whisper reads a WhisperSpec",
    ):
        ct2.convert_whisper(source, tmp_path / "out")


def test_a_truncated_or_old_model_bin_is_refused_before_anything_is_written(tmp_path, tiny):
    source = write_whisper_folder(tmp_path / "ct2", tiny)
    whole = (source / "model.bin").read_bytes()
    (source / "model.bin").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="truncated CTranslate2 file"):
        ct2.convert_whisper(source, tmp_path / "models" / "out")
    (source / "model.bin").write_bytes(struct.pack("<I", 5) + whole[4:])
    with pytest.raises(ValueError, match="format version 5"):
        ct2.convert_whisper(source, tmp_path / "models" / "out")
    assert not (tmp_path / "models").exists() or list((tmp_path / "models").iterdir()) == []


def test_a_missing_variable_is_named(tmp_path, tiny):
    source = tmp_path / "ct2"
    write_side_files(source)
    variables, aliases = whisper_variables(tiny)
    del variables["decoder/layer_1/attention/linear_1/weight"]
    (source / "model.bin").write_bytes(ct2_bytes(variables, aliases))
    with pytest.raises(
        ValueError, match=r"no variable 'decoder/layer_1/attention/linear_1/weight' in this WhisperSpec"
    ):
        ct2.convert_whisper(source, tmp_path / "out")


def test_side_files_of_another_model_are_refused_naming_them(tmp_path, tiny):
    source = write_whisper_folder(tmp_path / "ct2", tiny)
    vocab = tiny_vocabulary()
    (source / "vocabulary.txt").write_text("\n".join(vocab[:-1]) + "\n")
    with pytest.raises(
        ValueError, match=r"vocabulary.txt: 26 tokens, but decoder/embeddings/weight has 27 rows"
    ):
        ct2.convert_whisper(source, tmp_path / "out")
    swapped = [vocab[1], vocab[0], *vocab[2:]]
    (source / "vocabulary.txt").write_text("\n".join(swapped) + "\n")
    with pytest.raises(
        ValueError, match=r"tokenizer.json and .*vocabulary.txt disagree at id 0 \('a' against 'b'\)"
    ):
        ct2.convert_whisper(source, tmp_path / "out")
    (source / "vocabulary.txt").write_text("\n".join(vocab) + "\n")
    (source / "config.json").write_text(json.dumps({"lang_ids": []}))
    with pytest.raises(ValueError, match=r"config.json: no 'suppress_ids'"):
        ct2.convert_whisper(source, tmp_path / "out")
    (source / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not JSON"):
        ct2.convert_whisper(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_output_folder_appears_whole_or_not_at_all(tmp_path, tiny, monkeypatch):
    """A failure while writing leaves nothing behind (no half folder, no scratch); an existing folder
    is kept as it was on failure and replaced whole on success."""
    source = write_whisper_folder(tmp_path / "ct2", tiny)
    models = tmp_path / "models"
    out = models / "tiny.hf"

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(ct2, "_write_tokenizer", fail)  # after the weights are written
        with pytest.raises(RuntimeError, match="disk full"):
            ct2.convert_whisper(source, out)
    assert list(models.iterdir()) == []

    out.mkdir()
    (out / "stale.txt").write_text("from before")
    with monkeypatch.context() as patch:
        patch.setattr(ct2, "_write_tokenizer", fail)
        with pytest.raises(RuntimeError, match="disk full"):
            ct2.convert_whisper(source, out)
    assert [p.name for p in models.iterdir()] == ["tiny.hf"] and [p.name for p in out.iterdir()] == [
        "stale.txt"
    ]

    ct2.convert_whisper(source, out)
    assert [p.name for p in models.iterdir()] == ["tiny.hf"]
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode


@pytest.mark.parametrize(
    ("lang_ids", "shown"),
    [(["en", 3], "'en'"), ([2.5], "2.5"), ([10_000], "10000"), ([True], "True"), ("3", "'3'")],
)
def test_token_ids_that_are_not_whole_ids_in_the_vocabulary_are_named(tmp_path, tiny, lang_ids, shown):
    """Issue 62 item 6: Python's own int() message came out, naming neither the file nor the field."""
    source = write_whisper_folder(tmp_path / "ct2", tiny)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "lang_ids": lang_ids}))
    with pytest.raises(
        ValueError,
        match=rf"config.json: lang_ids holds {re.escape(shown)}; it must be a list of whole token ids in \[0, 27\)",
    ):
        ct2.convert_whisper(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_vocabulary_that_is_not_utf8_is_named(tmp_path, tiny):
    source = write_whisper_folder(tmp_path / "ct2", tiny)
    (source / "vocabulary.txt").write_bytes(b"a\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"vocabulary.txt: not UTF-8 text \(byte 2: invalid start byte\)"):
        ct2.convert_whisper(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_killed_conversions_scratch_is_removed_by_the_next(tmp_path, tiny):
    """Issue 62 item 2 for convert_whisper: its scratch folder beside the output, left by a killed run."""
    import socket
    import subprocess
    import sys

    from posenc.pretrained.catalog import OWNER_FILE

    source = write_whisper_folder(tmp_path / "ct2", tiny)
    out = tmp_path / "models" / "tiny.hf"
    out.parent.mkdir(parents=True)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    left = out.parent / ".tiny.hf-killed"
    left.mkdir()
    (left / OWNER_FILE).write_text(f"{dead.stdout.strip()} {socket.gethostname()}\n")
    lines: list[str] = []
    ct2.convert_whisper(source, out, log=lines.append)
    assert not left.exists() and f"removed {left}: the scratch folder of a run that was killed" in lines
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.hf"] and not (out / OWNER_FILE).exists()
