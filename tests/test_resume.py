"""Resume: an interrupted experiment re-run unchanged keeps finished records and continues exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from posenc.experiments import ExperimentConfig, ExperimentInterrupted, run_experiment
from posenc.experiments import train as train_module

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
