"""Run a length-generalization experiment: plan the runs, resume, train in parallel or under DDP,
and write the results folder.

Folder layout (``out``)::

    config.json            the settings (a resumed command must match them)
    results.jsonl          one tidy record per (encoding, task, length, seed, metric), atomic
    runs.jsonl             one record per run: its in-distribution score (``metric: "iid"``), fit
                           flag, steps trained (and, with --until-fit, the step it fitted at)
    results.csv            the same records as a table
    extrapolation.png      the metric against length, one line per encoding
    checkpoints/<run>.pt   model + optimizer + scheduler + RNG + step of every run

Resume: a run whose records are in ``results.jsonl`` is finished and skipped; any other run
restarts from its checkpoint (saved every ``checkpoint_every`` steps, on Ctrl-C/SIGTERM, and at the
end of training), so an interrupted command re-run unchanged loses and recomputes nothing finished.

Parallelism: on CPU, ``workers`` processes with ``threads`` threads each train different runs side
by side (two single-threaded jobs on two cores beat one job with two threads for models this
small). Under ``torchrun`` (``WORLD_SIZE > 1``) every process joins one DistributedDataParallel job
per run instead (gloo on CPU, nccl on GPU), and rank 0 evaluates and writes the results.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import queue as queue_module
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import results as results_io
from .shards import Shard, missing_runs_note
from .tasks import Metric, Task
from .train import (
    ExperimentConfig,
    Interrupted,
    Reporter,
    RunSpec,
    build_model,
    run_id_for,
    train_and_evaluate,
)
from .variants import check_variants, row_labels, variant_run_id, variant_runs

__all__ = [
    "Distributed",
    "ExperimentInterrupted",
    "Log",
    "SummaryTable",
    "WorkerDied",
    "run_experiment",
    "summary_table",
]

#: ``log(message)``: one line of news (a run kept or resumed, where the results are).
Log = Callable[[str], None]


class ExperimentInterrupted(Exception):
    """The experiment stopped early; finished records and checkpoints are saved."""


class WorkerDied(ExperimentInterrupted):
    """A worker process ended abruptly (killed, out of memory); finished records are saved."""


@dataclass(frozen=True)
class Distributed:
    """This process's place in a ``torchrun`` job (rank 0 of 1 without one)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Distributed:
        return cls(
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)),
        )

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def _device(requested: str, dist: Distributed) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        return torch.device("cuda", dist.local_rank if dist.enabled else torch.cuda.current_device())
    if requested != "cpu":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {requested!r}")
    return torch.device("cpu")


# ---------------------------------------------------------------------------- folder bookkeeping


def _check_config(out: Path, config: ExperimentConfig, task: Task) -> None:
    """Refuse to mix results of different settings, or of different data, in one folder."""
    path = out / "config.json"
    if not path.exists():
        return
    saved_config = results_io.load_config(out)
    _check_data(path, saved_config.get("data"), task.data_fingerprint())
    saved = results_io.experiment_settings(saved_config)
    current = config.identity()
    defaults = ExperimentConfig().identity()  # a field added later reads as its default in old folders
    different = {
        k: (saved.get(k, defaults.get(k)), v)
        for k, v in current.items()
        if saved.get(k, defaults.get(k)) != v
    }
    if different:
        details = ", ".join(f"{k}: {old!r} there vs {new!r} now" for k, (old, new) in different.items())
        raise ValueError(
            f"{out} holds an experiment with other settings ({details}); use another --out folder"
        )


def _check_data(path: Path, saved: Any, current: dict[str, str] | None) -> None:
    """The data recorded in ``config.json`` (a corpus's sha256) must be the data read now."""
    if not isinstance(saved, dict) or current is None or saved.get("sha256") in (None, current["sha256"]):
        return  # generated data, or a folder written before hashes were recorded
    raise ValueError(
        f"corpus {current['corpus']} changed since this folder's runs were trained on it (sha256 "
        f"{saved['sha256'][:12]}... recorded in {path}, {current['sha256'][:12]}... now): mixing them would "
        "compare models trained on different data; restore the file, or use another --out"
    )


def _check_writable_folder(out: Path) -> None:
    """``out`` is a folder this process may create or write into (checked before writing anything)."""
    existing = out
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        what = "is" if existing == out else f"is inside {existing}, which is"
        raise ValueError(f"--out {out} {what} not a folder; give a folder path")
    problem = results_io.cannot_create_in(existing)
    if problem:
        raise ValueError(f"--out {out}: {problem}; give a writable folder")


