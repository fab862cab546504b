"""Spread one experiment over several machines: ``--shard i/n`` and ``posenc merge``.

A sweep is a grid of runs, one per (encoding, seed) in the order ``run_experiment`` plans them
(seed-major, encodings in the order given). ``--shard i/n`` keeps the runs whose index in that
grid is ``i`` modulo ``n``: every run lands in exactly one shard, the shards differ in size by at
most one run, and the assignment depends only on the command line, so a Slurm job array needs no
coordination (``--shard slurm`` reads ``SLURM_ARRAY_TASK_ID`` and the array's size; ``posenc
submit`` writes and submits the array and the merge job: :mod:`.slurm`). A variant evaluated from a
run's checkpoint (an inference-time setting, no retraining) goes with its run.

:func:`merge_folders` combines the folders the shards wrote into one: it refuses folders whose
settings differ (naming the field), keeps one copy of records that are duplicates (equal but for
how long they took and where they ran: :data:`~.results.CIRCUMSTANCE_FIELDS`), refuses
two different records of the same measurement (in ``results.jsonl`` and in the per-run
``runs.jsonl`` alike), and writes the result atomically. A folder that
holds part of the grid (one shard, or a merge of some shards) lists its missing runs in the
summary and the report (:func:`missing_runs`) instead of passing for a complete experiment.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..results.folders import (
    LOCK_NAME,
    FigureWriter,
    check_writable_folder,
    folder_lock,
    lock_owner_alive,
    write_outputs,
)
from ..results.records import (
    MEASUREMENT_KEY,
    RUNS_FILE,
    atomic_write,
    atomic_write_text,
    differing_fields,
    experiment_settings,
    load_config,
    measurement,
    read_records,
    read_run_records,
)
from ..results.summary import missing_runs
from ..study.paired import write_comparisons
from ..study.plan import missing_units
from ..train import ExperimentConfig, RunSpec
from .sharding import Shard, parse_shard

__all__ = [
    "MergeSummary",
    "Shard",
    "merge_folders",
    "missing_units_note",
    "parse_shard",
]


def missing_units_note(settings: dict[str, Any], runs: Iterable[dict[str, Any]]) -> str | None:
    """One line saying which (variant, length) units of a context-extension study folder
    (``settings`` its ``config.json`` ``experiment``) have no ``unit`` record in ``runs`` (its
    ``runs.jsonl``); None when it holds them all. A study's grid is its units, not (encoding x
    seed) runs: its records' tasks (``text-lm``, ``text-passkey``) are not the folder's ``text``."""
    if not {"variant_names", "lengths"} <= settings.keys():
        return None
    missing = missing_units(settings, list(runs))
    if not missing:
        return None
    total = len(settings["variant_names"]) * len(settings["lengths"])
    shown = ", ".join(unit.label for unit in missing[:8]) + (", ..." if len(missing) > 8 else "")
    return (
        f"incomplete: {len(missing)} of {total} units have no results here ({shown}); a shard holds part "
        "of the study: combine the shards' folders with posenc merge"
    )


# ---------------------------------------------------------------------------- merge

#: The fields that name one measurement; two records with the same values here must be equal.
MEASUREMENT_KEY = MEASUREMENT_KEY


def _identity(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings that must agree between folders (as :meth:`ExperimentConfig.identity`; a field
    a folder does not record reads as its default)."""
    defaults = ExperimentConfig().to_dict()
    merged = {**defaults, **settings}
    identity = {k: v for k, v in merged.items() if k not in ExperimentConfig.RUNTIME_FIELDS}
    if merged.get("randomize_positions") is None:
        identity.pop("randomize_eval_positions", None)
    return identity


@dataclass(frozen=True)
class _Source:
    folder: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    #: The per-run records (``runs.jsonl``: the ``iid`` score, fit flag, steps trained and to fit).
    runs: list[dict[str, Any]]

    @property
    def settings(self) -> dict[str, Any]:
        return experiment_settings(self.config)


