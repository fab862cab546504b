"""The results folder (``--out``): who may write it, what it holds, which runs it has finished.

Folder layout::

    config.json            the settings (a resumed command must match them)
    results.jsonl          one tidy record per (encoding, task, length, seed, metric), atomic
    runs.jsonl             one record per run: its in-distribution score (``metric: "iid"``), fit
                           flag, steps trained (and, with --until-fit, the step it fitted at)
    results.csv            the same records as a table
    checkpoints/<run>.pt   model + optimizer + scheduler + RNG + step of every run
    .posenc.lock           the writer's pid and host, while one writes

The figures (``extrapolation.png``, ``depth.png``) are drawn from the folder by
:mod:`posenc.viz`: the harness writes data only and calls the :data:`FigureWriter` it is given.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...encodings.spec import split_specs
from ..config import ExperimentConfig, RunSpec, run_id_for
from ..runtime.slurm_env import slurm_job_active
from ..tasks.catalog import Metric, Task
from .records import (
    RUN_METRICS,
    atomic_write_text,
    cannot_create_in,
    experiment_settings,
    load_config,
    read_records,
    write_csv,
)

__all__ = [
    "LOCK_NAME",
    "FigureWriter",
    "check_folder_settings",
    "check_writable_folder",
    "checkpoint_path",
    "finished_runs",
    "folder_lock",
    "lock_owner_alive",
    "lock_text",
    "reproduce_command",
    "write_config",
    "write_outputs",
]

#: ``figures(folder) -> paths written``: draws a results folder's figures from what it holds
#: (:func:`posenc.viz.folder.write_figures`); the command line passes it to the harness.
FigureWriter = Callable[[Path], list[Path]]

LOCK_NAME = ".posenc.lock"


def checkpoint_path(out: Path, config: ExperimentConfig, run: RunSpec) -> Path:
    """``out/checkpoints/<run id>.pt``: where ``run`` saves and resumes."""
    return out / "checkpoints" / f"{run_id_for(config, run)}.pt"


def check_writable_folder(out: Path) -> None:
    """``out`` is a folder this process may create or write into (checked before writing anything)."""
    existing = out
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        what = "is" if existing == out else f"is inside {existing}, which is"
        raise ValueError(f"--out {out} {what} not a folder; give a folder path")
    problem = cannot_create_in(existing)
    if problem:
        raise ValueError(f"--out {out}: {problem}; give a writable folder")


def check_folder_settings(out: Path, config: ExperimentConfig, task: Task) -> None:
    """Refuse to mix results of different settings, or of different data, in one folder."""
    path = out / "config.json"
    if not path.exists():
        return
    saved_config = load_config(out)
    _check_data(path, saved_config.get("data"), task.data_fingerprint())
    saved = experiment_settings(saved_config)
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


@contextmanager
def folder_lock(out: Path, *, enabled: bool = True):
    """Hold ``out/.posenc.lock`` (this process's pid and host, and its Slurm job inside one) while
    writing into ``out``.

    A second writer gets a ``ValueError`` naming the owner; a lock left by a process that no longer
    runs is taken over (:func:`lock_owner_alive`: killed on this host, or its Slurm job ended, e.g.
    with its node). ``enabled=False`` (the non-writing DDP ranks) does nothing.
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
    me = lock_text()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = path.read_text(encoding="utf-8").strip() if path.exists() else ""
            if lock_owner_alive(owner):
                raise ValueError(
                    f"{out} is being written by another posenc process ({owner}; lock file {path}): "
                    "wait for it to finish, or use another --out (a process on another host is taken to be alive "
                    "unless the lock names a Slurm job that squeue says has ended: if it is gone, delete the lock file)"
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


def lock_text() -> str:
    """What a lock records of its writer: ``"pid host"``, and inside a Slurm job
    ``"pid host slurm=JOB.RESTARTS"`` (``SLURM_JOB_ID``, ``SLURM_RESTART_COUNT``), so that a
    writer on another node can be known to be gone when its job has ended."""
    text = f"{os.getpid()} {socket.gethostname()}"
    job = os.environ.get("SLURM_JOB_ID", "")
    if job.isdigit():
        text += f" slurm={job}.{_restart_count()}"
    return text


def _restart_count() -> int:
    """How many times Slurm requeued this job (``SLURM_RESTART_COUNT``; 0 when unset)."""
    count = os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(count) if count.isdigit() else 0


def lock_owner_alive(owner: str) -> bool:
    """Whether the writer a lock names (:func:`lock_text`) still runs.

    On this host: whether its pid runs. On another host: alive, unless the lock names a Slurm job
    and that job has ended (``squeue`` shows it finished, or no longer knows it), or the job is
    this one requeued (a job runs once at a time: the lock is its earlier run's). When ``squeue``
    cannot answer, the writer is taken to be alive: two writers in one folder are worse than a
    refusal that names the lock file."""
    parts = owner.split()
    if len(parts) not in (2, 3) or not parts[0].isdigit():
        return False
    pid, host = int(parts[0]), parts[1]
    if host != socket.gethostname():
        return _slurm_job_alive(parts[2]) if len(parts) == 3 else True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _slurm_job_alive(field: str) -> bool:
    """``slurm=JOB.RESTARTS`` from a lock: False when that run of the job has ended."""
    job, _, restarts = field.removeprefix("slurm=").partition(".")
    if not field.startswith("slurm=") or not job.isdigit() or not restarts.isdigit():
        return True  # not a lock this version wrote: cannot tell
    if job == os.environ.get("SLURM_JOB_ID") and int(restarts) < _restart_count():
        return False  # this job, requeued: the lock is its earlier run's

    active = slurm_job_active(job)
    return True if active is None else active


def reproduce_command(
    config: ExperimentConfig, out: str | Path, shard: str | None = None
) -> tuple[str, list[str]]:
    """``(command, caveats)``: the ``posenc extrapolate`` command line that gives ``config`` (every
    setting that differs from the command's default, as its option), writing into ``out``, and
    the settings no option sets (``warmup``, ...: set from Python), which it cannot reproduce.

    The options come from the fields' metadata, as the command's own (``posenc.cli.experiments``):
    a list is comma-separated, a renamed option (``--eval-positions``) keeps its name, a boolean
    is ``--name`` or ``--no-name``."""
    import dataclasses
    import shlex

    defaults = ExperimentConfig()
    args = ["posenc", "extrapolate"]
    caveats = []
    for field in dataclasses.fields(ExperimentConfig):
        meta, value = field.metadata, getattr(config, field.name)
        default = getattr(defaults, field.name)
        if field.name == "eval_batch":  # the command sets it from --eval-examples
            default = min(config.eval_examples, defaults.eval_batch)
        if field.name == "randomize_eval_positions":  # the command's default: "random"
            if config.randomize_positions is not None and not value:
                args += ["--eval-positions", "contiguous"]
            continue
        if value == default:
            continue
        if meta.get("option", True) is False:
            caveats.append(f"{field.name}={value!r} (no command-line option; set from Python)")
            continue
        flag = "--" + (meta["option"] if isinstance(meta.get("option"), str) else field.name).replace(
            "_", "-"
        )
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            text = ",".join(map(str, value))
            if field.name == "encodings" and split_specs(text) != value:
                caveats.append(f"encodings {value!r} do not survive a comma-separated list")
            args += [flag, text]
        else:
            args += [flag, str(value)]
    if shard is not None:
        args += ["--shard", str(shard)]
    args += ["--out", str(out)]
    return shlex.join(args), caveats


def write_config(
    out: Path,
    config: ExperimentConfig,
    runtime: dict[str, Any],
    data: dict[str, str] | None,
    preset: str | None = None,
) -> None:
    command, caveats = reproduce_command(config, out, runtime.get("shard"))
    # The command that gives these settings (a preset's folder: its settings spelt out as options).
    runtime = {**runtime, "command": command, **({"command_caveats": caveats} if caveats else {})}
    payload: dict[str, Any] = {"experiment": config.to_dict(), "runtime": runtime}
    if data is not None:
        payload["data"] = data  # the corpus's path and sha256: a rerun on edited data is refused
    if preset is not None:
        payload["preset"] = preset  # the report puts the published numbers beside these results
    atomic_write_text(out / "config.json", json.dumps(payload, indent=2) + "\n")


def finished_runs(out: Path, config: ExperimentConfig, metric: Metric) -> set[str]:
    """Runs whose records cover every evaluated length of every metric (a run with some records
    missing is redone). The metrics are the task's own and any other the folder's runs recorded."""
    seen: dict[str, set[tuple[str, int]]] = {}
    metrics = {metric.name}
    for record in read_records(out / "results.jsonl"):
        if record.get("metric") in RUN_METRICS:
            continue  # one per run, at the training length (folders written before it have none)
        seen.setdefault(record["run"], set()).add((record.get("metric"), record["length"]))
        metrics.add(record.get("metric"))
    wanted = {(name, length) for name in metrics for length in range(1, config.eval_len + 1)}
    return {run for run, pairs in seen.items() if wanted <= pairs}


def write_outputs(out: Path, records: list[dict[str, Any]], figures: FigureWriter | None) -> list[Path]:
    """``results.csv`` from ``records``, then the figures drawn from the folder (none without a
    ``figures`` writer); returns the files written."""
    write_csv(out / "results.csv", records)
    return [out / "results.csv", *(figures(out) if figures is not None else [])]
