"""Length-generalization experiments: synthetic tasks, a byte LM, training, resume and DDP.

The harness writes a results folder and draws nothing: figures come from :mod:`posenc.viz`, which
reads the folder (``figures=posenc.viz.folder.write_figures`` draws them as the folder is
written). Progress arrives through plain callbacks (``report=``, ``log=``; silent by default); the
command line ``posenc extrapolate`` (:mod:`posenc.cli.experiments`) draws them with Rich, which only
the ``cli`` extra installs, and wires the harness to the figures.

Examples:
    >>> from posenc.experiments import ExperimentConfig, run_experiment
    >>> run_experiment(ExperimentConfig(encodings=["alibi", "learned"], steps=200), "runs/demo")  # doctest: +SKIP
"""

from __future__ import annotations

from .runner import ExperimentInterrupted, SummaryTable, WorkerDied, run_experiment, summary_table
from .tasks.catalog import TASKS, Batch, Metric, Task, default_corpus, make_task, register_task
from .train import ExperimentConfig, RunSpec

# Importing a module of tasks registers them (@register_task), so every built-in task is in TASKS
# as soon as any part of the package is imported.
from .tasks import retrieval  # noqa: F401  isort: skip

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
    "register_task",
    "run_experiment",
    "summary_table",
]
