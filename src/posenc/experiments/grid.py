"""What ``posenc submit`` splits into array tasks: a :class:`Grid` of units (a trained run and its
variants, or a context-extension study's (variant, length)), the folders a shard writes, and the
units that no folder has finished yet. :mod:`.slurm` writes and submits the jobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .plan import check_experiment, plan_runs
from .results.folders import finished_runs
from .shard import Shard
from .train import ExperimentConfig, RunSpec, run_id_for
from .variants import parse_eval_variants, variant_run_id

__all__ = [
    "Grid",
    "Part",
    "array_ranges",
    "finished_in",
    "grid_shard_folder",
    "merged_folder",
    "missing_shards",
    "missing_units",
    "shard_folder",
]


def shard_folder(out: Path, shard: Shard) -> Path:
    """``OUT/shards/<i>of<n>``: the folder array task ``i`` of ``n`` writes (and resumes in)."""
    return out / "shards" / f"{shard.index}of{shard.count}"


def array_ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (sbatch's ``--array`` form)."""
    parts: list[str] = []
    ordered = sorted(set(indices))
    start = previous = None
    for index in [*ordered, None]:
        if index is not None and previous is not None and index == previous + 1:
            previous = index
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = index
    return ",".join(parts)


def _run_ids(config: ExperimentConfig, run: RunSpec) -> list[str]:
    """The ids whose records finish ``run``: the trained run and each inference-time variant of it."""
    variants = [v for v in parse_eval_variants(list(config.eval_variants)) if not v.is_identity]
    return [run_id_for(config, run), *(variant_run_id(config, run, variant) for variant in variants)]


class Grid(Protocol):
    """What :func:`submit` needs of an experiment: its units of work (a trained run with its
    variants, or a study's (variant, length)), which of them shard ``i`` of ``n`` runs, the ids a
    finished unit leaves in a folder, and the settings a rerun must match. :class:`Part` is a
    trained grid's; :class:`.study_plan.StudyGrid` a context-extension study's."""

    #: The sub-folder of ``OUT`` and of each shard folder it writes (a preset's task), or "".
    inside: str
    #: Whether an array task runs several processes (``--workers``).
    takes_workers: bool

    def size(self) -> int:
        """The number of units: the most array tasks that each get one."""

    def settings(self) -> dict[str, Any]:
        """What a rerun of ``posenc submit`` into the same folder must match (JSON values)."""

    def check(self, folder: Path) -> None:
        """Refuse (``ValueError``) a folder that holds another experiment."""

    def units(self, index: int, count: int) -> list[Any]:
        """The units shard ``index`` of ``count`` runs (each with a ``label``)."""

    def unit_ids(self, unit: Any) -> set[str]:
        """The run ids a folder records once ``unit`` is finished."""

    def finished(self, folder: Path) -> set[str]:
        """The run ids finished in ``folder`` (empty when it holds nothing)."""


@dataclass(frozen=True)
class Part:
    """One trained experiment of a submission (a :class:`Grid`) and where it lives: ``inside`` is
    its sub-folder of ``OUT`` and of each shard folder; empty for a plain grid, the task for a
    preset (``extrapolate --preset`` writes one folder per task under its ``--out``)."""

    config: ExperimentConfig
    inside: str = ""
    takes_workers: bool = True

    def size(self) -> int:
        return len(plan_runs(self.config))

    def settings(self) -> dict[str, Any]:
        return self.config.to_dict()

    def check(self, folder: Path) -> None:
        check_experiment(self.config, folder)

    def units(self, index: int, count: int) -> list[RunSpec]:
        return plan_runs(self.config, Shard(index, count))

    def unit_ids(self, unit: RunSpec) -> set[str]:
        return set(_run_ids(self.config, unit))

    def finished(self, folder: Path) -> set[str]:
        if not (folder / "results.jsonl").is_file():
            return set()
        return finished_runs(folder, self.config, self.config.make_task().metric)


def merged_folder(out: Path, grid: Grid) -> Path:
    """The folder the merge job writes for ``grid``."""
    return out / grid.inside if grid.inside else out


def grid_shard_folder(out: Path, grid: Grid, shard: Shard) -> Path:
    """The folder array task ``shard.index`` writes (and resumes in) for ``grid``."""
    folder = shard_folder(out, shard)
    return folder / grid.inside if grid.inside else folder


def missing_units(grid: Grid, out: Path, count: int) -> tuple[list[Any], list[int]]:
    """The units of ``grid`` that neither ``out`` nor its shard folders finished, and the shards
    (of ``count``) that hold them."""
    folders = [merged_folder(out, grid)]
    folders += [grid_shard_folder(out, grid, Shard(index, count)) for index in range(count)]
    finished: set[str] = set().union(*(grid.finished(folder) for folder in folders))
    missing, shards = [], []
    for index in range(count):
        lacking = [unit for unit in grid.units(index, count) if not grid.unit_ids(unit) <= finished]
        missing += lacking
        if lacking:
            shards.append(index)
    return missing, shards


def missing_shards(
    config: ExperimentConfig, out: Path, count: int, inside: str = ""
) -> tuple[list[RunSpec], list[int]]:
    """The runs of the grid that neither ``out`` nor its shard folders finished, and the shards
    (of ``count``) that hold them. ``inside``: the sub-folder the experiment writes (a preset's task)."""
    return missing_units(Part(config, inside), out, count)


def finished_in(grid: Grid, folder: Path) -> bool:
    """Whether ``folder`` alone holds every unit of ``grid`` (a trained run: and every variant)."""
    done = grid.finished(folder)
    return all(grid.unit_ids(unit) <= done for unit in grid.units(0, 1))
