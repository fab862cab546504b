"""The experiment commands (posenc.cli.experiments): posenc extrapolate prints the summary table,
trains the 2025 recipes from the command line and refuses an infinite lr or an unreachable fit
target before writing; with --hf-model it keeps HF's own "Loading weights" bars out of its output."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from posenc.cli.app import app, load_command_modules

load_command_modules()


@pytest.fixture
def tiny_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8,
    )
    path = tmp_path / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.hf  # the --hf-model path: CI runs these at both ends of the transformers range
@pytest.mark.parametrize("enabled", [True, False])
def test_hf_model_prints_no_hf_progress_bar_and_leaves_the_setting_as_it_was(tiny_llama, tmp_path, enabled):
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        args = ["extrapolate", "--hf-model", str(tiny_llama), "--task", "passkey", "--num-symbols", "16"]
        args += ["--eval-len", "10", "--eval-examples", "2", "--out", str(tmp_path / "out"), "--no-progress"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "Loading weights" not in result.output and "it/s]" not in result.output, result.output
        assert "passkey: exact match by length" in result.output
        assert hf_logging.is_progress_bar_enabled() is enabled
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


NEW_RECIPES = [
    "cohere2:window=2",
    "gemma4:window=2,global_every=2",
    "granite-swa:window=2,full_base=0",
    "olmo3:window=2",
    "swan:window=2",
]


def test_cli_prints_the_summary_table(tmp_path):
    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    args = [
        "extrapolate",
        "--task",
        "count_copy",
        "--encodings",
        "nope,alibi:mode=symmetric",
        "--train-len",
        "2",
        "--eval-len",
        "5",
    ]
    args += [
        "--steps",
        "2",
        "--d-model",
        "16",
        "--num-layers",
        "1",
        "--d-ff",
        "16",
        "--eval-examples",
        "2",
        "--workers",
        "1",
    ]
    args += ["--out", str(tmp_path), "--no-progress"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    for text in ("at L=2", "mean 3..5", "at L+1=3", "at 2L=4", "nope", "alibi:mode=symmetric"):
        assert text in result.output, result.output
    bad = CliRunner().invoke(
        app, ["extrapolate", "--task", "kopy", "--out", str(tmp_path / "x"), "--no-progress"]
    )
    assert bad.exit_code == 2 and "unknown task" in bad.output


def test_the_2025_recipes_train_from_the_command_line(tmp_path):
    """``posenc extrapolate --encodings cohere2:...,gemma4:...`` trains each recipe on four layers
    (both layer types present) and writes its records."""
    from typer.testing import CliRunner

    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    out = tmp_path / "run"
    tiny = ["--encodings", ",".join(NEW_RECIPES), "--steps", "2", "--train-len", "2", "--eval-len", "3"]
    tiny += ["--num-symbols", "8", "--d-model", "16", "--num-layers", "4", "--num-heads", "2"]
    tiny += ["--d-ff", "16", "--batch-size", "4", "--eval-examples", "3", "--workers", "1"]
    result = CliRunner().invoke(app, ["extrapolate", *tiny, "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["encoding"] for r in records} == set(NEW_RECIPES)


@pytest.mark.parametrize(
    "words, named",
    [
        (["--lr", "inf"], "invalid lr=inf"),
        (["--until-fit", "--fit-margin", "0.06"], "invalid fit_margin=0.06"),
    ],
)
def test_cli_refuses_an_infinite_lr_and_an_unreachable_fit_target_before_writing(tmp_path, words, named):
    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    out = tmp_path / "x"
    # A tiny grid, so that were the settings accepted the run would end in seconds.
    tiny = [
        "--encodings",
        "nope",
        "--steps",
        "1",
        "--train-len",
        "2",
        "--eval-len",
        "2",
        "--num-symbols",
        "8",
    ]
    tiny += ["--d-model", "8", "--num-layers", "1", "--num-heads", "1", "--d-ff", "8", "--batch-size", "2"]
    tiny += ["--eval-examples", "1", "--workers", "1", "--no-progress", "--out", str(out)]
    result = CliRunner().invoke(app, ["extrapolate", *tiny, *words])
    assert result.exit_code == 2 and named in result.output, result.output
    assert not out.exists()
