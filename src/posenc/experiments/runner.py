"""Run a length-generalization experiment: the flow from a checked plan to a results folder.

:func:`run_experiment` checks the plan (:mod:`.plan`), holds the folder (:mod:`.folders`), skips
the runs it has finished, trains the others in worker processes (:mod:`.workers`) or, under
``torchrun``, with every process in one DDP job per run (:mod:`.runtime.distributed`), evaluates the
inference-time variants, and writes the records; :func:`~.summary.summary_table` summarizes them.

Resume: a run whose records are in ``results.jsonl`` is finished and skipped; any other run
restarts from its checkpoint (saved every ``checkpoint_every`` steps, on Ctrl-C/SIGTERM, and at the
end of training), so an interrupted command re-run unchanged loses and recomputes nothing finished.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .cluster.shards import Shard
from .cluster.workers import (
    ExperimentInterrupted,
    Log,
    OnDone,
    WorkerDied,
    run_in_workers,
    sigterm_as_interrupt,
    worker_count,
)
from .plan import check_experiment, plan_runs
from .results.folders import (
    FigureWriter,
    checkpoint_path,
    finished_runs,
    folder_lock,
    write_config,
    write_outputs,
)
from .results.records import RUNS_FILE, append_records, read_records, split_run_records
from .results.summary import SummaryTable, summary_table
from .runtime.distributed import Distributed, process_group, resolve_device
from .tasks.catalog import Task
from .train import ExperimentConfig, Interrupted, Reporter, RunSpec, run_id_for, train_and_evaluate
from .variants import evaluate_variant, row_labels, variant_run_id, variant_runs

__all__ = [
    "Distributed",
    "ExperimentInterrupted",
    "Log",
    "SummaryTable",
    "WorkerDied",
    "run_experiment",
    "summary_table",
]

INTERRUPTED = "interrupted; finished runs are saved, unfinished ones resume from their checkpoints"


def _quiet_report(label: str, phase: str, done: int, total: int, note: str) -> None:
    """The default progress callback: no output."""


def _quiet_log(message: str) -> None:
    """The default log callback: no output."""


def run_experiment(
    config: ExperimentConfig,
    out: Path,
    *,
    workers: int | None = None,
    threads: int = 1,
    device: str = "cpu",
    report: Reporter | None = None,
    log: Log | None = None,
    shard: Shard | None = None,
    preset: str | None = None,
    figures: FigureWriter | None = None,
) -> list[dict[str, Any]]:
    """Run (or resume) the experiment into ``out`` and return all its records.

    ``workers`` defaults to one process per CPU core (at most one per run); under ``torchrun``
    runs go one after another, each trained by all processes with DDP.
    Progress goes to plain callbacks, called on rank 0 only (both default to silence):
    ``report(run_label, phase, done, total, note)`` as a run trains (``phase="train"``) and is
    evaluated (``"eval"``); ``log(message)`` for one-line news (a finished run kept, a run resumed
    from its checkpoint, where the results are). :func:`summary_table` summarizes the records.
    Raises :class:`ExperimentInterrupted` after Ctrl-C/SIGTERM (everything finished is saved).
    ``shard``: run only that part of the (encoding x seed) grid (:mod:`posenc.experiments.cluster.shards`);
    ``preset``: the published setup these settings come from, recorded in ``config.json``;
    ``figures``: draws the folder's figures once its records are written
    (:func:`posenc.viz.folder.write_figures`, what ``posenc extrapolate`` passes; none without it).
    """
    config.validate()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1 (--threads), got {threads!r}")
    dist = Distributed.from_env()
    torch_device = resolve_device(device, dist)
    out = Path(out)
    task, variants = check_experiment(config, out, torch_device)
    runs = plan_runs(config, shard)
    workers = worker_count(workers, len(runs), dist)
    is_writer = dist.rank == 0
    report = report if report is not None and is_writer else _quiet_report
    log = log if log is not None and is_writer else _quiet_log
    with folder_lock(out, enabled=is_writer):
        with process_group(dist, torch_device):
            if is_writer:
                out.mkdir(parents=True, exist_ok=True)
                runtime = _runtime(workers, threads, dist, torch_device, shard)
                write_config(out, config, runtime, task.data_fingerprint(), preset)
            finished = finished_runs(out, config, task.metric)
            todo = [run for run in runs if run_id_for(config, run) not in finished]
            for run in runs:
                if run not in todo:
                    log(f"done already, kept: {run.label}")
            log(_plan_line(config, runs, todo, shard, dist, workers, threads, torch_device))
            on_done = _record_writer(out, is_writer)
            try:
                with sigterm_as_interrupt():
                    _train_runs(config, todo, out, workers, threads, torch_device, dist, report, log, on_done)
                    if is_writer:
                        _evaluate_variants(
                            config, task, runs, variants, out, finished, torch_device, report, on_done
                        )
            except (Interrupted, KeyboardInterrupt) as err:
                raise ExperimentInterrupted(INTERRUPTED) from err
        records = _experiment_records(config, out)
        if is_writer:
            written = write_outputs(out, records, figures)
            log(f"results: {', '.join(str(path) for path in [out / 'results.jsonl', *written])}")
        return records


def _runtime(
    workers: int, threads: int, dist: Distributed, device: torch.device, shard: Shard | None
) -> dict[str, Any]:
    """How this command runs the experiment, as ``config.json`` records it beside the settings."""
    runtime: dict[str, Any] = {
        "workers": workers,
        "threads": threads,
        "world_size": dist.world_size,
        "device": str(device),
    }
    if shard is not None:
        runtime["shard"] = str(shard)
    return runtime


def _experiment_records(config: ExperimentConfig, out: Path) -> list[dict[str, Any]]:
    """The records of ``out/results.jsonl`` that belong to this experiment's rows and seeds."""
    rows = set(row_labels(config))
    return [
        r for r in read_records(out / "results.jsonl") if r["encoding"] in rows and r["seed"] in config.seeds
    ]