LOCK_NAME = ".posenc.lock"


@contextmanager
def folder_lock(out: Path, *, enabled: bool = True):
    """Hold ``out/.posenc.lock`` (this process's pid and host) while writing into ``out``.

    A second writer gets a ``ValueError`` naming the owner; a lock left by a process that no longer
    runs (killed) is taken over. ``enabled=False`` (the non-writing DDP ranks) does nothing.
    """
    if not enabled:
        yield
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"--out {out}: cannot create the folder ({err.strerror or err}); give a writable folder"
        ) from err
    path = out / LOCK_NAME
    me = f"{os.getpid()} {socket.gethostname()}"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = path.read_text(encoding="utf-8").strip() if path.exists() else ""
            if _lock_owner_alive(owner):
                raise ValueError(
                    f"{out} is being written by another posenc process ({owner}; lock file {path}): "
                    "wait for it to finish, or use another --out"
                ) from None
            path.unlink(missing_ok=True)  # its owner died: take the folder over
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(me + "\n")
        break
    try:
        yield
    finally:
        if path.exists() and path.read_text(encoding="utf-8").strip() == me:
            path.unlink()


def _lock_owner_alive(owner: str) -> bool:
    """Whether the ``"pid host"`` that wrote a lock still runs (on another host: assume it does)."""
    parts = owner.split()
    if len(parts) != 2 or not parts[0].isdigit():
        return False
    pid, host = int(parts[0]), parts[1]
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_config(
    out: Path,
    config: ExperimentConfig,
    runtime: dict[str, Any],
    data: dict[str, str] | None,
    preset: str | None = None,
) -> None:
    payload: dict[str, Any] = {"experiment": config.to_dict(), "runtime": runtime}
    if data is not None:
        payload["data"] = data  # the corpus's path and sha256: a rerun on edited data is refused
    if preset is not None:
        payload["preset"] = preset  # the report puts the published numbers beside these results
    results_io.atomic_write_text(out / "config.json", json.dumps(payload, indent=2) + "\n")


def _finished_runs(out: Path, config: ExperimentConfig, metric: Metric) -> set[str]:
    """Runs whose records cover every evaluated length of every metric (a run with some records
    missing is redone). The metrics are the task's own and any other the folder's runs recorded."""
    seen: dict[str, set[tuple[str, int]]] = {}
    metrics = {metric.name}
    for record in results_io.read_records(out / "results.jsonl"):
        if record.get("metric") in results_io.RUN_METRICS:
            continue  # one per run, at the training length (folders written before it have none)
        seen.setdefault(record["run"], set()).add((record.get("metric"), record["length"]))
        metrics.add(record.get("metric"))
    wanted = {(name, length) for name in metrics for length in range(1, config.eval_len + 1)}
    return {run for run, pairs in seen.items() if wanted <= pairs}


# ---------------------------------------------------------------------------- progress


def _quiet_report(label: str, phase: str, done: int, total: int, note: str) -> None:
    """The default progress callback: no output."""


def _quiet_log(message: str) -> None:
    """The default log callback: no output."""


# ---------------------------------------------------------------------------- workers

_WORKER_QUEUE: Any = None
_WORKER_STOP: Any = None


#: How often a worker checks that the main process still runs (seconds).
PARENT_POLL_SECONDS = 0.5


def _init_worker(threads: int, progress_queue: Any, stop_event: Any) -> None:
    global _WORKER_QUEUE, _WORKER_STOP
    torch.set_num_threads(threads)
    _WORKER_QUEUE, _WORKER_STOP = progress_queue, stop_event
    # Idle workers ignore Ctrl-C; a running job turns it into a checkpoint and a clean stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_when_orphaned(os.getppid())


