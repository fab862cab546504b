"""The metric-against-length figure of an experiment: one line per encoding.

Drawn for ``posenc report`` and for the ``extrapolation.png`` that the experiment runner writes
(:func:`posenc.experiments.results.plot_results`), from records read by
:mod:`posenc.experiments.results`.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from ..experiments.results import Record, seed_interval, wilson_interval
from .registry import new_figure, set_title

__all__ = ["curve_figure"]


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
) -> Figure:
    """``metric`` against evaluation length for each encoding (mean over seeds) with a 95% band.

    The band: with several seeds at a length, the Student's t interval of the mean across seeds
    (:func:`~posenc.experiments.results.seed_interval`); with one seed and ``binomial`` (the value
    is a fraction of examples, exact match) the Wilson interval from the record's example count;
    otherwise none. ``unfit``: ``{encoding: note}`` for encodings that did not fit their training
    lengths, drawn dashed and faded, the note in the legend ("did not fit: iid 4.0%").
    A dashed line marks each training length the records name. ``log_scale``: a logarithmic y axis
    (perplexity) when every value is positive. The length axis is logarithmic (base 2) when the
    lengths span a factor of 8 or more. ``title`` defaults to ``"task: metric against length"``.
    """
    unfit = unfit or {}
    cells_of = _records_by_length(records, task, metric)
    fig = new_figure(8, 4.8)
    ax = fig.subplots()
    drawn: list[float] = []
    for index, enc in enumerate(encodings):
        cells = cells_of.get(enc)
        if not cells:
            continue
        lengths = sorted(cells)
        values = [np.asarray([r.value for r in cells[n]]) for n in lengths]
        drawn += [float(v) for vs in values for v in vs]
        color = f"C{index % 10}"
        style = dict(linestyle="--", alpha=0.5) if enc in unfit else {}
        label = f"{enc} ({unfit[enc]})" if enc in unfit else enc
        ax.plot(lengths, [v.mean() for v in values], marker="o", color=color, label=label, **style)
        bands = [_band(cells[n], binomial) for n in lengths]
        if any(band is not None for band in bands):
            low = [band[0] if band else np.nan for band in bands]
            high = [band[1] if band else np.nan for band in bands]
            ax.fill_between(lengths, low, high, color=color, alpha=0.15 if enc not in unfit else 0.07)
    if log_scale and drawn and min(drawn) > 0:
        ax.set_yscale("log")
    trained = {r.train_length for r in records if r.task == task and r.train_length is not None}
    for length in sorted(trained):
        ax.axvline(length, color="gray", linestyle="--", linewidth=0.8)
        ax.text(length, ax.get_ylim()[1], " train length", color="gray", fontsize=8, va="top")
    if records and max(r.length for r in records) / max(min(r.length for r in records), 1) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(length_label)
    ax.set_ylabel(metric.replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    set_title(fig, title if title is not None else f"{task + ': ' if task else ''}{metric} against length")
    return fig
