"""Small drawing helpers shared by the figure modules (one look for every figure)."""

from __future__ import annotations

import math

import numpy as np
from matplotlib import patheffects
from matplotlib.axes import Axes
from matplotlib.figure import Figure

#: Diverging colour map for signed values (biases, encodings), sequential for ids and weights.
DIVERGING = "RdBu_r"
SEQUENTIAL = "viridis"


def head_grid(fig: Figure, count: int, max_cols: int = 4) -> list[Axes]:
    """``count`` axes on a grid at most ``max_cols`` wide, in reading order."""
    cols = min(count, max_cols)
    rows = math.ceil(count / cols)
    axes = fig.subplots(rows, cols, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[count:]:
        ax.set_visible(False)
    return flat[:count]


def symmetric_limits(values: np.ndarray) -> tuple[float, float]:
    """Colour limits centred on zero that cover every finite value (never an empty range)."""
    finite = values[np.isfinite(values)]
    top = float(np.abs(finite).max()) if finite.size else 1.0
    top = top if top > 0 else 1.0
    return -top, top


def annotate_cells(ax: Axes, table: np.ndarray, fmt: str = "{:d}") -> None:
    """Write each cell's value in the middle of an ``imshow`` of ``table`` (readable on any colour)."""
    outline = [patheffects.withStroke(linewidth=2, foreground="black")]
    for (row, col), value in np.ndenumerate(table):
        if np.isnan(value):
            continue
        text = fmt.format(int(value)) if fmt == "{:d}" else fmt.format(value)
        ax.text(col, row, text, ha="center", va="center", fontsize=8, color="white", path_effects=outline)


def label_grid(ax: Axes, row_label: str = "query position i", col_label: str = "key position j") -> None:
    ax.set_xlabel(col_label)
    ax.set_ylabel(row_label)
