"""Slurm: a grid as one job array plus a merge job, ``--shard slurm``, and one run across nodes.

Three pieces, each reading only what Slurm sets (see ``docs/architecture.md §8.1``):

* :func:`shard_from_slurm` (``posenc extrapolate --shard slurm``): the shard ``i/n`` of an array
  task, from ``SLURM_ARRAY_TASK_ID`` and the array's size (``SLURM_ARRAY_TASK_COUNT``, checked
  against ``SLURM_ARRAY_TASK_MIN``/``MAX``/``STEP``): task ids ``min, min+step, ...`` are shards
  ``0, 1, ...``. Outside an array task, or in a sparse array (``--array=0,3``), a ``ValueError``
  names the variable.
* :func:`submit` (``posenc submit``): writes two ``sbatch`` scripts into ``OUT/slurm/`` and
  submits them: a job array whose task ``i`` trains shard ``i/n`` of the grid into
  ``OUT/shards/<i>of<n>`` (``posenc extrapolate --shard $SLURM_ARRAY_TASK_ID/n``), and a merge
  job (``--dependency=afterok:<array>``) that merges the shard folders into ``OUT``. Run again,
  the same command submits only the shards whose runs ``OUT`` and the shard folders lack; a
  shard whose task died resumes from its checkpoints (the shard folder is the one it wrote). The
  array job is recorded as soon as it is queued, so a rerun after the merge's ``sbatch`` failed
  submits the merge job alone, after that array.
  With ``preset`` (``posenc submit --preset NAME``) each array task runs its shard of every task
  of the preset (``extrapolate --preset NAME --shard i/n`` writes ``OUT/shards/<i>of<n>/<task>``)
  and the merge job merges each task's shard folders into ``OUT/<task>``, the layout of
  ``posenc extrapolate --preset NAME --out OUT``.
  What it splits is a :class:`Grid`: a trained grid (:class:`Part`), or a context-extension
  study's (variant, length) units (:class:`.study_plan.StudyGrid`, ``posenc submit --hf-model``).
* :func:`rendezvous_from_slurm` (``posenc slurm-torchrun``, one agent per Slurm task of an
  ``srun``): ``torchrun``'s static rendezvous from ``SLURM_JOB_NODELIST`` (its first node, by
  ``scontrol show hostnames``, at its ``NodeAddr``), ``SLURM_NTASKS`` (the number of agents),
  ``SLURM_PROCID`` (this agent's rank) and ``SLURM_JOB_ID`` (the port), so that one run trains
  with DDP across Slurm nodes (gloo on CPU, nccl on GPU, :mod:`..runtime.distributed`).

Scripts rather than ``submitit``: the scripts are plain files a user can read, edit and resubmit
by hand, they need no dependency beyond ``sbatch`` on ``PATH``, and each array task runs the
ordinary ``posenc extrapolate`` command (so resume, the folder lock and merge are the ones tested
without Slurm).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..grid import (
    Grid,
    Part,
    array_ranges,
    finished_in,
    merged_folder,
    missing_shards,
    missing_units,
    shard_folder,
)
from ..plan import plan_runs
from ..results.folders import check_writable_folder
from ..runtime.slurm_env import (
    Rendezvous,
    Runner,
    rendezvous_from_slurm,
    run_slurm_command,
    slurm_job_active,
)
from ..train import ExperimentConfig, RunSpec
from .sharding import shard_from_slurm

__all__ = [
    "Grid",
    "Part",
    "Rendezvous",
    "Runner",
    "SlurmOptions",
    "Submission",
    "array_ranges",
    "missing_shards",
    "missing_units",
    "rendezvous_from_slurm",
    "run_slurm_command",
    "shard_folder",
    "shard_from_slurm",
    "slurm_job_active",
    "submit",
]


# ---------------------------------------------------------------------------- submit


@dataclass(frozen=True)
class SlurmOptions:
    """``sbatch`` options for the array tasks (the merge job takes partition, time, account, mem)."""

    partition: str | None = None
    time: str | None = None
    #: CPUs per array task (``--cpus-per-task``); also the task's ``--workers`` on one node.
    cpus: int | None = None
    mem: str | None = None
    #: GPUs per node (``--gpus-per-node``), e.g. ``"1"`` or ``"a100:2"``.
    gpus: str | None = None
    account: str | None = None
    #: Nodes per array task: more than one trains each run with DDP across them (``slurm-torchrun``).
    nodes: int = 1
    #: Processes per node under ``torchrun`` (one per GPU); more than one uses ``slurm-torchrun``.
    nproc_per_node: int = 1

    def __post_init__(self) -> None:
        for name in ("cpus", "nodes", "nproc_per_node"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        for name in ("partition", "time", "mem", "gpus", "account"):
            value = getattr(self, name)
            # sbatch reads a #SBATCH line as words: '#' starts a comment, quotes and '\\' are its own.
            if value is not None and (not value.strip() or any(c.isspace() or c in "#'\"\\" for c in value)):
                raise ValueError(
                    f"--{name} must be one word without spaces, quotes, backslashes or '#' (as sbatch reads "
                    f"it in a #SBATCH line), got {value!r}"
                )

    @property
    def distributed(self) -> bool:
        """Each run trains with DDP under ``torchrun`` (several nodes or processes per node)."""
        return self.nodes > 1 or self.nproc_per_node > 1

    def array_lines(self) -> list[str]:
        lines = self._common()
        if self.cpus is not None:
            lines.append(f"--cpus-per-task={self.cpus}")
        if self.gpus is not None:
            lines.append(f"--gpus-per-node={self.gpus}")
        if self.distributed:
            lines += [f"--nodes={self.nodes}", "--ntasks-per-node=1"]
        return lines

    def merge_lines(self) -> list[str]:
        return self._common()

    def _common(self) -> list[str]:
        pairs = [("partition", self.partition), ("time", self.time), ("mem", self.mem)]
        pairs.append(("account", self.account))
        return [f"--{name}={value}" for name, value in pairs if value is not None]


@dataclass(frozen=True)
class Submission:
    """What :func:`submit` did: the job ids (None: not submitted), the shards and runs it covers."""

    out: Path
    #: Array tasks (shards) submitted, of ``count``.
    shards: list[int]
    count: int
    #: Runs of the grid that no folder had finished.
    missing: list[RunSpec]
    array_job: str | None
    merge_job: str | None
    array_script: Path
    merge_script: Path
    commands: list[list[str]] = field(default_factory=list)
    #: ``array_job`` was queued by an earlier ``posenc submit`` whose merge job failed to submit;
    #: this one submitted that merge job alone (``shards`` and ``missing``: what the array still lacks).
    earlier_array: bool = False

    @property
    def complete(self) -> bool:
        """Nothing to do: every run is finished and merged into ``out``."""
        return self.array_job is None and self.merge_job is None


SUBMIT_FILE = "submit.json"


def _submitted_settings(parts: Sequence[Grid], preset: str | None) -> dict[str, Any]:
    """What a rerun must match: the config's fields, or a preset's name and each task's fields
    (``reverse.lr``), so that a difference names the field."""
    if preset is None:
        return parts[0].settings()
    settings: dict[str, Any] = {"preset": preset}
    for part in parts:
        settings.update({f"{part.inside}.{key}": value for key, value in part.settings().items()})
    return settings


def _check_same_submission(record: Path, settings: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """The earlier submissions into this folder (``{"array": id, "merge": id}`` each, oldest
    first); ``ValueError`` when they were of other settings or another array size (naming the field)."""
    if not record.is_file():
        return []
    try:
        earlier = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{record} is not readable JSON ({err}); delete it to start the folder's jobs afresh"
        ) from err
    saved, now = earlier.get("experiment", {}), settings
    different = [k for k in sorted(saved.keys() | now.keys()) if saved.get(k) != now.get(k)]
    if different:
        details = ", ".join(f"{k}: {saved.get(k)!r} there vs {now.get(k)!r} now" for k in different)
        raise ValueError(
            f"{record.parent.parent} was submitted with other settings ({details}); rerun the same "
            "command to resume it, or use another --out"
        )
    if earlier.get("array_size") != count:
        raise ValueError(
            f"{record.parent.parent} was submitted as {earlier.get('array_size')} array tasks, now "
            f"--array-size {count}: the shards would differ; rerun with --array-size "
            f"{earlier.get('array_size')}, or use another --out"
        )
    return list(earlier.get("jobs", []))


def _array_awaiting_merge(entries: list[dict[str, Any]], queued: list[str]) -> str | None:
    """The array job of the last submission when it alone is still queued and its merge job was
    never submitted (that ``sbatch`` failed): a rerun then submits the merge job alone, after it,
    rather than a second array whose tasks would write the same shard folders."""
    last = entries[-1] if entries else {}
    array = last.get("array")
    return str(array) if array and not last.get("merge") and queued == [str(array)] else None


def _still_queued(jobs: list[str], run: Runner) -> list[str]:
    """Those of ``jobs`` (array or plain job ids) that ``squeue`` still lists."""
    if not jobs:
        return []
    listed = set(run(["squeue", "--me", "--noheader", "--format=%F"]).split())
    return [job for job in jobs if job in listed]


def _script(lines: list[str], body: list[str]) -> str:
    header = ["#!/bin/bash", *(f"#SBATCH {line}" for line in lines)]
    return "\n".join([*header, "set -euo pipefail", *body]) + "\n"


def _directive(option: str, value: str) -> str:
    """``--option="value"``, quoted as sbatch splits a ``#SBATCH`` line into words (``_get_argument``
    of ``src/sbatch/opt.c``): inside double quotes spaces, ``'`` and ``#`` are kept, and a
    backslash keeps the next character, so ``"`` and ``\\`` get one."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'--{option}="{escaped}"'


