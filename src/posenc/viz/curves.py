"""The metric-against-length figure of an experiment: one line per encoding.

Drawn for ``posenc report`` and for the ``extrapolation.png`` that the experiment runner writes
(:func:`posenc.viz.folder.write_figures`), from records read by :mod:`posenc.experiments.results.records`.

The length axis is linear and spans the evaluated lengths, with the training length L marked and
the lengths beyond it shaded: that is where the encodings differ, and a log axis would give it a
small part of the width. Past :data:`SMALL_MULTIPLES_ABOVE` encodings the lines would overlap, so
the figure becomes small multiples: one panel per encoding, drawn in colour over the others in grey.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..experiments.results.records import Record, seed_interval, wilson_interval
from .registry import new_figure, set_title

__all__ = ["SMALL_MULTIPLES_ABOVE", "curve_figure"]

#: More encodings than this get one panel each (small multiples) instead of one shared panel.
SMALL_MULTIPLES_ABOVE = 6


def _records_by_length(records: list[Record], task: str, metric: str) -> dict[str, dict[int, list[Record]]]:
    """``{encoding: {length: [record per seed]}}`` of ``task`` and ``metric``."""
    table: dict[str, dict[int, list[Record]]] = {}
    for r in records:
        if r.task == task and r.metric == metric:
            table.setdefault(r.encoding, {}).setdefault(r.length, []).append(r)
    return table


def _band(cell: list[Record], binomial: bool) -> tuple[float, float] | None:
    """The 95% band at one length: across seeds (Student's t interval of the mean, kept inside
    [0, 1] for a fraction metric) with several, Wilson from the example count with one seed of a
    fraction metric, else None."""
    if len(cell) > 1:
        return seed_interval([r.value for r in cell], bounds=(0.0, 1.0) if binomial else None)
    record = cell[0]
    if binomial and record.examples:
        return wilson_interval(record.value * record.examples, record.examples)
    return None


def _draw(
    ax: Axes, cells: dict[int, list[Record]], color: str, label: str, binomial: bool, faded: bool
) -> None:
    """One encoding's mean over seeds with its 95% band; ``faded``: dashed and pale (did not fit)."""
    lengths = sorted(cells)
    means = [float(np.mean([r.value for r in cells[n]])) for n in lengths]
    style = dict(linestyle="--", alpha=0.5) if faded else {}
    bands = [_band(cells[n], binomial) for n in lengths]
    if len(lengths) == 1:  # no line to draw and no width to band: a marker with its interval as bars
        low, high = bands[0] or (means[0], means[0])
        errors = [[means[0] - low], [high - means[0]]]
        ax.errorbar(lengths, means, yerr=errors, fmt="o", markersize=7, capsize=6, color=color,
                    label=label, alpha=0.5 if faded else 1.0)  # fmt: skip
        return
    ax.plot(lengths, means, marker="o", markersize=3, color=color, label=label, **style)
    if any(band is not None for band in bands):
        low = [band[0] if band else np.nan for band in bands]
        high = [band[1] if band else np.nan for band in bands]
        ax.fill_between(lengths, low, high, color=color, alpha=0.07 if faded else 0.18, linewidth=0)


def _one_length_axis(ax: Axes, length: int) -> None:
    """One evaluated length: its one tick, labelled with the length, in the middle of an axis from
    half of it to one and a half times it (matplotlib's own would span ``length +- 0.5`` in ticks
    like 99.6 or an offset ``+1e2``, and hide a training length L below it)."""
    ax.set_xlim(length / 2, length * 1.5)
    ax.set_xticks([length], labels=[str(length)])
    ax.minorticks_off()


def _frame(ax: Axes, lengths: list[int], trained: list[int], log_lengths: bool, label_l: bool) -> None:
    """The length axis: linear (or base-2 log) over the evaluated lengths, L marked, beyond L shaded."""
    low, high = min(lengths), max(lengths)
    if low == high:
        _one_length_axis(ax, low)
    elif log_lengths and high / max(low, 1) >= 8:
        ax.set_xscale("log", base=2)
        ax.set_xlim(low, high)
    else:
        pad = max(0.5, 0.01 * (high - low))
        ax.set_xlim(low - pad, high + pad)
    for length in trained:
        ax.axvline(length, color="0.35", linestyle="--", linewidth=0.9, label="_L")
        if length < high:
            ax.axvspan(length, ax.get_xlim()[1], color="0.5", alpha=0.07, linewidth=0, label="_beyond L")
        if label_l:
            ax.annotate(
                f"L={length}",
                (length, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -3),
                textcoords="offset points",
                ha="left",
                va="top",
                fontsize=8,
                color="0.3",
            )
    ax.grid(alpha=0.3)


