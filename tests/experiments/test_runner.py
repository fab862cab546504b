"""posenc extrapolate's library form (posenc.experiments.runner.run_experiment): every task trains at short
lengths and writes one record per evaluated length and metric; the same seed gives the same records,
another config is refused; hybrids, layer presets, packing; broken records are repaired on the next run;
an interrupted or killed run resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from _experiments import TINY
from _study import STUDY_TINY
from posenc.experiments import ExperimentConfig, ExperimentInterrupted, run_experiment, summary_table
from posenc.experiments import train as train_module
from posenc.experiments.results.records import (
    read_run_records,
)
from posenc.experiments.tasks.catalog import TASKS
from posenc.experiments.train import RunSpec
from posenc.viz.folder import write_figures


@pytest.mark.parametrize("task", list(TASKS))
def test_each_task_trains_and_writes_one_record_per_length_and_metric(task, tmp_path):
    train_len, eval_len = (8, 12) if task == "lm" else (2, 4)
    config = ExperimentConfig(
        task=task,
        encodings=["nope", "learned"],
        train_len=train_len,
        eval_len=eval_len,
        num_symbols=8,
        **TINY,
    )
    records = run_experiment(config, tmp_path, workers=1, figures=write_figures)
    metrics = ["perplexity"] if task == "lm" else ["exact_match", "token_accuracy"]
    keys = {(r["encoding"], r["task"], r["length"], r["seed"], r["metric"]) for r in records}
    assert len(keys) == len(records) == 2 * eval_len * len(metrics)
    assert keys == {
        (e, task, n, 0, m) for e in ("nope", "learned") for n in range(1, eval_len + 1) for m in metrics
    }
    for record in records:
        assert record["value"] >= 1.0 if task == "lm" else 0.0 <= record["value"] <= 1.0
        assert record["run"] == f"{record['encoding']}__{task}__seed0" and record["steps"] == 2
    assert json.loads((tmp_path / "config.json").read_text())["experiment"]["task"] == task
    csv_lines = (tmp_path / "results.csv").read_text().splitlines()
    assert (
        csv_lines[0].startswith("run,encoding,task,seed,length,metric,value")
        and len(csv_lines) == len(records) + 1
    )
    assert (tmp_path / "extrapolation.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        f"learned__{task}__seed0.pt",
        f"nope__{task}__seed0.pt",
    ]


def test_same_seed_same_records_and_config_mismatch_refused(tmp_path):
    config = ExperimentConfig(
        task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **TINY
    )
    first = run_experiment(config, tmp_path / "a", workers=1)
    second = run_experiment(config, tmp_path / "b", workers=1)
    assert first == [dict(r) for r in second]
    other = ExperimentConfig(**{**config.to_dict(), "train_len": 3})
    with pytest.raises(ValueError, match="train_len"):
        run_experiment(other, tmp_path / "a", workers=1)


def test_hybrid_encoding_runs_one_spec_per_layer(tmp_path):
    from posenc.experiments.train import build_model, run_id_for

    config = ExperimentConfig(
        task="copy",
        encodings=["t5/sinusoidal"],
        train_len=2,
        eval_len=3,
        num_symbols=8,
        **{**TINY, "num_layers": 2},
    )
    model = build_model(config, config.make_task(), "t5/sinusoidal")
    assert [b.attn.encoding.name for b in model.blocks] == ["t5", "nope"]
    assert [e.name for e in model.input_encodings] == ["sinusoidal"]
    run_id = run_id_for(config, RunSpec("t5/sinusoidal", 0))
    assert "/" not in run_id and run_id.startswith("t5+sinusoidal-")
    records = run_experiment(config, tmp_path, workers=1)
    assert {r["encoding"] for r in records} == {"t5/sinusoidal"}
    assert (tmp_path / "checkpoints" / f"{run_id}.pt").exists()


def test_experiment_library_runs_without_rich(tmp_path):
    """Rich is the CLI's (the ``cli`` extra): the library imports and runs a tiny experiment without it."""
    import subprocess
    import sys

    code = f"""
import sys
sys.modules["rich"] = None  # any "import rich..." now raises ImportError
from posenc.experiments import ExperimentConfig, run_experiment
config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, num_symbols=8, **{TINY!r})
events = []
records = run_experiment(config, sys.argv[1], workers=1, report=lambda *args: events.append(args), log=print)
assert len(records) == 3 * 2 and any(e[1] == "eval" for e in events), (records, events)
print("library ran without rich")
"""
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "library ran without rich" in done.stdout
    assert "done already" not in done.stdout and "results:" in done.stdout


def test_layer_presets_run_as_encodings(tmp_path):
    config = ExperimentConfig(
        task="copy", encodings=["gemma3:window=2,global_every=2", "gpt-oss:window=2"], train_len=2,
        eval_len=3, num_symbols=8, **TINY,
    )  # fmt: skip
    records = run_experiment(config, tmp_path, workers=1)
    assert {r["encoding"] for r in records} == set(config.encodings)


def test_packed_training_runs_end_to_end(tmp_path):
    config = ExperimentConfig(task="copy", encodings=["rope"], train_len=3, eval_len=4, pack=True, **TINY)
    records = run_experiment(config, tmp_path, workers=1)
    assert {r["length"] for r in records} == {1, 2, 3, 4}
    assert json.loads((tmp_path / "config.json").read_text())["experiment"]["pack"] is True
    unpacked = ExperimentConfig(task="copy", encodings=["rope"], train_len=3, eval_len=4, **TINY)
    with pytest.raises(ValueError, match="pack"):  # one folder never mixes packed and unpacked runs
        run_experiment(unpacked, tmp_path, workers=1)