def _log_file(folder: Path, name: str) -> str:
    """``folder/name`` as an ``--output`` file name pattern (``name`` holds ``%A``, ``%a`` or
    ``%j``): Slurm reads ``%%`` as ``%``, so a ``%`` of the folder is doubled."""
    return str(folder).replace("%", "%%") + "/" + name


def _check_out_path(out: Path) -> None:
    """Refuse an ``out`` whose path the ``#SBATCH`` lines (its job name and log files) cannot carry,
    before anything is written; the error names the character, why, and what to do."""
    text = str(out)
    for char in text:
        if ord(char) < 32 or ord(char) == 127:
            why = "a control character: a #SBATCH line is one line of the script"
        elif char == "\\":
            why = (
                "a backslash: in the --output log file name Slurm drops it and expands no %A/%a, so "
                "the tasks would log to another file"
            )
        else:
            continue
        raise ValueError(f"--out {text!r} holds {char!r}, {why}; choose an --out path without it")
    word = next((word for word in ("hetjob", "packjob") if word in text.lower()), None)
    if word is not None:
        raise ValueError(
            f"--out {text!r} holds the word {word!r}, which sbatch reads in a #SBATCH line as the "
            "separator of a heterogeneous job, quoted or not; choose an --out path without it"
        )


def submit(
    config: ExperimentConfig | Sequence[ExperimentConfig] | Grid,
    out: str | Path,
    extrapolate_args: Sequence[str],
    *,
    preset: str | None = None,
    array_size: int | None = None,
    options: SlurmOptions | None = None,
    workers: int | None = None,
    python: str = sys.executable,
    run: Runner = run_slurm_command,
    dry_run: bool = False,
) -> Submission:
    """Submit the grid of ``config`` as one Slurm job array and a merge job into ``out``.

    ``extrapolate_args``: the ``posenc extrapolate`` options of ``config`` (without ``--out``,
    ``--shard``, ``--workers``), as each array task runs them. ``array_size``: the number of
    shards (default: one per run of the grid; a rerun must keep it). Writes
    ``out/slurm/array.sh`` and ``out/slurm/merge.sh``, submits the array for the shards that
    lack runs (``sbatch --array=<ids>``), then the merge job with
    ``--dependency=afterok:<array> --kill-on-invalid-dep=yes``, and records each job in
    ``out/slurm/submit.json`` as soon as it is queued. With every run finished but not merged it
    submits the merge job alone; with everything merged, nothing. Refused (``ValueError``) while an
    earlier submission into ``out`` is still queued or running, or when ``out`` was submitted with
    other settings; but when the earlier array alone is queued because its merge job's ``sbatch``
    failed, the rerun submits that merge job alone, after the array (``Submission.earlier_array``).
    ``dry_run``: write the scripts, submit nothing.

    ``config`` may also be any :class:`Grid`, such as a context-extension study's
    (:func:`.study_plan.study_grid`, ``posenc submit --hf-model M --task text``): its units are
    split the same way, and ``extrapolate_args`` hold ``--hf-model M``.

    ``preset``: ``config`` is the preset's configs, one per task (:func:`.presets.apply_preset`),
    and ``extrapolate_args`` hold ``--preset NAME``. Array task ``i`` then trains shard ``i/n`` of
    every task into ``out/shards/<i>of<n>/<task>`` and the merge job writes ``out/<task>``.
    """
    options = options or SlurmOptions()
    out = Path(out).absolute()
    _check_out_path(out)
    parts = _parts(config, preset)
    count = _check_grid_options(parts, array_size, options, workers)
    check_writable_folder(out)
    for part in parts:
        part.check(merged_folder(out, part))
    folder = out / "slurm"
    settings = _submitted_settings(parts, preset)
    awaiting = _earlier_array(out, folder / SUBMIT_FILE, settings, count, run, dry_run)
    missing, shards, merged = _what_is_left(parts, out, count)

    launch, task_args = _array_command(parts, out, count, extrapolate_args, options, workers, python)
    logs = folder / "logs"
    array_script = folder / "array.sh"
    merge_script = folder / "merge.sh"
    array_text = _array_script_text(out, count, preset, options, logs, [*launch, *task_args])
    merge_text = _script(
        [
            _directive("job-name", f"posenc-{out.name}-merge"),
            _directive("output", _log_file(logs, "merge-%j.out")),
            *options.merge_lines(),
        ],
        _merge_lines(parts, out, count, python, preset),
    )
    logs.mkdir(parents=True, exist_ok=True)
    for path, text in ((array_script, array_text), (merge_script, merge_text)):
        path.write_text(text, encoding="utf-8")
        path.chmod(0o755)

    scripts = (array_script, merge_script)
    ledger = _Ledger(folder / SUBMIT_FILE, settings, count)
    array_job, merge_job, commands = _queue(shards, merged, awaiting, scripts, ledger, run, dry_run)
    return Submission(
        out, shards, count, missing, array_job, merge_job, *scripts, commands, earlier_array=bool(awaiting)
    )