def curve_figure(
    records: list[Record],
    task: str,
    metric: str,
    encodings: list[str],
    *,
    title: str | None = None,
    log_scale: bool = False,
    length_label: str = "evaluation length",
    binomial: bool = False,
    unfit: dict[str, str] | None = None,
    log_lengths: bool = False,
    small_multiples: bool | None = None,
    width: float = 8.0,
) -> Figure:
    """``metric`` against evaluation length for each encoding (mean over seeds) with a 95% band.

    The band: with several seeds at a length, the Student's t interval of the mean across seeds
    (:func:`~posenc.experiments.results.records.seed_interval`); with one seed and ``binomial`` (the value
    is a fraction of examples, exact match) the Wilson interval from the record's example count;
    otherwise none. ``unfit``: ``{encoding: note}`` for encodings that did not fit their training
    lengths, drawn dashed and faded, the note in the legend ("did not fit: iid 4.0%").

    The length axis is linear over the evaluated lengths (``log_lengths``: base 2 when they span a
    factor of 8 or more; one length: its one tick, the point with its interval as error bars); a dashed line marks each training length L the records name ("L=16") and
    the lengths beyond it are shaded. ``log_scale``: a logarithmic y axis (perplexity) when every
    value is positive. ``small_multiples`` (default: more than :data:`SMALL_MULTIPLES_ABOVE`
    encodings): one panel per encoding, the others drawn faint grey behind it, titled by encoding.
    ``title`` defaults to ``"task: metric against length"``; ``width`` in inches.
    """
    unfit = unfit or {}
    cells_of = _records_by_length(records, task, metric)
    shown = [(index, enc) for index, enc in enumerate(encodings) if cells_of.get(enc)]
    lengths = sorted({r.length for r in records if r.task == task and r.metric == metric}) or [1]
    trained = sorted({r.train_length for r in records if r.task == task and r.train_length is not None})
    drawn = [r.value for r in records if r.task == task and r.metric == metric]
    many = len(shown) > SMALL_MULTIPLES_ABOVE if small_multiples is None else small_multiples
    axis = _LengthAxis(lengths, trained, log_lengths, length_label, metric.replace("_", " "))
    if many and shown:
        fig, axes = _small_multiples(cells_of, shown, unfit, binomial, axis, width)
    else:
        fig, axes = _one_panel(cells_of, shown, unfit, binomial, axis, width)
    _value_axis(axes, drawn, log_scale)
    set_title(fig, title if title is not None else f"{task + ': ' if task else ''}{metric} against length")
    return fig


def _value_axis(axes: list[Axes], drawn: list[float], log_scale: bool) -> None:
    """The value axis of every panel: logarithmic for ``log_scale`` when every ``drawn`` value is
    positive; ``[-0.05, 1.05]`` for one fraction; else matplotlib's."""
    if log_scale and drawn and min(drawn) > 0:
        for ax in axes:
            ax.set_yscale("log")
    elif drawn and len(set(drawn)) == 1 and 0 <= drawn[0] <= 1:
        for ax in axes:  # one fraction (one length, one seed): matplotlib would span it +- 0.05
            ax.set_ylim(-0.05, 1.05)


@dataclass(frozen=True)
class _LengthAxis:
    """What every panel of a curve figure shares: its lengths, training lengths and axis labels."""

    lengths: list[int]
    trained: list[int]
    log_lengths: bool
    x_label: str
    y_label: str


def _small_multiples(
    cells_of: dict[str, dict[int, list[Record]]],
    shown: list[tuple[int, str]],
    unfit: dict[str, str],
    binomial: bool,
    axis: _LengthAxis,
    width: float,
) -> tuple[Figure, list[Axes]]:
    """One panel per encoding, the others faint grey behind it; the length axis on each column's
    lowest panel."""
    cols = min(4, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig = new_figure(width, 1.9 * rows + 0.8)
    grid = fig.subplots(rows, cols, squeeze=False, sharex=True, sharey=True)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(shown) :]:
        ax.set_visible(False)
    for ax, (index, enc) in zip(axes, shown):
        for _, other in shown:
            if other != enc:
                cells = cells_of[other]
                ax.plot(sorted(cells), [np.mean([r.value for r in cells[n]]) for n in sorted(cells)],
                        color="0.6", alpha=0.35, linewidth=0.8, label="_others")  # fmt: skip
        _draw(ax, cells_of[enc], f"C{index % 10}", enc, binomial, enc in unfit)
        ax.set_title(f"{enc} ({unfit[enc]})" if enc in unfit else enc, fontsize=9,
                     color="0.45" if enc in unfit else "black")  # fmt: skip
        _frame(ax, axis.lengths, axis.trained, axis.log_lengths, label_l=ax is axes[0])
        ax.tick_params(labelsize=8)
    for col in range(cols):  # the lowest panel of each column carries the length axis
        bottom = grid[max(r for r in range(rows) if r * cols + col < len(shown))][col]
        bottom.xaxis.set_tick_params(labelbottom=True)
        bottom.set_xlabel(axis.x_label, fontsize=8)
    for row in grid:
        row[0].set_ylabel(axis.y_label, fontsize=8)
    return fig, axes


def _one_panel(
    cells_of: dict[str, dict[int, list[Record]]],
    shown: list[tuple[int, str]],
    unfit: dict[str, str],
    binomial: bool,
    axis: _LengthAxis,
    width: float,
) -> tuple[Figure, list[Axes]]:
    """Every encoding's curve in one panel, with a legend."""
    fig = new_figure(width, 0.6 * width)
    main = fig.subplots()
    for index, enc in shown:
        label = f"{enc} ({unfit[enc]})" if enc in unfit else enc
        _draw(main, cells_of[enc], f"C{index % 10}", label, binomial, enc in unfit)
    _frame(main, axis.lengths, axis.trained, axis.log_lengths, label_l=True)
    main.set_xlabel(axis.x_label)
    main.set_ylabel(axis.y_label)
    if shown:
        main.legend(fontsize=8)
    return fig, [main]
