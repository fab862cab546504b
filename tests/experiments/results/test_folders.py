"""Results folders (posenc.experiments.results.folders): a second writer on one folder is refused and a dead
owner's lock taken over; a folder evaluated at contiguous positions is not reused for random ones."""

from __future__ import annotations

import json

import pytest

from _experiments import TINY
from posenc.experiments import ExperimentConfig, run_experiment


def test_a_second_writer_on_one_folder_is_refused_and_a_dead_owner_is_taken_over(tmp_path):
    import os
    import socket

    from posenc.experiments.results.folders import LOCK_NAME, folder_lock

    config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, **TINY)
    tmp_path.mkdir(exist_ok=True)
    with (
        folder_lock(tmp_path),  # another writer holds the folder
        pytest.raises(ValueError, match="being written by another posenc process"),
    ):
        run_experiment(config, tmp_path, workers=1)
    assert not (tmp_path / LOCK_NAME).exists()  # released
    dead = 2**22 + 12345  # above the kernel's pid range: no such process
    (tmp_path / LOCK_NAME).write_text(f"{dead} {socket.gethostname()}\n")
    records = run_experiment(config, tmp_path, workers=1)  # a killed owner's lock is taken over
    assert len(records) == 3 * 2 and not (tmp_path / LOCK_NAME).exists()
    assert os.getpid() != dead


def test_a_folder_evaluated_at_contiguous_positions_is_not_reused_for_random_ones(tmp_path):
    """Folders written before --eval-positions evaluated randomized runs at 0..n-1: they read as
    contiguous, so a run that draws evaluation positions refuses them instead of mixing records."""
    common = {"task": "copy", "encodings": ["rope"], "train_len": 3, "eval_len": 4, "randomize_positions": 40}
    run_experiment(ExperimentConfig(**common, **TINY), tmp_path, workers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["experiment"].pop("randomize_eval_positions") is False  # now as an older folder
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="randomize_eval_positions"):
        run_experiment(ExperimentConfig(**common, randomize_eval_positions=True, **TINY), tmp_path, workers=1)
    # Plain runs never compare the option.
    plain = {**common, "randomize_positions": None}
    run_experiment(ExperimentConfig(**plain, **TINY), tmp_path / "plain", workers=1)
    run_experiment(
        ExperimentConfig(**plain, randomize_eval_positions=True, **TINY), tmp_path / "plain", workers=1
    )