def _check_grid_options(
    parts: list[Grid], array_size: int | None, options: SlurmOptions, workers: int | None
) -> int:
    """The number of shards (``array_size``, default one per unit of the grid), once it and the
    worker options are known to fit the grid."""
    size = parts[0].size()
    count = size if array_size is None else array_size
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= size:
        what = "runs (encodings x seeds)" if parts[0].takes_workers else "units (variants x lengths)"
        raise ValueError(f"--array-size must be between 1 and the grid's {size} {what}, got {array_size!r}")
    if not parts[0].takes_workers and (workers is not None or options.distributed):
        raise ValueError(
            "--workers, --nodes and --nproc-per-node apply to trained grids; each array task of a study "
            "runs one process (give it CPUs with --cpus, its torch threads)"
        )
    if options.distributed and workers not in (None, 1):
        raise ValueError(
            "--workers cannot be combined with --nodes/--nproc-per-node (torchrun trains one run)"
        )
    return count


def _earlier_array(
    out: Path, record: Path, settings: dict[str, Any], count: int, run: Runner, dry_run: bool
) -> str | None:
    """The array job of an earlier submission into ``out`` that still waits for its merge job
    (None if none); refused while any other job of an earlier submission is queued or running."""
    entries = _check_same_submission(record, settings, count)
    jobs = [str(entry[key]) for entry in entries for key in ("array", "merge") if entry.get(key)]
    queued = [] if dry_run else _still_queued(jobs, run)
    awaiting = _array_awaiting_merge(entries, queued)
    if queued and awaiting is None:
        raise ValueError(
            f"{out}: job(s) {', '.join(queued)} of an earlier posenc submit are still queued or running "
            "(squeue); wait for them to end (or scancel them), then run this command again"
        )
    return awaiting


