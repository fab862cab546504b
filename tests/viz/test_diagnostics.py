"""Diagnostics of trained checkpoints (posenc.viz.diagnostics), as the report reads them: how far
learned positions drifted from their initialisation, and each head's attention entropy by length
against uniform attention's."""

from __future__ import annotations

from pathlib import Path

import pytest

from posenc.experiments.train import ExperimentConfig


def test_diagnostics_read_the_trained_checkpoints(tmp_path: Path) -> None:
    import math

    from posenc.experiments.runner import run_experiment
    from posenc.viz.diagnostics import entropy_by_length, learned_table_drift
    from posenc.viz.runs import find_checkpoints

    config = ExperimentConfig(
        encodings=["learned", "alibi"], train_len=4, eval_len=8, steps=4, eval_examples=4, eval_batch=4,
        d_model=16, num_heads=2, d_ff=16, num_layers=1, checkpoint_every=4,
    )  # fmt: skip
    run_experiment(config, tmp_path, workers=1)
    checkpoints = find_checkpoints(tmp_path)
    # Learned positions: the rows a training example reaches moved; every row past them is its init.
    table, drift, reached = learned_table_drift(checkpoints["learned"])
    assert reached == config.make_task().sequence_length(config.train_len)  # input tokens of size L
    assert table.shape[0] == len(drift) > reached
    assert (drift[:reached] > 0).all() and (drift[reached:] == 0).all()
    assert learned_table_drift(checkpoints["alibi"]) is None
    # Entropy per head: between 0 and that of uniform attention over the visible keys, which is the
    # mean over queries i of log(i + 1).
    entropy, uniform = entropy_by_length(checkpoints["alibi"], [2, 4, 8], examples=2)
    assert entropy.shape == (1, 2, 3)
    width = [config.make_task().sequence_length(n) for n in (2, 4, 8)]
    assert uniform == pytest.approx([sum(math.log(i + 1) for i in range(t)) / t for t in width])
    assert (entropy >= 0).all() and (entropy <= uniform + 1e-9).all()