def _exit_when_orphaned(parent: int) -> None:
    """Exit this worker as soon as its parent is gone (killed with SIGKILL, no chance to clean up).

    A worker blocked on the pool's pipe would otherwise live forever; nothing it does after the
    parent died can reach the results (the parent writes them), and its checkpoints are atomic,
    so the next command resumes from the last one.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="posenc-parent-watch", daemon=True).start()


def _queue_report(label: str, phase: str, done: int, total: int, note: str) -> None:
    # Training steps are many: report every step's count but only send a message every few steps.
    if phase == "train" and done % 5 and done != total:
        return
    _WORKER_QUEUE.put((label, phase, done, total, note))


def _queue_log(message: str) -> None:
    _WORKER_QUEUE.put((message,))


def _worker_job(config: ExperimentConfig, run: RunSpec, checkpoint: str, device: str) -> list[dict[str, Any]]:
    return train_and_evaluate(
        config,
        run,
        Path(checkpoint),
        _queue_report,
        device=torch.device(device),
        log=_queue_log,
        should_stop=_WORKER_STOP.is_set,
    )


@contextmanager
def _sigterm_as_interrupt():
    """Treat SIGTERM (``kill``) like Ctrl-C in the main process."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_in_workers(
    config: ExperimentConfig,
    runs: list[RunSpec],
    out: Path,
    workers: int,
    threads: int,
    device: torch.device,
    report: Reporter,
    log: Log,
    on_done: Callable[[RunSpec, list[dict[str, Any]]], None],
) -> None:
    context = multiprocessing.get_context("spawn")
    progress_queue, stop_event = context.Queue(), context.Event()
    executor = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(threads, progress_queue, stop_event)
    )
    futures: dict[Future, RunSpec] = {}
    handled: set[Future] = set()
    try:
        for run in runs:
            checkpoint = str(out / "checkpoints" / f"{run_id_for(config, run)}.pt")
            futures[executor.submit(_worker_job, config, run, checkpoint, str(device))] = run
        processes = list(getattr(executor, "_processes", {}).values())  # to name a worker that dies
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(progress_queue, report, log)
            for future in done:
                handled.add(future)
                try:
                    on_done(futures[future], future.result())
                except Interrupted as err:  # a worker was stopped (a signal sent to it alone): stop all
                    raise KeyboardInterrupt from err
                except BrokenProcessPool as err:
                    raise WorkerDied(_death_notice(processes)) from err
        _drain(progress_queue, report, log)
    except KeyboardInterrupt:
        stop_event.set()  # running jobs checkpoint and stop; queued ones stop before starting
        _collect_finished({f: r for f, r in futures.items() if f not in handled}, on_done)
        _drain(progress_queue, report, log)
        raise ExperimentInterrupted(
            "interrupted; finished runs are saved, unfinished ones resume from their checkpoints"
        ) from None
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _death_notice(processes: list[Any]) -> str:
    """One line naming the worker that died and how: ``worker 2 (pid 4242) died (signal 9)``."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and not any(p.exitcode not in (None, 0) for p in processes):
        time.sleep(0.05)  # the pool notices a death before the process's exit code is collected
    # The pool then terminates the other workers (SIGTERM): name the one that died first.
    dead = [(n, p) for n, p in enumerate(processes, start=1) if p.exitcode not in (None, 0)]
    dead.sort(key=lambda item: item[1].exitcode == -signal.SIGTERM)
    for number, process in dead[:1]:
        code = process.exitcode
        if code is not None:
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            return (
                f"worker {number} (pid {process.pid}) died ({how}); finished runs are saved, "
                "unfinished ones resume from their checkpoints"
            )
    return "a worker process died; finished runs are saved, unfinished ones resume from their checkpoints"


def _collect_finished(
    futures: dict[Future, RunSpec], on_done: Callable[[RunSpec, list[dict[str, Any]]], None]
) -> None:
    """After a stop request: keep the records of runs that still finished, drop the rest."""
    for future in futures:
        future.cancel()
    for future, run in futures.items():
        if future.cancelled():
            continue
        try:
            records = future.result()
        except (Interrupted, KeyboardInterrupt):
            continue
        on_done(run, records)


def _drain(progress_queue: Any, report: Reporter, log: Log) -> None:
    """Hand the workers' queued progress and log messages to the callbacks."""
    while True:
        try:
            message = progress_queue.get_nowait()
        except queue_module.Empty:
            return
        if len(message) == 1:
            log(message[0])
        else:
            report(*message)


