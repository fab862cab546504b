"""``posenc inspect MODEL`` (``posenc.cli.inspection``): the summary and the folder it writes, and each
kind of bad input refused with a message naming the file and what was expected (exit 2; 1 for a
model that is not fetched or a failure while writing), no traceback, nothing left in ``--out``."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from typer.testing import CliRunner

from _inspect_models import BUILDERS
from posenc.cli.app import app, load_command_modules
from posenc.pretrained.loading import WEIGHT_FILES

load_command_modules()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    @cache
    def make(name: str) -> Path:
        return BUILDERS[name](tmp_path_factory.mktemp(name) / name)

    return make


def _invoke(*args: str):
    return CliRunner().invoke(app, ["inspect", *args])


def _refused(result, code: int, *needles: str) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    flat = " ".join(result.output.split())
    for needle in needles:
        assert needle in flat, (needle, result.output)


def _left_in(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir()) if parent.exists() else []


def test_inspect_writes_the_folder_and_prints_the_summary(folder, tmp_path):
    out = tmp_path / "pages" / "gemma"
    result = _invoke(str(folder("gemma3")), "--out", str(out), "--tokens", "24")
    assert result.exit_code == 0, result.output
    assert "sliding_attention" in result.output and "RoPE" in result.output
    assert "config and weights agree" in result.output
    assert f"wrote {out / 'index.html'}" in " ".join(result.output.split())
    assert sorted(p.name for p in out.iterdir()) == ["figures", "index.html", "inspect.json"]
    numbers = json.loads((out / "inspect.json").read_text())
    assert numbers["rotary"][0]["tokens"] == 24 and numbers["command"].endswith("--tokens 24")
    assert _left_in(out.parent) == ["gemma"]  # no temporary folder left beside it


def test_the_default_folder_is_under_runs_inspect(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _invoke(str(folder("bert")))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "runs" / "inspect" / "bert" / "index.html").is_file()


def test_a_previous_inspect_folder_is_replaced_whole_and_any_other_refused(folder, tmp_path):
    out = tmp_path / "out"
    assert _invoke(str(folder("bert")), "--out", str(out)).exit_code == 0
    (out / "stale.txt").write_text("from before")
    assert _invoke(str(folder("mpnet")), "--out", str(out)).exit_code == 0
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "inspect.json").read_text())["model_type"] == "mpnet"
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    _refused(
        _invoke(str(folder("bert")), "--out", str(other)), 2, f"--out {other}", "not a posenc inspect folder"
    )
    assert _left_in(other) == ["notes.txt"]


def test_a_failure_while_writing_leaves_nothing(folder, tmp_path, monkeypatch):
    from posenc.viz.inspection import page

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(page, "render_page", broken)
    _refused(_invoke(str(folder("bert")), "--out", str(tmp_path / "out")), 1, "disk full")
    assert _left_in(tmp_path) == []


def _folder_with(tmp_path: Path, config: str | None, weights: bool) -> Path:
    bad = tmp_path / "bad"
    bad.mkdir()
    if config is not None:
        (bad / "config.json").write_text(config)
    if weights:
        (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return bad


BAD_FOLDERS = {
    "no config.json": (None, True, ["no config.json in the folder", "expected an HF model folder"]),
    "unreadable json": (
        '{"model_type": "llama",',
        True,
        ["config.json: not readable JSON", "expected the HF config"],
    ),
    "no model_type": ('{"hidden_size": 4}', True, ["names no model_type"]),
    "unknown architecture": ('{"model_type": "no-such-arch"}', True, ["'no-such-arch'", "does not know"]),
    "no weights": ('{"model_type": "llama"}', False, ["a config.json but no weights", *WEIGHT_FILES]),
    # Issue 62 items 4 and 5: configs HF refuses (or takes in silence), each named by its field.
    "no heads": (
        '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 0}',
        True,
        ["num_attention_heads 0", "at least 1 attention head"],
    ),
    "heads that do not split the width": (
        '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 3}',
        True,
        ["hidden_size 64 is not a multiple of num_attention_heads 3"],
    ),
    "an unknown rope_type": (
        '{"model_type": "llama", "rope_parameters": {"rope_type": "bogus", "rope_theta": 10000.0}}',
        True,
        ["rope_parameters.rope_type 'bogus' is no RoPE type"],
    ),
    "a per-type unknown rope_type": (
        '{"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "bogus"}, '
        '"sliding_attention": {"rope_type": "default"}}}',
        True,
        ["rope_parameters['full_attention'].rope_type 'bogus'"],
    ),
    "no context": (
        '{"model_type": "llama", "max_position_embeddings": 0}',
        True,
        ["max_position_embeddings 0: a context below 1 position"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_a_broken_folder_is_refused_by_name(case, tmp_path):
    config, weights, needles = BAD_FOLDERS[case]
    bad = _folder_with(tmp_path, config, weights)
    out = tmp_path / "out"
    _refused(_invoke(str(bad), "--out", str(out)), 2, str(bad), *needles)
    assert not out.exists()


def test_torn_weights_are_refused_naming_the_file(folder, tmp_path):
    import shutil

    torn = tmp_path / "torn"
    shutil.copytree(folder("bert"), torn)
    data = (torn / "model.safetensors").read_bytes()
    (torn / "model.safetensors").write_bytes(data[: len(data) // 3])
    _refused(
        _invoke(str(torn), "--out", str(tmp_path / "out")),
        2,
        str(torn / "model.safetensors"),
        "cannot be read",
    )
    assert not (tmp_path / "out").exists()


def test_files_that_are_not_models_are_refused(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    _refused(_invoke(str(text)), 2, str(text), "not a model", "GGUF", "an HF folder")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + b"\x00" * 20)
    _refused(_invoke(str(fake)), 2, str(fake), "GGUF file whose metadata cannot be read")
    _refused(_invoke(str(tmp_path / "nowhere")), 2, "no such file or folder", "fetched model")


def test_a_gguf_of_an_architecture_transformers_cannot_load_is_refused(tmp_path):
    from _gguf_fixtures import unloadable_gguf

    path = unloadable_gguf(tmp_path)
    _refused(
        _invoke(str(path), "--out", str(tmp_path / "out")), 2, str(path), "'rwkv6'", "cannot load from GGUF"
    )
    assert not (tmp_path / "out").exists()


def test_a_model_without_any_encoding_inspect_reads_is_refused(tmp_path):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=1)
    transformers.MambaModel(config).save_pretrained(tmp_path / "mamba")
    _refused(_invoke(str(tmp_path / "mamba")), 2, "model_type 'mamba'", "hold none of the position encodings")


def test_a_fetched_name_that_is_not_fetched_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("POSENC_MODELS", str(tmp_path / "models"))
    _refused(_invoke("smollm2-135m"), 1, "smollm2-135m is not fetched", "posenc models fetch smollm2-135m")


def test_tokens_below_two_are_refused():
    result = _invoke("anything", "--tokens", "1")
    assert result.exit_code == 2 and "--tokens" in result.output