def _plan_line(
    config: ExperimentConfig,
    runs: list[RunSpec],
    todo: list[RunSpec],
    shard: Shard | None,
    dist: Distributed,
    workers: int,
    threads: int,
    device: torch.device,
) -> str:
    """The log line that says how many runs are left, of which shard, where and how they train."""
    mode = (
        f"DDP world size {dist.world_size}" if dist.enabled else f"{workers} worker(s) x {threads} thread(s)"
    )
    part = (
        f" (shard {shard}: {len(runs)} of {len(config.seeds) * len(config.encodings)} runs)" if shard else ""
    )
    return f"{config.task}: {len(todo)} run(s) to do{part} on {device} with {mode}"


def _record_writer(out: Path, is_writer: bool) -> OnDone:
    """The callback that appends a finished run's records to ``out`` (on the writing rank only)."""

    def on_done(run: RunSpec, records: list[dict[str, Any]]) -> None:
        if is_writer and records:
            per_length, per_run = split_run_records(records)
            if per_run:  # first: a run whose results.jsonl records are missing is redone anyway
                append_records(out / RUNS_FILE, per_run)
            append_records(out / "results.jsonl", per_length)

    return on_done


def _train_runs(
    config: ExperimentConfig,
    todo: list[RunSpec],
    out: Path,
    workers: int,
    threads: int,
    device: torch.device,
    dist: Distributed,
    report: Reporter,
    log: Log,
    on_done: OnDone,
) -> None:
    """Train the runs ``todo``: in worker processes when there are several of each, otherwise one
    after another in this process (every rank of a DDP job together)."""
    if workers > 1 and len(todo) > 1:
        run_in_workers(config, todo, out, workers, threads, device, report, log, on_done)
        return
    torch.set_num_threads(threads)
    for run in todo:
        records = train_and_evaluate(
            config,
            run,
            checkpoint_path(out, config, run),
            report,
            rank=dist.rank,
            world_size=dist.world_size,
            device=device,
            log=log,
        )
        on_done(run, records)


def _evaluate_variants(
    config: ExperimentConfig,
    task: Task,
    runs: list[RunSpec],
    variants: list[Any],
    out: Path,
    finished: set[str],
    device: torch.device,
    report: Reporter,
    on_done: OnDone,
) -> None:
    """Evaluate each trained run's checkpoint again under each inference-time variant (no training);
    variants whose records exist already are kept, unless their trained run was (re)trained now."""
    for run, variant in variant_runs(runs, variants):
        if variant_run_id(config, run, variant) in finished and run_id_for(config, run) in finished:
            continue
        checkpoint = checkpoint_path(out, config, run)
        on_done(run, evaluate_variant(config, task, run, variant, checkpoint, report, device))
