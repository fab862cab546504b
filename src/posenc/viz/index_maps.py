"""The shared layout of index-map figures (T5 buckets, Shaw and DeBERTa relative rows).

Left: the annotated index of every (query, key) pair of a small grid, like the seed's 8×8 table.
Right: the index against the relative position over a wide range, where clipping and logarithmic
buckets show.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from ._style import SEQUENTIAL, annotate_cells, label_grid
from .registry import new_figure, set_title

#: Grids up to this size get the index written in each cell.
ANNOTATE_UP_TO = 16


def index_figure(
    grid: np.ndarray,
    relative: np.ndarray,
    index: np.ndarray,
    *,
    title: str,
    curve_xlabel: str,
    value_label: str,
    marks: dict[str, int] | None = None,
) -> Figure:
    """Draw ``grid [L, L]`` (index per query row, key column) and ``index`` against ``relative``."""
    fig = new_figure(13, 5.5)
    grid_ax, curve_ax = fig.subplots(1, 2)
    image = grid_ax.imshow(grid, cmap=SEQUENTIAL, interpolation="nearest")
    if grid.shape[0] <= ANNOTATE_UP_TO and grid.shape[1] <= ANNOTATE_UP_TO:
        annotate_cells(grid_ax, grid.astype(float))
    label_grid(grid_ax)
    grid_ax.set_title(f"{value_label} per (query, key), {grid.shape[0]}×{grid.shape[1]}")
    fig.colorbar(image, ax=grid_ax, shrink=0.85, label=value_label)
    curve_ax.step(relative, index, where="mid", color="tab:blue")
    for text, at in (marks or {}).items():
        for x in (-at, at):
            curve_ax.axvline(x, color="gray", linestyle="--", linewidth=0.8)
        curve_ax.text(at, float(np.min(index)), f"{text} ", color="gray", fontsize=8, va="bottom", ha="right")
    curve_ax.set_xlabel(curve_xlabel)
    curve_ax.set_ylabel(value_label)
    curve_ax.set_title(f"{value_label} against relative position")
    curve_ax.grid(alpha=0.3)
    set_title(fig, title)
    return fig
