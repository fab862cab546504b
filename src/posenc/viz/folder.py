"""The figures of an experiment folder, drawn from what the folder holds.

The harness (:mod:`posenc.experiments`) writes data only (``config.json``, ``results.jsonl``,
``runs.jsonl``, ``results.csv``); :func:`write_figures` reads them and draws

- ``extrapolation.png``: the task's metric against length, one line per row of the folder's table
  (encodings and their variants), rows that did not fit dashed and faded;
- ``depth.png``: exact match by needle depth and length, for tasks whose records carry depths
  (passkey).

``posenc extrapolate``, ``posenc merge`` and ``--hf-model`` pass it to the harness
(``figures=write_figures``), which calls it once the records are written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..experiments.results.records import (
    Record,
    atomic_write,
    experiment_settings,
    fit_notes,
    load_config,
    read_records,
)
from ..experiments.tasks.catalog import TASKS
from ..experiments.train import ExperimentConfig
from ..experiments.variant_specs import row_labels
from .curves import curve_figure
from .depth import depth_heatmap_figure, has_depths

__all__ = ["write_figures"]


def write_figures(folder: str | Path) -> list[Path]:
    """Draw ``folder``'s ``extrapolation.png`` (and ``depth.png`` when its records carry depths)
    from its ``config.json`` and ``results.jsonl``; returns the files written."""
    folder = Path(folder)
    settings = experiment_settings(load_config(folder))
    task = settings["task"]
    if settings.get("study"):  # posenc extrapolate --hf-model M --task text (the context-extension study)
        from .hf_study import study_figures

        return study_figures(folder, settings, read_records(folder / "results.jsonl"), _save)
    metric = TASKS[task].metric
    config = None if "hf_model" in settings else _config(settings)
    if config is None:  # an HF model evaluated as it is (posenc extrapolate --hf-model)
        rows, seeds = list(settings["encodings"]), set(settings["seeds"])
        name = Path(settings["hf_model"]).resolve().name
        title = f"{name} ({settings['model_class']}, trained context {settings['train_len']}) on {task}, no training"
    else:
        rows, seeds = row_labels(config), set(config.seeds)
        title = f"{task}: trained on lengths <= {config.train_len}, {config.steps} steps"
    records = [
        r for r in read_records(folder / "results.jsonl") if r["encoding"] in rows and r["seed"] in seeds
    ]
    unfit = (
        None if config is None else fit_notes(records, metric, config.train_len, rows, config.fit_threshold)
    )
    curves = [Record.from_dict(record) for record in records if record["metric"] == metric.name]
    fig = curve_figure(
        curves,
        curves[0].task if curves else "",
        metric.name,
        rows,
        title=title,
        log_scale=metric.log_scale,
        length_label=metric.length_label,
        binomial=metric.fits,
        unfit=unfit,
    )
    written = [folder / "extrapolation.png"]
    _save(fig, written[0])
    if has_depths(records):
        title = f"{task}: exact match by depth and length (trained on lengths <= {settings['train_len']})"
        written.append(folder / "depth.png")
        _save(depth_heatmap_figure(records, rows, title=title), written[-1])
    return written


def _config(settings: dict[str, Any]) -> ExperimentConfig:
    """The folder's :class:`ExperimentConfig` (fields this version does not know are left out)."""
    return ExperimentConfig.from_settings(settings)


def _save(fig: Any, path: Path) -> None:
    """Save ``fig`` as PNG atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda handle: fig.savefig(handle, dpi=120, format="png"))