def _read_source(folder: Path) -> _Source:
    if not folder.is_dir():
        raise ValueError(
            f"posenc merge: {folder} is not a folder; give the --out folders of the runs to merge"
        )
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"posenc merge: {folder} has no config.json, so it is not a posenc extrapolate folder; "
            "give the --out folders of the runs to merge"
        )
    lock = folder / LOCK_NAME
    owner = lock.read_text(encoding="utf-8").strip() if lock.exists() else ""
    if owner and lock_owner_alive(owner):
        raise ValueError(
            f"posenc merge: {folder} is being written by a running posenc process ({owner}); wait for it "
            "to finish (its results are not complete yet), then merge"
        )
    config = load_config(folder)
    return _Source(
        folder,
        config,
        read_records(folder / "results.jsonl"),
        read_run_records(folder),
    )


def _check_same_settings(sources: list[_Source]) -> None:
    """Every folder's settings and data equal the first's; the error names the first field that differs."""
    first = sources[0]
    reference = _identity(first.settings)
    for source in sources[1:]:
        identity = _identity(source.settings)
        different = [
            k for k in sorted(reference.keys() | identity.keys()) if reference.get(k) != identity.get(k)
        ]
        if different:
            details = ", ".join(
                f"{k}: {identity.get(k)!r} there vs {reference.get(k)!r} in {first.folder}" for k in different
            )
            raise ValueError(
                f"posenc merge: {source.folder} holds an experiment with other settings ({details}); "
                "only folders of one experiment (the shards of one command) can be merged"
            )
        data, reference_data = source.config.get("data"), first.config.get("data")
        if (
            isinstance(data, dict)
            and isinstance(reference_data, dict)
            and data.get("sha256") != reference_data.get("sha256")
        ):
            raise ValueError(
                f"posenc merge: {source.folder} was trained on other data (corpus sha256 "
                f"{str(data.get('sha256'))[:12]}... vs {str(reference_data.get('sha256'))[:12]}... in {first.folder})"
            )
        if source.config.get("preset") != first.config.get("preset"):
            raise ValueError(
                f"posenc merge: {source.folder} ran preset {source.config.get('preset')!r}, {first.folder} "
                f"ran {first.config.get('preset')!r}; merge folders of one command"
            )


def _merge_records(sources: list[_Source], file: str = "results.jsonl") -> tuple[list[dict[str, Any]], int]:
    """All records of ``file`` (``results.jsonl`` or ``runs.jsonl``) once each, in folder order, and
    how many duplicates were dropped (the same result, timings and host aside: the first folder's
    copy is kept); ``ValueError`` naming the fields when two folders measured the same thing
    differently."""
    merged: dict[tuple[Any, ...], tuple[dict[str, Any], Path]] = {}
    duplicates = 0
    for source in sources:
        for record in source.runs if file == RUNS_FILE else source.records:
            key = measurement(record)
            if key in merged:
                kept, where = merged[key]
                different = differing_fields(record, kept)
                if different:
                    details = ", ".join(f"{k} {record.get(k)!r} vs {kept.get(k)!r}" for k in different)
                    raise ValueError(
                        f"posenc merge: {source.folder / file} and {where / file} both hold run "
                        f"{record.get('run')!r}, {record.get('metric')} at length {record.get('length')}, "
                        f"with different results ({details}); they "
                        "are not shards of one experiment (or one was rerun on other hardware): merge one "
                        "of them only"
                    )
                duplicates += 1
                continue
            merged[key] = (record, source.folder)
    return [record for record, _ in merged.values()], duplicates


def _union(lists: Iterable[Iterable[Any]]) -> list[Any]:
    """The items of ``lists`` in first-seen order, each once."""
    return list(dict.fromkeys(item for items in lists for item in items))


@dataclass(frozen=True)
class MergeSummary:
    """What :func:`merge_folders` wrote: record count, duplicates dropped, runs missing."""

    out: Path
    records: int
    duplicates: int
    missing: list[RunSpec]
    #: Per-run records written to ``runs.jsonl`` (0 when no folder had one).
    runs: int = 0