# ---------------------------------------------------------------------------- experiment


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
    from ..backends import NoBackendError

    model = build_model(config, task, encoding).to(device)
    batch = task.train_batch(config.min_train_len, config.min_train_len, 2, torch.Generator().manual_seed(0))
    try:
        model(batch.inputs.to(device)).float().sum().backward()
    except NoBackendError as err:
        reason = str(err).split("\n")[0]
        raise ValueError(
            f"--backend {config.backend!r} cannot train --encodings {encoding!r}: {reason}"
        ) from err


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
) -> list[dict[str, Any]]:
    """Run (or resume) the experiment into ``out`` and return all its records.

    ``workers`` defaults to one process per CPU core (at most one per run); under ``torchrun``
    runs go one after another, each trained by all processes with DDP.
    Progress goes to plain callbacks, called on rank 0 only (both default to silence):
    ``report(run_label, phase, done, total, note)`` as a run trains (``phase="train"``) and is
    evaluated (``"eval"``); ``log(message)`` for one-line news (a finished run kept, a run resumed
    from its checkpoint, where the results are). :func:`summary_table` summarizes the records.
    Raises :class:`ExperimentInterrupted` after Ctrl-C/SIGTERM (everything finished is saved).
    ``shard``: run only that part of the (encoding x seed) grid (:mod:`posenc.experiments.shards`);
    ``preset``: the published setup these settings come from, recorded in ``config.json``.
    """
    config.validate()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1 (--threads), got {threads!r}")
    dist = Distributed.from_env()
    torch_device = _device(device, dist)
    out = Path(out)
    _check_writable_folder(out)
    task = config.make_task()
    _check_config(out, config, task)
    for length in (config.train_len, config.eval_len):
        task.check_length(length)
    check_models(config, task, torch_device)
    variants = check_variants(config, task)
    runs = [RunSpec(encoding, seed) for seed in config.seeds for encoding in config.encodings]
    if shard is not None:
        runs = shard.select(runs)
    workers = _worker_count(workers, len(runs), dist)
    is_writer = dist.rank == 0
    report = report if report is not None and is_writer else _quiet_report
    log = log if log is not None and is_writer else _quiet_log
    with folder_lock(out, enabled=is_writer):
        if dist.enabled:
            _init_process_group(torch_device)
        if is_writer:
            out.mkdir(parents=True, exist_ok=True)
            runtime = {
                "workers": workers,
                "threads": threads,
                "world_size": dist.world_size,
                "device": str(torch_device),
            }
            if shard is not None:
                runtime["shard"] = str(shard)
            _write_config(out, config, runtime, task.data_fingerprint(), preset)
        finished = _finished_runs(out, config, task.metric)
        todo = [run for run in runs if run_id_for(config, run) not in finished]
        for run in runs:
            if run not in todo:
                log(f"done already, kept: {run.label}")
        mode = (
            f"DDP world size {dist.world_size}"
            if dist.enabled
            else f"{workers} worker(s) x {threads} thread(s)"
        )
        part = (
            f" (shard {shard}: {len(runs)} of {len(config.seeds) * len(config.encodings)} runs)"
            if shard
            else ""
        )
        log(f"{config.task}: {len(todo)} run(s) to do{part} on {torch_device} with {mode}")

        def on_done(run: RunSpec, records: list[dict[str, Any]]) -> None:
            if is_writer and records:
                per_length, per_run = results_io.split_run_records(records)
                if per_run:  # first: a run whose results.jsonl records are missing is redone anyway
                    results_io.append_records(out / results_io.RUNS_FILE, per_run)
                results_io.append_records(out / "results.jsonl", per_length)

        try:
            with _sigterm_as_interrupt():
                if workers > 1 and len(todo) > 1:
                    _run_in_workers(config, todo, out, workers, threads, torch_device, report, log, on_done)
                else:
                    torch.set_num_threads(threads)
                    for run in todo:
                        checkpoint = out / "checkpoints" / f"{run_id_for(config, run)}.pt"
                        records = train_and_evaluate(
                            config,
                            run,
                            checkpoint,
                            report,
                            rank=dist.rank,
                            world_size=dist.world_size,
                            device=torch_device,
                            log=log,
                        )
                        on_done(run, records)
                if is_writer:
                    _evaluate_variants(
                        config, task, runs, variants, out, finished, torch_device, report, on_done
                    )
            if dist.enabled:
                # Rank 0 evaluates after training while the others return at once; tearing the gloo
                # group down under a peer that is still connected aborts the process
                # ("terminate called without an active exception"), so every rank waits here first.
                torch.distributed.barrier()
        except (Interrupted, KeyboardInterrupt) as err:
            raise ExperimentInterrupted(
                "interrupted; finished runs are saved, unfinished ones resume from their checkpoints"
            ) from err
        finally:
            if dist.enabled and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        rows = set(row_labels(config))
        records = [
            r
            for r in results_io.read_records(out / "results.jsonl")
            if r["encoding"] in rows and r["seed"] in config.seeds
        ]
        if is_writer:
            _write_outputs(out, config, task.metric, records)
            log(f"results: {out / 'results.jsonl'}, {out / 'results.csv'}, {out / 'extrapolation.png'}")
        return records


