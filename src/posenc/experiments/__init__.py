"""Length-generalization experiments: synthetic tasks, a byte LM, training, resume and DDP.

>>> from posenc.experiments import ExperimentConfig, run_experiment
>>> run_experiment(ExperimentConfig(encodings=["alibi", "learned"], steps=200), "runs/demo")  # doctest: +SKIP

The command line is ``posenc extrapolate`` (:mod:`posenc.experiments.cli`).
"""

from __future__ import annotations

from .runner import ExperimentInterrupted, run_experiment, summary_table
from .tasks import TASKS, Batch, Task, default_corpus, make_task
from .train import ExperimentConfig, RunSpec

__all__ = [
    "TASKS",
    "Batch",
    "ExperimentConfig",
    "ExperimentInterrupted",
    "RunSpec",
    "Task",
    "default_corpus",
    "make_task",
    "run_experiment",
    "summary_table",
]
