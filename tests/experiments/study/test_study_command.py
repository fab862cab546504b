"""``posenc study MODEL`` (posenc.cli.study, posenc.experiments.study.config; issue 58, item 1): the study in
its own words on a tiny random Llama (windows apart from trials, the verdict printed first, the
command a report shows planning the same study again), a hub id read from HF's cache offline, and
``extrapolate --hf-model`` still running the study with a message naming the new command."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from _tiny_hf import TEXT, save_tiny_llama  # noqa: E402
from posenc.cli.app import app, load_command_modules  # noqa: E402
from posenc.experiments.study.plan import study_command  # noqa: E402

CONTEXT = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", CONTEXT)


def _invoke(*args):
    load_command_modules()
    return CliRunner().invoke(app, [str(a) for a in args])


def test_the_study_command_runs_windows_apart_from_trials_and_prints_the_verdict_first(model_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 40)
    out = tmp_path / "study"
    result = _invoke(
        "study", model_dir, "--tasks", "text", "--variants", "none,yarn", "--windows", 2, "--trials", 3,
        "--lengths", 100, "--depths", "0.5", "--corpus", corpus, "--no-progress", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "paired verdict" in result.output
    assert result.output.index("paired verdict") < result.output.index("perplexity by position")
    settings = json.loads((out / "config.json").read_text())["experiment"]
    assert settings["eval_examples"] == 2 and settings["trials"] == 3
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    cells = [c for r in records if r["metric"] == "exact_match" for c in r["by_depth"]]
    assert cells and all(len(c["outcomes"]) == 3 for c in cells)
    assert {r["examples"] for r in records if r["metric"] == "perplexity"} == {2}
    assert (out / "comparisons.jsonl").is_file()
    # The command a report shows plans the same study.
    words = shlex.split(study_command(settings, tmp_path / "again"))
    assert words[:3] == ["posenc", "study", str(model_dir)]
    again = _invoke(*words[1:], "--no-progress")
    assert again.exit_code == 0, again.output
    assert json.loads((tmp_path / "again" / "config.json").read_text())["experiment"] == settings


def test_bad_options_are_refused_by_name_before_anything_is_written(model_dir, tmp_path):
    for args, message in (
        (["--variants", "longrope9"], "--variants 'longrope9'"),
        (["--tasks", "lm"], "--tasks"),
        (["--lengths", "a,b"], "--lengths 'a,b'"),
        (["--dtype", "int8"], "--dtype 'int8'"),
        (["--variants", "none,rerope:window=16|32"], "give --tuning-windows K"),
    ):
        result = _invoke("study", model_dir, *args, "--out", tmp_path / "x", "--no-progress")
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert not (tmp_path / "x").exists()


def test_extrapolate_hf_model_still_runs_the_study_and_names_the_new_command(model_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 40)
    result = _invoke(
        "extrapolate", "--hf-model", model_dir, "--task", "text-lm", "--corpus", corpus, "--no-progress",
        "--out", tmp_path / "old",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "posenc study MODEL" in " ".join(result.output.split())
    assert (tmp_path / "old" / "comparisons.jsonl").is_file()


def _hub_cache(root: Path, repo: str, folder: Path) -> None:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/files}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snapshot = base / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())


def test_a_hub_id_is_read_from_the_hf_cache_offline(model_dir, tmp_path):
    _hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", model_dir)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    code = (
        "from posenc.pretrained.loading import load, load_config\n"
        "config = load_config('tiny-org/tiny-llama')\n"
        "model, tokenizer = load('tiny-org/tiny-llama')\n"
        "print(config.max_position_embeddings, type(model).__name__, len(tokenizer('abc')['input_ids']) > 0)\n"
        "try:\n"
        "    load_config('tiny-org/not-there')\n"
        "except FileNotFoundError as err:\n"
        "    print('refused:', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == f"{CONTEXT} LlamaForCausalLM True"
    assert lines[1].startswith(
        "refused: model tiny-org/not-there: read as a hub id, but it is not in the HF cache"
    )


def test_the_study_s_help_speaks_its_own_words():
    """Its --tuning-windows and --dtype help named extrapolate's options (--hf-model, --eval-variants,
    --eval-examples), which ``posenc study`` does not take."""
    result = _invoke("study", "--help")
    assert result.exit_code == 0
    words = " ".join(result.output.split())
    for foreign in ("--hf-model", "--eval-variants", "--eval-examples"):
        assert foreign not in words, foreign
    assert "--variants" in words and "--windows" in words