def _worker_count(workers: int | None, runs: int, dist: Distributed) -> int:
    if dist.enabled:
        if workers not in (None, 1):
            raise ValueError(
                f"workers={workers} cannot be combined with torchrun (WORLD_SIZE={dist.world_size}); drop --workers"
            )
        return 1
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return max(1, min(workers, runs))


def _init_process_group(device: torch.device) -> None:
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _write_outputs(
    out: Path, config: ExperimentConfig, metric: Metric, records: list[dict[str, Any]]
) -> None:
    results_io.write_csv(out / "results.csv", records)
    title = f"{config.task}: trained on lengths <= {config.train_len}, {config.steps} steps"
    unfit = results_io.fit_notes(records, metric, config.train_len, row_labels(config), config.fit_threshold)
    results_io.plot_results(
        out / "extrapolation.png", records, metric, row_labels(config), title, unfit=unfit
    )
    _plot_depths(out, config, records)


def _plot_depths(out: Path, config: ExperimentConfig, records: list[dict[str, Any]]) -> None:
    """``depth.png``: exact match by needle depth and length, for tasks whose records carry depths (passkey)."""
    from ..viz.depth import depth_heatmap_figure, has_depths

    if not has_depths(records):
        return
    title = f"{config.task}: exact match by depth and length (trained on lengths <= {config.train_len})"
    fig = depth_heatmap_figure(records, row_labels(config), title=title)
    tmp = out / ".depth.png.tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, out / "depth.png")


