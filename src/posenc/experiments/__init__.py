"""Length-generalization experiments: synthetic tasks, a byte LM, training, resume and DDP.

>>> from posenc.experiments import ExperimentConfig, run_experiment
>>> run_experiment(ExperimentConfig(encodings=["alibi", "learned"], steps=200), "runs/demo")  # doctest: +SKIP

Progress arrives through plain callbacks (``report=``, ``log=``; silent by default); the command
line ``posenc extrapolate`` (:mod:`posenc.experiments.cli`) draws them with Rich, which only the
``cli`` extra installs.
"""

from __future__ import annotations

from .runner import ExperimentInterrupted, SummaryTable, WorkerDied, run_experiment, summary_table
from .tasks import TASKS, Batch, Metric, Task, default_corpus, make_task
from .train import ExperimentConfig, RunSpec

__all__ = [
    "TASKS",
    "Batch",
    "ExperimentConfig",
    "ExperimentInterrupted",
    "Metric",
    "RunSpec",
    "SummaryTable",
    "Task",
    "WorkerDied",
    "default_corpus",
    "make_task",
    "run_experiment",
    "summary_table",
]
