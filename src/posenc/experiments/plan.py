"""The plan of an experiment, checked before anything is written: the runs (encoding x seed, or
one shard of them), and everything that would fail later (settings, lengths, every encoding's model
on the meta device, a forced backend, the variants, the folder's earlier settings and data)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..backends import NoBackendError
from .results.folders import check_folder_settings, check_writable_folder
from .shard import Shard
from .tasks.catalog import Task
from .train import ExperimentConfig, RunSpec, build_model
from .variants import check_variants

__all__ = ["check_experiment", "check_models", "plan_runs"]


def plan_runs(config: ExperimentConfig, shard: Shard | None = None) -> list[RunSpec]:
    """The runs of ``config``, seed-major (encodings in the order given); only ``shard``'s with one."""
    runs = [RunSpec(encoding, seed) for seed in config.seeds for encoding in config.encodings]
    return runs if shard is None else shard.select(runs)


def check_experiment(
    config: ExperimentConfig, out: Path, device: torch.device | str = "cpu"
) -> tuple[Task, list[Any]]:
    """Check ``config`` for the folder ``out`` before anything is written: its settings, the folder
    (writable, no other settings or data in it), the lengths against the task, every encoding's
    model, a forced backend on ``device`` and the variants. Returns the task and the variants;
    ``ValueError`` naming what is wrong otherwise."""
    config.validate()
    check_writable_folder(out)
    task = config.make_task()
    check_folder_settings(out, config, task)
    for length in (config.train_len, config.eval_len):
        task.check_length(length)
    check_models(config, task, device)
    return task, check_variants(config, task)


def check_models(config: ExperimentConfig, task: Task, device: torch.device | str = "cpu") -> None:
    """Build every encoding's model on the meta device (no memory, no data) so that a bad spec or
    preset fails before anything is written; the error names the encoding. A forced backend must
    also train each encoding on ``device``."""
    if config.until_fit and not task.metric.fits:
        raise ValueError(
            f"--until-fit needs a task scored by exact match; {config.task} is scored by {task.metric.name}, "
            "which has no fit threshold: drop --until-fit"
        )
    if config.randomize_positions is not None:
        if config.pack:
            raise ValueError(
                "--randomize-positions and --pack cannot be combined (positions restart per example)"
            )
        needed = task.sequence_length(config.train_len)
        if config.randomize_positions < needed:
            raise ValueError(
                f"--randomize-positions {config.randomize_positions} must be at least the training sequence "
                f"length {needed} (positions are drawn without replacement)"
            )
        longest = task.sequence_length(config.eval_len)
        if config.randomize_eval_positions and config.randomize_positions < longest:
            raise ValueError(
                f"--randomize-positions {config.randomize_positions} must be at least the longest evaluated "
                f"sequence, {longest}, to draw evaluation positions from it (or pass --eval-positions contiguous)"
            )
    for encoding in config.encodings:
        try:
            with torch.device("meta"):
                build_model(config, task, encoding)
        except (ValueError, TypeError) as err:
            raise ValueError(f"--encodings {encoding!r}: {err}") from err
        if config.backend != "auto":
            _check_backend_serves(config, task, encoding, torch.device(device))


def _check_backend_serves(config: ExperimentConfig, task: Task, encoding: str, device: torch.device) -> None:
    """A forced ``--backend`` must run this encoding's training step (forward and backward): one
    step on a two-example batch of the shortest length, before anything is written."""
    model = build_model(config, task, encoding).to(device)
    batch = task.train_batch(config.min_train_len, config.min_train_len, 2, torch.Generator().manual_seed(0))
    try:
        model(batch.inputs.to(device)).float().sum().backward()
    except NoBackendError as err:
        reason = str(err).split("\n")[0]
        raise ValueError(
            f"--backend {config.backend!r} cannot train --encodings {encoding!r}: {reason}"
        ) from err