def _what_is_left(parts: list[Grid], out: Path, count: int) -> tuple[list[Any], list[int], bool]:
    """The units ``out`` and its shard folders lack, the shards that hold them, and whether every
    experiment is merged already."""
    missing: list[Any] = []
    lacking: set[int] = set()
    for part in parts:
        units, indices = missing_units(part, out, count)
        missing += units
        lacking.update(indices)
    merged = all(finished_in(part, merged_folder(out, part)) for part in parts)
    return missing, sorted(lacking), merged


def _array_command(
    parts: list[Grid],
    out: Path,
    count: int,
    extrapolate_args: Sequence[str],
    options: SlurmOptions,
    workers: int | None,
    python: str,
) -> tuple[list[str], list[str]]:
    """The array task's launcher (``posenc extrapolate``, or ``srun ... slurm-torchrun`` across
    nodes) and its arguments, shell-quoted, for shard ``"$i"``."""
    args = [shlex.quote(arg) for arg in extrapolate_args]
    shard_out = shlex.quote(str(out / "shards")) + f'/"$i"of{count}'
    task_args = [*args, "--shard", f'"$i"/{count}', "--out", shard_out, "--no-progress"]
    if options.distributed:
        launch = ["srun", shlex.quote(python), "-m", "posenc", "slurm-torchrun"]
        launch += [f"--nproc-per-node={options.nproc_per_node}", "--", "extrapolate"]
    else:
        launch = [shlex.quote(python), "-m", "posenc", "extrapolate"]
        if parts[0].takes_workers:
            task_args += ["--workers", str(workers or options.cpus or 1)]
        elif options.cpus is not None and "--threads" not in extrapolate_args:
            task_args += ["--threads", str(options.cpus)]  # one process: every CPU of the task is its own
    return launch, task_args


