"""Worker processes: on CPU, ``workers`` spawned processes with ``threads`` threads each train
different runs side by side (two single-threaded jobs on two cores beat one job with two threads for
models this small).

A worker exits by itself when the main process is gone (a thread polls the parent pid), so a
SIGKILL of the command leaves no orphan; a worker that dies is reported as one line naming it
(:class:`WorkerDied`); Ctrl-C and SIGTERM stop every worker at its next step with a checkpoint.
Progress and log lines travel back through a queue to the caller's callbacks.

A worker killed while it holds one of the pool's cross-process locks (the one an idle worker holds
while it waits for its next job, a queue's writer lock) leaves that lock held forever, and every
other process that takes it blocks for good. So the stop request is a lock-free byte in shared
memory, and once a worker has died the survivors are told, through another such byte, to exit as
soon as their current job has saved its checkpoint instead of asking the pool for more work.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import queue as queue_module
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..results.folders import checkpoint_path
from ..runtime.distributed import Distributed
from ..train import ExperimentConfig, Interrupted, Reporter, RunSpec, train_and_evaluate

__all__ = [
    "PARENT_POLL_SECONDS",
    "ExperimentInterrupted",
    "Log",
    "OnDone",
    "WorkerDied",
    "run_in_workers",
    "sigterm_as_interrupt",
    "worker_count",
]

#: ``log(message)``: one line of news (a run kept or resumed, where the results are).
Log = Callable[[str], None]

#: ``on_done(run, records)``: a run finished with these records.
OnDone = Callable[[RunSpec, list[dict[str, Any]]], None]


class ExperimentInterrupted(Exception):
    """The experiment stopped early; finished records and checkpoints are saved."""


class WorkerDied(ExperimentInterrupted):
    """A worker process ended abruptly (killed, out of memory); finished records are saved."""


def worker_count(workers: int | None, runs: int, dist: Distributed) -> int:
    """How many worker processes train ``runs`` runs: ``workers`` (default one per CPU core), at
    most one per run; one under ``torchrun``, where every process trains each run together."""
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


_WORKER_QUEUE: Any = None
_WORKER_FLAGS: _Flags | None = None
_IN_JOB = False  # this worker runs a job now: it must not exit before the job's checkpoint is saved


class _Flags:
    """Requests from the main process to its workers, as lock-free bytes in shared memory (a lock a
    killed worker held would never be released; see the module docstring).

    ``stop``: every job stops at its next step with a checkpoint (Ctrl-C, SIGTERM, a death).
    ``abandoned``: a worker died and the pool is broken; a worker exits once it is between jobs.
    """

    def __init__(self, context: Any) -> None:
        self._stop = context.RawValue(ctypes.c_bool, False)
        self._abandoned = context.RawValue(ctypes.c_bool, False)

    def stop(self) -> None:
        self._stop.value = True

    def should_stop(self) -> bool:
        return bool(self._stop.value)

    def abandon(self) -> None:
        self._stop.value = True
        self._abandoned.value = True

    def abandoned(self) -> bool:
        return bool(self._abandoned.value)


#: How often a worker checks that the main process still runs (seconds).
PARENT_POLL_SECONDS = 0.5


def _init_worker(threads: int, progress_queue: Any, flags: _Flags) -> None:
    global _WORKER_QUEUE, _WORKER_FLAGS
    torch.set_num_threads(threads)
    _WORKER_QUEUE, _WORKER_FLAGS = progress_queue, flags
    # Idle workers ignore Ctrl-C; a running job turns it into a checkpoint and a clean stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_when_orphaned_or_abandoned(os.getppid(), flags)


def _exit_when_orphaned_or_abandoned(parent: int, flags: _Flags) -> None:
    """Exit this worker as soon as its parent is gone (killed with SIGKILL, no chance to clean up),
    or, once the main process has abandoned the pool (a worker died), as soon as no job runs here.

    A worker blocked on the pool's pipe (or on a lock a dead worker held) would otherwise live
    forever; nothing it does after the parent died or the pool broke can reach the results (the
    parent writes them, from the futures a broken pool no longer fills), and its checkpoints are
    atomic, so the next command resumes from the last one.
    """

    def watch() -> None:
        while os.getppid() == parent:
            if flags.abandoned() and not _IN_JOB:
                os._exit(0)
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
    global _IN_JOB
    assert _WORKER_FLAGS is not None, "_init_worker runs first in every worker"
    _IN_JOB = True
    try:
        return train_and_evaluate(
            config,
            run,
            Path(checkpoint),
            _queue_report,
            device=torch.device(device),
            log=_queue_log,
            should_stop=_WORKER_FLAGS.should_stop,
        )
    finally:
        _IN_JOB = False


@contextmanager
def sigterm_as_interrupt():
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


def run_in_workers(
    config: ExperimentConfig,
    runs: list[RunSpec],
    out: Path,
    workers: int,
    threads: int,
    device: torch.device,
    report: Reporter,
    log: Log,
    on_done: OnDone,
) -> None:
    """Train ``runs`` in ``workers`` spawned processes of ``threads`` threads each, handing each
    run's records to ``on_done`` as it finishes and the workers' progress to ``report`` and ``log``.

    Ctrl-C (or SIGTERM, or a worker stopped alone) stops every worker at its next step with a
    checkpoint and raises :class:`ExperimentInterrupted`; a worker that dies raises
    :class:`WorkerDied` naming it. Finished runs are handed over either way.
    """
    context = multiprocessing.get_context("spawn")
    progress_queue, flags = context.Queue(), _Flags(context)
    executor = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(threads, progress_queue, flags)
    )
    futures: dict[Future, RunSpec] = {}
    handled: set[Future] = set()
    try:
        for run in runs:
            checkpoint = str(checkpoint_path(out, config, run))
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
                    notice = _death_notice(processes)  # before the survivors end, so it names the dead
                    flags.abandon()
                    _wait_for_survivors(processes, log)
                    raise WorkerDied(notice) from err
        _drain(progress_queue, report, log)
    except KeyboardInterrupt:
        flags.stop()  # running jobs checkpoint and stop; queued ones stop before starting
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


#: After a death, how long the survivors may take to checkpoint before the wait is announced.
SURVIVOR_NOTICE_SECONDS = 5.0


def _wait_for_survivors(processes: list[Any], log: Log) -> None:
    """Wait until the workers that outlived a dead one have saved their checkpoints and exited.

    Each stops at its next step (the pool's SIGTERM and the stop flag both ask it to), so the wait
    is at most one training step; a longer one is announced, and Ctrl-C ends it by killing them
    (their runs then resume from the checkpoint before).
    """
    alive = [p for p in processes if p.exitcode is None]
    announced = False
    started = time.monotonic()
    try:
        while alive:
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.5)
            alive = [p for p in alive if p.exitcode is None]
            if alive and not announced and time.monotonic() - started > SURVIVOR_NOTICE_SECONDS:
                pids = ", ".join(str(p.pid) for p in alive)
                log(f"waiting for worker(s) {pids} to save a checkpoint and stop (Ctrl-C stops them now)")
                announced = True
    except KeyboardInterrupt:
        for process in alive:
            process.kill()


def _collect_finished(futures: dict[Future, RunSpec], on_done: OnDone) -> None:
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
