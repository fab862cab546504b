"""The depth x length heat map of a retrieval experiment (``passkey``): exact match per depth bucket.

The ``exact_match`` record of each length carries ``by_depth``, a list of ``{"bucket", "depth":
[low, high], "value", "examples"}`` (:mod:`posenc.experiments.tasks.retrieval`); one panel per encoding
shows depth buckets (rows, needle near the start at the top) against evaluated length (columns),
the colour the exact match averaged over seeds weighted by example counts. A dashed line marks
the training length. Drawn into ``depth.png`` by the runner, by ``posenc plot --run DIR --figure
depth`` and in ``posenc report``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from ..experiments.results.records import Record, as_records, experiment_settings, load_config, read_records
from ._style import SEQUENTIAL
from .registry import new_figure, set_title

__all__ = ["depth_grid", "depth_heatmap_figure", "has_depths", "run_depth_figure"]


def has_depths(records: Iterable[Record | dict[str, Any]]) -> bool:
    """Whether any record carries a ``by_depth`` breakdown."""
    return any(record.by_depth for record in as_records(records))


def depth_grid(
    records: Iterable[Record | dict[str, Any]], encoding: str
) -> tuple[list[int], list[tuple[float, float]], np.ndarray]:
    """``(lengths, depth bucket bounds, exact match [buckets, lengths])`` of ``encoding`` (NaN where a
    length has no example in a bucket), pooled over seeds by example counts."""
    hits: dict[tuple[int, int], float] = defaultdict(float)
    counts: dict[tuple[int, int], float] = defaultdict(float)
    bounds: dict[int, tuple[float, float]] = {}
    for record in as_records(records):
        if record.encoding != encoding:
            continue
        for cell in record.by_depth:
            key = (cell.bucket, record.length)
            hits[key] += cell.value * cell.examples
            counts[key] += cell.examples
            bounds[cell.bucket] = (cell.low, cell.high)
    lengths = sorted({length for _, length in counts})
    buckets = sorted(bounds)
    grid = np.full((len(buckets), len(lengths)), np.nan)
    for (bucket, length), count in counts.items():
        grid[buckets.index(bucket), lengths.index(length)] = hits[(bucket, length)] / count
    return lengths, [bounds[b] for b in buckets], grid


def depth_heatmap_figure(
    records: Iterable[Record | dict[str, Any]],
    encodings: list[str],
    *,
    title: str | None = None,
    length_label: str = "length (filler symbols)",
) -> Figure:
    """Exact match by needle depth (rows) and length (columns, labelled ``length_label``), one panel
    per encoding. A depth bucket is labelled by its range, or by its one depth (``25%``)."""
    records = as_records(records)
    shown = [e for e in encodings if depth_grid(records, e)[0]]
    if not shown:
        raise ValueError("no record carries a depth breakdown (by_depth): run a passkey experiment")
    fig = new_figure(min(4.2 * len(shown), 16) + 1.0, 3.6)
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    image = None
    for ax, encoding in zip(axes, shown):
        lengths, bounds, grid = depth_grid(records, encoding)
        image = ax.imshow(
            np.ma.masked_invalid(grid),
            cmap=SEQUENTIAL,
            vmin=0.0,
            vmax=1.0,
            aspect="auto",
            interpolation="nearest",
        )
        ax.set_title(encoding, fontsize=9)
        names = [f"{low:.0%}" if low == high else f"{low:.0%}-{high:.0%}" for low, high in bounds]
        ax.set_yticks(range(len(bounds)), names, fontsize=7)
        step = max(1, len(lengths) // 8)
        ax.set_xticks(range(0, len(lengths), step), [str(n) for n in lengths[::step]], fontsize=7)
        ax.set_xlabel(length_label)
        trained = {r.train_length for r in records if r.encoding == encoding} - {None}
        for length in trained:
            if length in lengths:
                ax.axvline(lengths.index(length) + 0.5, color="white", linestyle="--", linewidth=1.0)
    axes[0].set_ylabel("needle depth")
    fig.colorbar(image, ax=list(axes), shrink=0.9, label="exact match")
    task = next((r.task for r in records if r.by_depth), "")
    set_title(fig, title if title is not None else f"{task}: exact match by depth and length")
    return fig


def run_depth_figure(directory: str | Path) -> Figure:
    """The depth x length heat map of the experiment in ``directory`` (``posenc plot --run DIR --figure depth``)."""
    directory = Path(directory)
    path = directory / "results.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {directory} an experiment directory?")
    records = read_records(path)
    listed = [str(e) for e in experiment_settings(load_config(directory)).get("encodings", [])]
    encodings = listed + [e for e in dict.fromkeys(r["encoding"] for r in records) if e not in listed]
    return depth_heatmap_figure(records, encodings)