def test_duplicated_and_missing_records_are_repaired_on_the_next_run(tmp_path):
    config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, **TINY)
    first = run_experiment(config, tmp_path, workers=1)
    path = tmp_path / "results.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines + lines[:2]) + "\n")  # two records written twice
    with pytest.warns(UserWarning, match="dropped 2 exact duplicate record"):
        again = run_experiment(config, tmp_path, workers=1)
    assert len(again) == len(first)
    # A record lost from the file: the run counts as unfinished and is redone, never duplicated.
    lines = path.read_text().splitlines()
    kept = [line for n, line in enumerate(lines) if '"length": 3' not in line and line not in lines[:n]]
    path.write_text("\n".join(kept) + "\n")
    redone = run_experiment(config, tmp_path, workers=1)
    assert sorted((r["length"], r["metric"]) for r in redone) == sorted(
        (r["length"], r["metric"]) for r in first
    )


# ----------------------------------------------------------------------------
# The main job as a study (issue 14): fit first, uncertainty, inference-time variants, the report.


def test_a_folder_without_iid_records_loads_and_is_not_retrained(tmp_path):
    config = ExperimentConfig(
        task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **STUDY_TINY
    )
    records = run_experiment(config, tmp_path, workers=1)
    metric = config.make_task().metric
    table = summary_table(config, records, metric)
    (tmp_path / "runs.jsonl").unlink()  # a folder written before per-run records
    checkpoint = tmp_path / "checkpoints" / "alibi__copy__seed0.pt"
    before = checkpoint.stat().st_mtime_ns
    again = run_experiment(config, tmp_path, workers=1)
    assert again == records and checkpoint.stat().st_mtime_ns == before
    assert summary_table(config, again, metric) == table
    assert read_run_records(tmp_path) == []


# ----------------------------------------------------------------------------
# Resume: an interrupted experiment re-run unchanged keeps finished records and continues exactly.


CONFIG = dict(
    task="copy", train_len=3, eval_len=5, num_symbols=8, d_model=16, num_layers=1, num_heads=2, d_ff=16,
    batch_size=4, steps=6, warmup=2, eval_examples=4, checkpoint_every=100,
)  # fmt: skip


def _log() -> tuple[Callable[[str], None], list[str]]:
    """A ``log`` callback (``lines.append``) and the lines it collects."""
    lines: list[str] = []
    return lines.append, lines


def test_interrupted_run_resumes_exactly_and_keeps_finished_records(tmp_path, monkeypatch):
    config = ExperimentConfig(encodings=["nope", "alibi"], **CONFIG)
    reference = run_experiment(config, tmp_path / "reference", workers=1)

    # Stop after 9 steps in this process: nope finishes (6 steps), alibi stops at its step 3.
    out = tmp_path / "run"
    monkeypatch.setenv(train_module.INTERRUPT_ENV, "9")
    monkeypatch.setattr(train_module, "_steps_this_process", 0)
    with pytest.raises(ExperimentInterrupted):
        run_experiment(config, out, workers=1)
    results = out / "results.jsonl"
    saved = results.read_text()
    assert {line.split('"encoding": ')[1].split(",")[0] for line in saved.splitlines()} == {'"nope"'}
    assert torch.load(out / "checkpoints" / "alibi__copy__seed0.pt", weights_only=False)["step"] == 3
    nope_checkpoint = out / "checkpoints" / "nope__copy__seed0.pt"
    nope_mtime = nope_checkpoint.stat().st_mtime_ns

    monkeypatch.delenv(train_module.INTERRUPT_ENV)
    log, lines = _log()
    resumed = run_experiment(config, out, workers=1, log=log)
    text = "\n".join(lines)
    assert "done already, kept: nope seed 0" in text
    assert "alibi seed 0: resumed from its checkpoint at step 3/6" in text
    assert results.read_text().startswith(saved), "finished records are kept byte for byte"
    assert nope_checkpoint.stat().st_mtime_ns == nope_mtime, "the finished run was not retrained"
    assert resumed == reference, "resuming continues the interrupted run exactly"
    assert torch.load(out / "checkpoints" / "alibi__copy__seed0.pt", weights_only=False)["step"] == 6


def test_killed_process_resumes_from_its_last_checkpoint(tmp_path):
    """SIGKILL (no chance to save) mid-training; the same command resumes from the periodic checkpoint."""
    out = tmp_path / "run"
    command = [
        str(Path(sys.executable).with_name("posenc")),
        "extrapolate",
        "--task",
        "copy",
        "--encodings",
        "nope",
    ]
    command += [
        "--train-len",
        "2",
        "--eval-len",
        "3",
        "--num-symbols",
        "8",
        "--d-model",
        "8",
        "--num-layers",
        "1",
    ]
    command += [
        "--num-heads",
        "1",
        "--d-ff",
        "8",
        "--batch-size",
        "2",
        "--steps",
        "100",
        "--checkpoint-every",
        "10",
    ]
    command += ["--eval-examples", "2", "--workers", "1", "--no-progress", "--out", str(out)]
    env = {**os.environ, "COLUMNS": "200"}
    checkpoint = out / "checkpoints" / "nope__copy__seed0.pt"
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while not checkpoint.exists() and process.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert checkpoint.exists(), process.communicate()[0].decode()
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL
    assert not (out / "results.jsonl").exists()
    saved_step = torch.load(checkpoint, weights_only=False)["step"]
    assert 10 <= saved_step < 100 and saved_step % 10 == 0

    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "nope seed 0: resumed from its checkpoint at step" in finished.stdout
    resumed_at = int(finished.stdout.split("resumed from its checkpoint at step ")[1].split("/")[0])
    assert resumed_at >= saved_step
    assert len((out / "results.jsonl").read_text().splitlines()) == 3 * 2