@dataclass(frozen=True)
class SummaryTable:
    """The summary of an experiment as plain text cells (the CLI draws it with Rich)."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    #: Lines under the table: which rows cannot be ranked, and why.
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        widths = [max(len(c), *(len(row[i]) for row in self.rows)) for i, c in enumerate(self.columns)]
        lines = [self.title, "  ".join(c.ljust(w) for c, w in zip(self.columns, widths))]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in self.rows]
        return "\n".join(lines + list(self.notes))


def summary_table(
    config: ExperimentConfig,
    records: list[dict[str, Any]],
    metric: Metric,
    runs: list[dict[str, Any]] | None = None,
) -> SummaryTable:
    """Per encoding: the in-distribution score (mean over lengths ``<= L``) with how many seeds fit
    (``"97.5%, 2/2"``; without fit flags, a seeds column and the plain score), then ``metric`` at the
    training length, mean beyond it (with a 95% Student's t interval across seeds), at
    L+1 and at 2L.

    Fit first: an encoding whose seeds do not all fit their training lengths is marked and listed
    as not ranked (what it does beyond L says nothing about how it generalizes). ``runs``: the
    per-run records (``runs.jsonl``); with ``until_fit`` a note gives the steps each run took.
    Variants (``eval_variants``) are rows of their own; the title says how many seeds it rests on.
    """
    threshold = config.fit_threshold if metric.fits else None
    bounds = (0.0, 1.0) if metric.fits else None  # a fraction of examples: its mean stays in [0, 1]
    rows = results_io.summarize(
        records, metric.name, config.train_len, row_labels(config), threshold, bounds=bounds
    )
    L = config.train_len
    # With fit flags, "fit k/n" also says how many seeds there are (one column less: 80 columns).
    seeds_column = threshold is None
    columns = ["encoding"] + (["seeds", f"<={L}"] if seeds_column else [f"<={L}, fit"])
    columns += [f"at L={L}", f"mean {L + 1}..{config.eval_len}", f"at L+1={L + 1}", f"at 2L={2 * L}"]
    cells, unfit = [], []
    for row in rows:
        iid = _cell(row["iid"], metric)
        if row["fit"] is not None:
            iid += f", {row['fit']}/{row['seeds']}"
            if row["fit"] < row["seeds"]:
                unfit.append(f"{row['encoding']} (in-distribution {_cell(row['iid'], metric)})")
        cells.append(
            [row["encoding"]]
            + ([str(row["seeds"]), iid] if seeds_column else [iid])
            + [_cell(row["at_train"], metric), _with_interval(row["beyond"], row["beyond_interval"], metric)]
            + [_cell(row[key], metric) for key in ("at_next", "at_double")]
        )
    notes = []
    if unfit:
        notes.append(
            f"not ranked, did not fit (every seed must reach {metric.format(config.fit_threshold)} in-distribution): "
            + ", ".join(unfit)
        )
    if any(row["beyond_interval"] is not None for row in rows):
        notes.append(INTERVAL_NOTE + ("; kept inside [0%, 100%]" if metric.fits else ""))
    if any(row["seeds"] == 1 for row in rows):
        notes.append("one seed: no interval; several seeds (--seeds 0,1,2) give a 95% interval across seeds")
    notes += _steps_to_fit_notes(runs or [], config)
    incomplete = missing_runs_note(config.task, config.encodings, config.seeds, records)
    if incomplete:
        notes.append(incomplete)
    title = f"{config.task}: {metric.label} by length (trained on <= {L}, evaluated to {config.eval_len}; "
    title += _seed_count(rows) + ")"
    return SummaryTable(title, columns, cells, tuple(notes))


#: The note under a table whose cells carry intervals: what ``[low, high]`` is.
INTERVAL_NOTE = (
    f"[low, high]: 95% {results_io.INTERVAL_METHOD} interval of the mean across the n seeds "
    "(mean ± t(0.975, n-1) * s / sqrt(n), s their standard deviation)"
)


def _with_interval(value: float | None, interval: tuple[float, float] | None, metric: Metric) -> str:
    """``value [low, high]`` (the 95% Student's t interval across seeds), or the plain cell."""
    if interval is None or value is None:
        return _cell(value, metric)
    return f"{_cell(value, metric)} [{metric.format(interval[0])}, {metric.format(interval[1])}]"


def _cell(value: float | None, metric: Metric) -> str:
    """A table cell: the metric's format, '-' when not measured."""
    if value is None or math.isnan(value):
        return "-"
    return metric.format(value)


def _seed_count(rows: list[results_io.SummaryRow]) -> str:
    """What the table rests on: ``"3 seeds"``, or ``"1-3 seeds"`` when rows differ."""
    counts = sorted({row["seeds"] for row in rows if row["seeds"]})
    if not counts:
        return "no seeds"
    text = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{text} seed{'s' if counts[-1] > 1 else ''}"


def _steps_to_fit_notes(runs: list[dict[str, Any]], config: ExperimentConfig) -> list[str]:
    """With ``until_fit``: one line giving, per encoding, the step at which each seed's fit check
    passed ("-": not within ``steps``), from the per-run records. The check's examples are not the
    evaluation's, so a run can pass it and score just under the threshold on the evaluation."""
    if not config.until_fit:
        return []
    taken: dict[str, list[str]] = {}
    for record in runs:
        if record.get("metric") == results_io.IID and "steps_to_fit" in record and "variant" not in record:
            step = record["steps_to_fit"]
            if record["encoding"] in config.encodings and record.get("seed") in config.seeds:
                taken.setdefault(record["encoding"], []).append("-" if step is None else str(step))
    if not taken:
        return []
    cells = "; ".join(f"{encoding} {', '.join(steps)}" for encoding, steps in taken.items())
    return [
        f"fit check passed at step, per seed (--until-fit, every {config.fit_check_every} steps on examples "
        f"apart from the evaluation's, so a row may pass it and still not fit here; '-': not within "
        f"{config.steps}): {cells}"
    ]


def _evaluate_variants(
    config: ExperimentConfig,
    task: Task,
    runs: list[RunSpec],
    variants: list[Any],
    out: Path,
    finished: set[str],
    device: torch.device,
    report: Reporter,
    on_done: Callable[[RunSpec, list[dict[str, Any]]], None],
) -> None:
    """Evaluate each trained run's checkpoint again under each inference-time variant (no training);
    variants whose records exist already are kept, unless their trained run was (re)trained now."""
    from .variants import evaluate_variant

    for run, variant in variant_runs(runs, variants):
        if variant_run_id(config, run, variant) in finished and run_id_for(config, run) in finished:
            continue
        checkpoint = out / "checkpoints" / f"{run_id_for(config, run)}.pt"
        on_done(run, evaluate_variant(config, task, run, variant, checkpoint, report, device))
