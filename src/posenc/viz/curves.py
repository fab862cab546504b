"""The metric-against-length figure of an experiment: one line per encoding.

Drawn for ``posenc report`` and for the ``extrapolation.png`` that the experiment runner writes
(:func:`posenc.experiments.results.plot_results`), from records read by
:mod:`posenc.experiments.results`.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from ..experiments.results import Record, group_records
from .registry import new_figure, set_title

__all__ = ["curve_figure"]


def curve_figure(
    records: list[Record],
    task: str,
    metric: str,
    encodings: list[str],
    *,
    title: str | None = None,
    log_scale: bool = False,
    length_label: str = "evaluation length",
) -> Figure:
    """``metric`` against evaluation length for each encoding (mean over seeds, band = min..max).

    A dashed line marks each training length the records name. ``log_scale``: a logarithmic y axis
    (perplexity) when every value is positive. The length axis is logarithmic (base 2) when the
    lengths span a factor of 8 or more. ``title`` defaults to ``"task: metric against length"``.
    """
    grouped = group_records(records)
    fig = new_figure(8, 4.8)
    ax = fig.subplots()
    drawn: list[float] = []
    for index, enc in enumerate(encodings):
        cells = grouped.get((task, metric, enc))
        if not cells:
            continue
        lengths = sorted(cells)
        values = [np.asarray(cells[n]) for n in lengths]
        drawn += [float(v) for vs in values for v in vs]
        color = f"C{index % 10}"
        ax.plot(lengths, [v.mean() for v in values], marker="o", color=color, label=enc)
        if any(len(v) > 1 for v in values):
            ax.fill_between(
                lengths, [v.min() for v in values], [v.max() for v in values], color=color, alpha=0.15
            )
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
