"""What every published setup shares: the :class:`Preset` record, the published numbers
(``posenc/data/published.json``), applying a preset to a config, reading a preset run's folders,
and the agreement of our order with the paper's (:class:`Agreement`)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..results.agreement import BootstrapInterval
from ..results.records import experiment_settings, load_config, read_records, read_run_records
from ..results.summary import SummaryTable as Table  # the same plain-text table as the summary
from ..results.summary import missing_runs
from ..train import ExperimentConfig

__all__ = [
    "PAPER_PRESETS",
    "Agreement",
    "Comparison",
    "Preset",
    "apply_preset",
    "citation_line",
    "compare_folders",
    "comparison_for_folder",
    "format_value",
    "per_seed_curves",
    "preset_folders",
    "published",
]

#: ``compare(preset, {task: (settings, records)})`` -> the published-vs-ours table.
Comparison = Callable[["Preset", dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]], Table]


def _published_file() -> dict[str, Any]:
    text = resources.files("posenc").joinpath("data/published.json").read_text(encoding="utf-8")
    return json.loads(text)


def published(name: str) -> dict[str, Any]:
    """The published numbers of preset ``name`` with their citation (from ``published.json``)."""
    data = _published_file()
    if name not in data or not isinstance(data[name], dict):
        raise ValueError(f"no published numbers for preset {name!r} in posenc/data/published.json")
    return data[name]


def citation_line(entry: dict[str, Any]) -> str:
    """``"Kazemnejad, Padhi, ... (2023). Title. Venue. arXiv:2305.19466"``."""
    cite = entry["citation"]
    surnames = [author.split()[-1] for author in cite["authors"]]
    return f"{', '.join(surnames)} ({cite['year']}). {cite['title']}. {cite['venue']}. arXiv:{cite['arxiv']}"


@dataclass(frozen=True)
class Preset:
    """A published experiment: the settings it fixes, the tasks it runs, how ours is compared."""

    name: str
    summary: str
    tasks: tuple[str, ...]
    #: ExperimentConfig fields the preset sets (the others keep the command line's values).
    settings: dict[str, Any]
    #: Fields an explicit option may not change (they define the published setup). ``seeds`` may
    #: be narrowed to a non-empty subset of the preset's (the reduced form: fewer seeds).
    fixed: tuple[str, ...]
    compare: Comparison = field(repr=False)
    #: ExperimentConfig fields the preset sets unless the command line gives them (the training
    #: budget that makes every run fit: ``until_fit``, the step cap, the learning rate).
    defaults: dict[str, Any] = field(default_factory=dict)


def apply_preset(
    name: str, config: ExperimentConfig, explicit: dict[str, Any], task: str | None = None
) -> list[ExperimentConfig]:
    """One config per task of preset ``name``: ``config`` with the preset's settings.

    ``explicit`` maps the fields given on the command line to their values; one that contradicts
    the preset is a ``ValueError`` naming both. ``task`` (an explicit ``--task``) runs only that
    task, which must be one of the preset's.
    """
    preset = PAPER_PRESETS.get(name)
    if preset is None:
        raise ValueError(f"unknown --preset {name!r}; available: {', '.join(PAPER_PRESETS)}")
    if task is not None and task not in preset.tasks:
        raise ValueError(
            f"--preset {name} runs --task {', '.join(preset.tasks)}; --task {task} is not one of them "
            "(drop --task, or run without --preset)"
        )
    settings = dict(preset.settings)
    for key, value in explicit.items():
        if key == "seeds" and key in preset.fixed and value and set(value) <= set(preset.settings[key]):
            settings[key] = list(value)  # the reduced form: a subset of the published seeds
            continue
        if key in preset.fixed and value != preset.settings[key]:
            option = "--" + key.replace("_", "-")
            raise ValueError(
                f"--preset {name} sets {option} {_option_text(preset.settings[key])} (the published setup); "
                f"drop {option} {_option_text(value)}, or run without --preset"
                + (" (--seeds may name a subset of them)" if key == "seeds" else "")
            )
    tasks = (task,) if task is not None else preset.tasks
    defaults = {key: value for key, value in preset.defaults.items() if key not in explicit}
    return [dataclasses.replace(config, **defaults, **settings, task=one) for one in tasks]


def _option_text(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def preset_folders(directory: str | Path) -> dict[str, Path]:
    """``{task: folder}`` of the preset run ``directory`` belongs to: ``directory`` itself and the
    sibling folders (``OUT/<task>``) that ran the same preset on its other tasks."""
    directory = Path(directory)
    name = load_config(directory).get("preset")
    if name is None:
        raise ValueError(f"{directory} was not run with --preset (its config.json names no preset)")
    own = experiment_settings(load_config(directory)).get("task")
    folders = {own: directory}
    for sibling in sorted(directory.parent.iterdir()):
        if sibling == directory or not (sibling / "config.json").is_file():
            continue
        config = load_config(sibling)
        task = experiment_settings(config).get("task")
        if config.get("preset") == name and task not in folders:
            folders[task] = sibling
    return folders


def comparison_for_folder(directory: str | Path) -> Table:
    """The published-vs-ours table of the preset run ``directory`` belongs to."""
    folders = preset_folders(directory)
    name = load_config(directory)["preset"]
    return compare_folders(name, folders)


def compare_folders(name: str, folders: dict[str, Path]) -> Table:
    """The published-vs-ours table of preset ``name`` from its task folders ``{task: folder}``."""
    preset = PAPER_PRESETS.get(name)
    if preset is None:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(PAPER_PRESETS)})")
    results = {task: read_records(folder / "results.jsonl") for task, folder in folders.items()}
    # The per-run records (runs.jsonl: "iid", with steps_to_fit under --until-fit) go along.
    runs = {
        task: (experiment_settings(load_config(folder)), results[task] + read_run_records(folder))
        for task, folder in folders.items()
    }
    table = preset.compare(preset, runs)
    incomplete = []
    for task, (settings, _) in runs.items():
        records = results[task]
        missing = missing_runs(task, settings.get("encodings", []), settings.get("seeds", []), records)
        if missing:
            shown = ", ".join(run.label for run in missing[:4]) + (", ..." if len(missing) > 4 else "")
            incomplete.append(f"{task} lacks {len(missing)} run(s) ({shown})")
    if incomplete:
        note = (
            "incomplete, ours rests on part of the grid: "
            + "; ".join(incomplete)
            + " (merge the shards first)"
        )
        table = dataclasses.replace(table, notes=(*table.notes, note))
    return table


@dataclass(frozen=True)
class Agreement:
    """Kendall's τ of our scores against the paper's over ``items``, with its interval across seeds."""

    #: What is ranked (``"mean reciprocal rank"``, ``"ratio at 2x"``).
    what: str
    items: list[str]
    tau: float | None
    interval: BootstrapInterval | None

    def headline(self) -> str:
        """``"Kendall's τ vs the paper's order 0.80 [0.60, 1.00]"``."""
        if self.tau is None:
            return f"Kendall's τ vs the paper's order: - ({len(self.items)} ranked)"
        text = f"Kendall's τ vs the paper's order {self.tau:+.2f}"
        if self.interval is not None:
            text += f" [{self.interval.low:+.2f}, {self.interval.high:+.2f}]"
        return text

    def note(self, paper_names: dict[str, str]) -> str:
        if self.tau is None:
            return (
                f"agreement: Kendall's τ needs two ranked encodings that are not all tied; "
                f"ranked: {', '.join(self.items) or 'none'}"
            )
        text = (
            f"agreement: Kendall's τ (tau-b, ties in ours count as ties) of our {self.what} against the "
            f"paper's over the {len(self.items)} ranked encodings ({', '.join(self.items)}) = {self.tau:+.2f}"
        )
        if self.interval is None:
            return text + "; one seed: no interval across seeds"
        text += (
            f", 95% interval [{self.interval.low:+.2f}, {self.interval.high:+.2f}] (percentile interval of the "
            f"{self.interval.method}, each task's seeds resampled with replacement, tasks independently; with "
            "few seeds it shows how far swapping seeds moves the order, it is not a calibrated 95%)"
        )
        if self.interval.undefined:
            text += f"; τ undefined (all tied) on {self.interval.undefined:.0%} of the resamples, left out"
        return text


def per_seed_curves(
    records: list[dict[str, Any]], metric: str, encodings: list[str]
) -> dict[str, dict[int, dict[int, float]]]:
    """``{encoding: {seed: {length: value}}}`` of ``metric`` (no variants)."""
    curves: dict[str, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for record in records:
        if record.get("metric") == metric and not record.get("variant") and record["encoding"] in encodings:
            curves[record["encoding"]][int(record.get("seed", 0))][int(record["length"])] = float(
                record["value"]
            )
    return curves


def format_value(value: float | None, form: str) -> str:
    return "-" if value is None or math.isnan(value) else form.format(value)


#: The published setups by name (``posenc extrapolate --preset NAME``); the layer recipes of
#: published models (``gemma3``) are :data:`posenc.layers.patterns.LAYER_PRESETS`.
PAPER_PRESETS: dict[str, Preset] = {}