def _array_script_text(
    out: Path, count: int, preset: str | None, options: SlurmOptions, logs: Path, command: list[str]
) -> str:
    """``array.sh``: its ``#SBATCH`` lines, then ``command`` run for shard ``$SLURM_ARRAY_TASK_ID``."""
    writes = f"{out}/shards/<i>of{count}" + ("/<task>" if preset else "")
    return _script(
        [
            _directive("job-name", f"posenc-{out.name}"),
            _directive("output", _log_file(logs, "array-%A_%a.out")),
            *options.array_lines(),
        ],
        [
            f"# Written by posenc submit: array task i runs shard i/{count} of the grid into {writes};",
            "# rerunning a task resumes its shard (finished runs kept, others from their checkpoints).",
            'i="$SLURM_ARRAY_TASK_ID"',
            " ".join(["exec", *command]),
        ],
    )


def _queue(
    shards: list[int],
    merged: bool,
    awaiting: str | None,
    scripts: tuple[Path, Path],
    ledger: _Ledger,
    run: Runner,
    dry_run: bool,
) -> tuple[str | None, str | None, list[list[str]]]:
    """Submit what is left (the array for ``shards``, then the merge job unless ``merged``; with an
    ``awaiting`` array job, the merge job alone, after it), recording each job in ``ledger`` as soon
    as it is queued. Returns the array and merge job ids and the ``sbatch`` commands."""
    array_script, merge_script = scripts
    if awaiting is not None:
        merge_command = _merge_command(merge_script, awaiting)
        merge_job = _submit_merge(merge_command, awaiting, ledger.path, run)
        ledger.add({"merge": merge_job}, amend=True)
        return awaiting, merge_job, [merge_command]
    commands: list[list[str]] = []
    array_job = merge_job = None
    if shards:
        commands.append(["sbatch", "--parsable", f"--array={array_ranges(shards)}", str(array_script)])
        if not dry_run:
            array_job = _job_id(commands[-1], run)
            # Recorded at once: should the merge's sbatch fail, the rerun must see this array queued
            # and submit the merge job alone, not a second array writing the same shard folders.
            ledger.add({"array": array_job, "merge": None})
    if shards or not merged:
        commands.append(_merge_command(merge_script, array_job or ("<array job id>" if shards else None)))
        if not dry_run:
            merge_job = _submit_merge(commands[-1], array_job, ledger.path, run)
            ledger.add({"array": array_job, "merge": merge_job}, amend=bool(array_job))
    return array_job, merge_job, commands


