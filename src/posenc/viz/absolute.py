"""Figures of ABSOLUTE encodings: the seed's sinusoidal figures and generic table views.

Everything is computed from the encoding's own ``encode(positions)``, so the figures show the
table exactly as built (layout, base, width).
"""

from __future__ import annotations

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..encodings.base import Kind, PositionalEncoding
from ._style import DIVERGING, SEQUENTIAL, symmetric_limits
from .registry import PlotOptions, describe, figure, new_figure, set_title

#: The seed's figure: dimensions 2, 6 and 12 over 128 positions, and the vectors of positions 1 and 5.
SEED_DIMENSIONS = (2, 6, 12)
SEED_POSITIONS = (1, 5)
SEED_LENGTH = 128


def encoding_table(enc: PositionalEncoding, length: int) -> np.ndarray:
    """``enc.encode(arange(length))`` as a float64 array ``[length, dim]`` (clipped to ``max_positions``)."""
    if enc.max_positions is not None:
        length = min(length, enc.max_positions)
    with torch.no_grad():
        table = enc.encode(torch.arange(length)[None])[0]
    return table.double().cpu().numpy()


def _has_table(enc: PositionalEncoding) -> bool:
    return encoding_table(enc, 1).shape[-1] > 0


def _draw_dimensions(axes: list[Axes], table: np.ndarray) -> None:
    dims = [d for d in SEED_DIMENSIONS if d < table.shape[1]]
    if not dims:
        raise ValueError(
            f"the encoding is {table.shape[1]} wide; the seed figure needs dimension {SEED_DIMENSIONS[0]}"
        )
    positions = np.arange(table.shape[0])
    for ax, dim in zip(axes, dims):
        ax.plot(positions, table[:, dim], color="tab:blue")
        ax.set_ylabel(f"dim {dim}")
        if np.abs(table[:, dim]).max() <= 1:  # sinusoids: the same scale in every panel
            ax.set_ylim(-1.1, 1.1)
        ax.grid(alpha=0.3)
    axes[len(dims) - 1].set_xlabel("position")
    axes[0].set_title(f"dimensions {', '.join(map(str, dims))} over {table.shape[0]} positions")


def _draw_vectors(ax: Axes, table: np.ndarray) -> None:
    channels = np.arange(table.shape[1])
    # Markers only: sin and cos channels alternate (interleaved layout), so lines would zigzag;
    # as points they form one sin curve and one cos curve per position.
    for pos, marker in zip(SEED_POSITIONS, ("o", "s")):
        if pos < table.shape[0]:
            ax.plot(channels, table[pos], marker, markersize=3, alpha=0.8, label=f"position {pos}")
    ax.set_xlabel("dimension")
    ax.set_ylabel("value")
    ax.set_title(f"encoding vectors of positions {SEED_POSITIONS[0]} and {SEED_POSITIONS[1]}")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)


def _draw_heatmap(fig: Figure, ax: Axes, table: np.ndarray) -> None:
    low, high = symmetric_limits(table)
    image = ax.imshow(table, aspect="auto", cmap=DIVERGING, vmin=low, vmax=high, interpolation="nearest")
    ax.set_xlabel("dimension")
    ax.set_ylabel("position")
    ax.set_title("positions × dimensions")
    fig.colorbar(image, ax=ax, shrink=0.9)


def _draw_similarity(fig: Figure, ax: Axes, table: np.ndarray) -> None:
    # The dot product of two sinusoidal vectors depends only on their distance: a Toeplitz matrix.
    similarity = table @ table.T
    image = ax.imshow(similarity, cmap=SEQUENTIAL, interpolation="nearest")
    ax.set_xlabel("position")
    ax.set_ylabel("position")
    ax.set_title("dot product between positions")
    fig.colorbar(image, ax=ax, shrink=0.9)


@figure("sinusoidal", "seed")
def sinusoidal_seed(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """The seed's four figures: dims 2/6/12, positions 1 and 5, the table, position similarity."""
    table = encoding_table(enc, options.length_or(SEED_LENGTH))
    fig = new_figure(13, 9)
    top, bottom = fig.subfigures(2, 1)
    left, right = top.subfigures(1, 2)
    _draw_dimensions(list(left.subplots(3, 1, sharex=True)), table)
    _draw_vectors(right.subplots(), table)
    heat_ax, sim_ax = bottom.subplots(1, 2)
    _draw_heatmap(bottom, heat_ax, table)
    _draw_similarity(bottom, sim_ax, table)
    set_title(fig, f"{describe(enc)} (width {table.shape[1]})")
    return fig


@figure("sinusoidal", "dims")
def sinusoidal_dims(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """Values of dimensions 2, 6 and 12 across 128 positions (the seed's first figure)."""
    table = encoding_table(enc, options.length_or(SEED_LENGTH))
    fig = new_figure(9, 6)
    _draw_dimensions(list(fig.subplots(3, 1, sharex=True)), table)
    set_title(fig, describe(enc))
    return fig


@figure("sinusoidal", "vectors")
def sinusoidal_vectors(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """The encoding vectors of positions 1 and 5 side by side (the seed's second figure)."""
    table = encoding_table(enc, max(options.length_or(SEED_LENGTH), max(SEED_POSITIONS) + 1))
    fig = new_figure(10, 4.5)
    _draw_vectors(fig.subplots(), table)
    set_title(fig, describe(enc))
    return fig


@figure(Kind.ABSOLUTE, "heatmap", applies=_has_table)
def absolute_heatmap(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """Positions × dimensions heatmap of the encoding table."""
    table = encoding_table(enc, options.length_or(SEED_LENGTH))
    fig = new_figure(9, 6)
    _draw_heatmap(fig, fig.subplots(), table)
    set_title(fig, describe(enc))
    return fig


@figure(Kind.ABSOLUTE, "similarity", applies=_has_table, square=True)
def absolute_similarity(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """Dot-product similarity between the encoding vectors of every pair of positions."""
    table = encoding_table(enc, options.length_or(SEED_LENGTH))
    fig = new_figure(7, 6)
    _draw_similarity(fig, fig.subplots(), table)
    set_title(fig, describe(enc))
    return fig
