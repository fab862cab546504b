"""Distributed training (posenc.experiments.runtime.distributed): torchrun on two CPU processes gives the
records of one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BIN = Path(sys.executable).parent


@pytest.mark.skipif(
    not (BIN / "torchrun").exists() or not torch.distributed.is_available(), reason="needs torchrun"
)
def test_torchrun_two_cpu_processes(tmp_path):
    out = tmp_path / "run"
    command = [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc_per_node",
        "2",
        str(BIN / "posenc"),
        "extrapolate",
    ]
    command += [
        "--task",
        "copy",
        "--encodings",
        "nope,alibi",
        "--train-len",
        "2",
        "--eval-len",
        "3",
        "--num-symbols",
        "8",
    ]
    command += ["--d-model", "8", "--num-layers", "1", "--num-heads", "1", "--d-ff", "8", "--batch-size", "2"]
    command += ["--steps", "4", "--eval-examples", "2", "--no-progress", "--out", str(out)]
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DDP world size 2" in done.stdout
    assert done.stdout.count("copy: exact match by length") == 1, "only rank 0 prints the table"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    keys = [(r["encoding"], r["length"], r["metric"]) for r in records]
    assert len(keys) == len(set(keys)) == 2 * 3 * 2, "every record written exactly once"
    assert json.loads((out / "config.json").read_text())["runtime"]["world_size"] == 2
    state = torch.load(out / "checkpoints" / "alibi__copy__seed0.pt", weights_only=False)
    assert state["step"] == 4 and not any(k.startswith("module.") for k in state["model"]), (
        "plain (unwrapped) weights"
    )