def _parts(config: ExperimentConfig | Sequence[ExperimentConfig] | Grid, preset: str | None) -> list[Grid]:
    """The experiments of a submission: one plain grid (or a study's :class:`Grid`), or one per
    task of a preset (each in ``OUT/<task>``); a preset's tasks must share the grid, since one array
    task runs shard ``i`` of each."""
    if preset is None and not isinstance(config, (ExperimentConfig, Sequence)):
        return [config]
    if preset is None:
        if not isinstance(config, ExperimentConfig):
            raise ValueError("several configs are one per task of a preset: pass preset=NAME")
        return [Part(config)]
    if not isinstance(config, (ExperimentConfig, Sequence)):
        raise ValueError(
            f"preset {preset}: takes the preset's configs, one per task, not a {type(config).__name__}"
        )
    configs = [config] if isinstance(config, ExperimentConfig) else list(config)
    tasks = [one.task for one in configs]
    if not configs or len(set(tasks)) != len(tasks):
        raise ValueError(f"preset {preset}: need one config per task, got tasks {tasks}")
    grids = {tuple(plan_runs(one)) for one in configs}
    if len(grids) != 1:
        raise ValueError(
            f"preset {preset}: its tasks' (encoding x seed) grids differ; one array cannot run them"
        )
    return [Part(one, one.task) for one in configs]


def _merge_lines(parts: Sequence[Grid], out: Path, count: int, python: str, preset: str | None) -> list[str]:
    """The merge job's body: per experiment, ``posenc merge`` of what its folder holds already and
    the shard folders that exist into that folder."""
    lines = [
        f"# Written by posenc submit: merges the shard folders (and what {out} holds already) into it."
        if preset is None
        else f"# Written by posenc submit: merges each task's shard folders (and what {out}/<task> holds already) into {out}/<task>."
    ]
    shard_list = " ".join(str(index) for index in range(count))
    for part in parts:
        target = shlex.quote(str(merged_folder(out, part)))
        shard = (
            shlex.quote(str(out / "shards"))
            + f'/"$i"of{count}'
            + ("/" + shlex.quote(part.inside) if part.inside else "")
        )
        merge = f'{shlex.quote(python)} -m posenc merge {target} "${{folders[@]}}"'
        lines += [
            "folders=()",
            f"if [ -f {target}/config.json ]; then folders+=({target}); fi",
            f"for i in {shard_list}; do",
            f"    if [ -d {shard} ]; then folders+=({shard}); fi",
            "done",
            f"exec {merge}" if preset is None else merge,
        ]
    return lines


def _merge_command(script: Path, after: str | None) -> list[str]:
    """``sbatch`` of the merge job: once every task of array job ``after`` succeeded, if given
    (``--kill-on-invalid-dep``: a failed task cancels it rather than leaving it pending)."""
    dependency = [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"] if after else []
    return ["sbatch", "--parsable", *dependency, str(script)]


def _submit_merge(command: list[str], array_job: str | None, record: Path, run: Runner) -> str:
    """Submit the merge job and return its id. When its ``sbatch`` fails after array job
    ``array_job`` was queued, the error says so and that rerunning the command submits the merge alone."""
    try:
        return _job_id(command, run)
    except ValueError as err:
        if array_job is None:
            raise
        raise ValueError(
            f"array job {array_job} is queued (recorded in {record}) but its merge job is not: {err}; "
            f"fix that, then run this command again: it submits the merge job alone, after array job {array_job}"
        ) from err


def _job_id(command: list[str], run: Runner) -> str:
    """Run ``sbatch --parsable ...`` and return the job id it prints (``id`` or ``id;cluster``)."""
    printed = run(command).strip()
    job = printed.split(";")[0]
    if not job.isdigit():
        raise ValueError(f"{shlex.join(command)} printed {printed!r}, not a job id")
    return job


@dataclass(frozen=True)
class _Ledger:
    """``out/slurm/submit.json``: the settings and array size submitted into ``out``, and the job ids."""

    path: Path
    settings: dict[str, Any]
    count: int

    def add(self, jobs: dict[str, Any], *, amend: bool = False) -> None:
        """Append a submission's job ids; ``amend``: add them to the last one instead (the merge
        job of the array it records)."""
        earlier = json.loads(self.path.read_text(encoding="utf-8")) if self.path.is_file() else {}
        entries = list(earlier.get("jobs", []))
        if amend:
            entries[-1] = {**entries[-1], **jobs}
        else:
            entries.append(jobs)
        payload = {"experiment": self.settings, "array_size": self.count, "jobs": entries}
        self.path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
