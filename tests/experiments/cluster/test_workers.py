"""Worker processes (posenc.experiments.cluster.workers): two workers give the same records as one."""

from __future__ import annotations

import json

from _experiments import TINY
from posenc.experiments import ExperimentConfig, run_experiment


def test_two_workers_give_the_same_records_as_one(tmp_path):
    config = ExperimentConfig(
        task="copy", encodings=["nope", "alibi"], train_len=2, eval_len=3, num_symbols=8, **TINY
    )
    serial = run_experiment(config, tmp_path / "serial", workers=1)
    parallel = run_experiment(config, tmp_path / "parallel", workers=2)
    key = lambda r: (r["encoding"], r["length"], r["metric"])  # noqa: E731
    assert sorted(serial, key=key) == sorted(parallel, key=key)
    assert json.loads((tmp_path / "parallel" / "config.json").read_text())["runtime"]["workers"] == 2