def merge_folders(
    out: str | Path, folders: Sequence[str | Path], *, figures: FigureWriter | None = None
) -> MergeSummary:
    """Combine the experiment folders ``folders`` (shards of one command) into ``out``.

    Checks everything before writing: each folder has a ``config.json``; all have the same settings
    (``ValueError`` naming the field) and data; no two records of the same measurement differ, in
    ``results.jsonl`` and in the per-run ``runs.jsonl`` alike (timing and host fields aside:
    :data:`~.results.CIRCUMSTANCE_FIELDS`). Duplicate records are kept once. ``out`` may be one of ``folders``; otherwise it must not hold results yet. Writes
    ``results.jsonl``, ``runs.jsonl`` (when the folders have per-run records), ``results.csv`` and
    ``config.json`` atomically (the encodings and seeds are the union of the folders'), copies the
    runs' checkpoints, and draws the figures with ``figures`` (:func:`posenc.viz.folder.write_figures`).
    """
    out = Path(out)
    if len(folders) < 1:
        raise ValueError("posenc merge needs at least one folder to read")
    paths = [Path(folder) for folder in folders]
    resolved = [path.resolve() for path in paths]
    if len(set(resolved)) != len(resolved):
        raise ValueError("posenc merge: a folder is named twice; name each folder once")
    holds = [name for name in ("results.jsonl", "config.json") if (out / name).exists()]
    if holds and out.resolve() not in resolved:
        raise ValueError(
            f"posenc merge: {out} already holds an experiment ({holds[0]}); give an empty or new output "
            f"folder, or name {out} among the folders to merge into it"
        )
    check_writable_folder(out)
    sources = [_read_source(path) for path in paths]
    _check_same_settings(sources)
    records, duplicates = _merge_records(sources)
    runs, _ = _merge_records(sources, RUNS_FILE)
    settings = dict(sources[0].settings)
    settings["encodings"] = _union(source.settings.get("encodings", []) for source in sources)
    settings["seeds"] = _union(source.settings.get("seeds", []) for source in sources)
    study = bool(settings.get("study"))  # a context-extension study's folders (--hf-model, --task text)
    config = None if study else _config_from_settings(settings)
    if config is not None:
        config.make_task()  # the merged settings still name a task this version can build
    payload: dict[str, Any] = {
        "experiment": {**settings},
        "runtime": {
            "merged_from": [str(path) for path in paths],
            "shards": [source.config.get("runtime", {}).get("shard") for source in sources],
        },
    }
    for key in ("data", "preset"):
        if sources[0].config.get(key) is not None:
            payload[key] = sources[0].config[key]
    with folder_lock(out):
        _copy_checkpoints(out, sources, {record.get("run") for record in records})
        atomic_write_text(out / "results.jsonl", "".join(json.dumps(record) + "\n" for record in records))
        if runs:
            atomic_write_text(out / RUNS_FILE, "".join(json.dumps(record) + "\n" for record in runs))
        atomic_write_text(out / "config.json", json.dumps(payload, indent=2) + "\n")
        write_outputs(out, records, figures)
        if study:  # the paired tests over the merged units (the shards' own saw only theirs)
            write_comparisons(out, settings, records)
    if config is None:
        return MergeSummary(out, len(records), duplicates, missing_units(settings, runs), len(runs))
    missing = missing_runs(config.task, config.encodings, config.seeds, records)
    return MergeSummary(out, len(records), duplicates, missing, len(runs))


def _config_from_settings(settings: dict[str, Any]) -> ExperimentConfig:
    """An :class:`ExperimentConfig` from a folder's settings (fields this version does not know are
    left out: they only matter to the version that wrote them)."""
    return ExperimentConfig.from_settings(settings)


def _copy_checkpoints(out: Path, sources: list[_Source], runs: set[Any]) -> None:
    """Copy each merged run's checkpoint into ``out/checkpoints`` (the first folder's copy wins;
    one already there is kept). The report draws the trained models' attention from them."""
    for source in sources:
        folder = source.folder / "checkpoints"
        if not folder.is_dir() or folder.resolve() == (out / "checkpoints").resolve():
            continue
        for checkpoint in sorted(folder.glob("*.pt")):
            target = out / "checkpoints" / checkpoint.name
            if checkpoint.stem not in runs or target.exists():
                continue
            atomic_write(target, lambda handle, path=checkpoint: _copy_into(path, handle))


def _copy_into(path: Path, handle: Any) -> None:
    with path.open("rb") as source:
        shutil.copyfileobj(source, handle)
