"""Section 2, per length: which runs a shard lacks; the results as heat map tables (encoding x
length, the colour the metric, the number in the cell where the cells are wide enough); the other
metrics against length; every seed's value in a collapsed section."""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from matplotlib import colormaps

from ...experiments.results.records import Record
from .length_curves import other_figures
from .pieces import note
from .view import FolderView

__all__ = ["HEADING", "ID", "render"]

ID = "per-length"
HEADING = "Per length"

#: Above this many lengths the heat map's cells are too narrow for numbers: colour only.
NUMBERS_UP_TO = 64
L_TITLE = ' title="L, the longest training size"'


def render(view: FolderView) -> str:
    missing = note(view.missing, id="missing") if view.missing else ""
    heat_maps = "".join(_heat_map(view, task, metric) for task, metric in _heat_map_order(view))
    return missing + heat_maps + other_figures(view) + _per_seed(view)


# ---------------------------------------------------------------------------- heat maps


@dataclass(frozen=True)
class Shading:
    """How a metric's heat map is coloured and labelled."""

    #: A fraction: a fixed 0-100% scale, cells in percent.
    fraction: bool
    higher_is_better: bool
    #: Log scaled colours (perplexity).
    log: bool
    label: str


def _shading(view: FolderView, metric: str) -> Shading:
    """The task's metric as the task states it; any other metric is a fraction when its values are."""
    headline = view.headline
    if headline is not None and metric == headline.name:
        return Shading(headline.fits, headline.higher_is_better, bool(headline.log_scale), headline.label)
    fraction = all(0 <= r.value <= 1 for r in view.records if r.metric == metric)
    return Shading(fraction, True, False, metric.replace("_", " "))


def _heat_map_order(view: FolderView) -> list[tuple[str, str]]:
    """Every (task, metric), the task's metric first."""
    headline = view.headline

    def key(pair: tuple[str, str]) -> tuple[bool, tuple[str, str]]:
        return headline is None or pair[1] != headline.name, pair

    return sorted({(r.task, r.metric) for r in view.records}, key=key)


def _heat_map(view: FolderView, task: str, metric: str) -> str:
    """Encoding x length as a table: each cell the mean over seeds, its background the colour of
    the value (a fraction on a fixed 0-100% scale; other metrics between their smallest and largest
    value, log scaled for perplexity, the better end dark), the number written where it fits."""
    records = [r for r in view.records if r.task == task and r.metric == metric]
    seeds = _values_by_cell(records)
    if not seeds:
        return ""
    means = {cell: float(np.mean(values)) for cell, values in seeds.items()}
    shading = _shading(view, metric)
    colour = _colour_scale(list(means.values()), shading)
    lengths = sorted({r.length for r in records})
    train_len = view.train_len
    numbers = len(lengths) <= NUMBERS_UP_TO
    digits = 1 if len(lengths) <= 24 else 0

    def bar(n: int) -> str:  # the first length past L: a bar on its left
        return " l" if train_len is not None and n == train_len + 1 else ""

    def cell(enc: str, n: int) -> str:
        if (enc, n) not in means:
            return "<td></td>"
        value, count = means[(enc, n)], len(seeds[(enc, n)])
        background, text = colour(value)
        tip = f"{enc} at {n}: {value:.4g}" + (f" (mean of {count} seeds)" if count > 1 else "")
        shown = _compact(value, shading.fraction, digits) if numbers else ""
        return (
            f'<td class="num{bar(n)}" style="background:{background};color:{text}" '
            f'title="{html.escape(tip)}">{shown}</td>'
        )

    head = "".join(f'<th class="num{bar(n)}"{L_TITLE if n == train_len else ""}>{n}</th>' for n in lengths)
    body = "".join(
        f'<tr><th class="enc"><code>{html.escape(enc)}</code></th>{"".join(cell(enc, n) for n in lengths)}</tr>'
        for enc in view.rows
        if any((enc, n) in means for n in lengths)
    )
    caption = (
        f"{html.escape(shading.label)}{' (%)' if shading.fraction else ''}, mean over seeds, by evaluation length"
        + (f"; the bar after L={train_len} starts the lengths never trained" if train_len else "")
        + ("" if numbers else "; hover a cell for its value")
    )
    return (
        f'<div class="scroll"><table class="heat" data-metric="{html.escape(metric)}"><caption>{caption}</caption>'
        f'<thead><tr><th class="enc">encoding</th>{head}</tr></thead><tbody>{body}</tbody></table></div>'
    )


def _values_by_cell(records: list[Record]) -> dict[tuple[str, int], list[float]]:
    """``{(encoding, length): [value per seed]}``."""
    cells: dict[tuple[str, int], list[float]] = {}
    for r in records:
        cells.setdefault((r.encoding, r.length), []).append(r.value)
    return cells


def _colour_scale(values: list[float], shading: Shading) -> Callable[[float], tuple[str, str]]:
    """``value -> (background, text colour)``: a fraction on a fixed 0-1 scale, other values between
    the smallest and the largest (log scaled when ``shading.log``), the better end dark."""
    log = shading.log and not shading.fraction
    if shading.fraction:
        low, high = 0.0, 1.0
    else:
        finite = np.asarray(values)[np.isfinite(values)]
        low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        if shading.log and low > 0:
            low, high = math.log(low), math.log(high)
    cmap = colormaps["YlGnBu"]

    def colour(value: float) -> tuple[str, str]:
        v = math.log(value) if (log and value > 0) else value
        t = 0.5 if high == low else (v - low) / (high - low)
        t = t if shading.higher_is_better else 1.0 - t
        r, g, b, _ = cmap(0.05 + 0.9 * min(max(t, 0.0), 1.0))
        text = "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 0.55 else "#111"
        return f"rgb({int(255 * r)},{int(255 * g)},{int(255 * b)})", text

    return colour


def _compact(value: float, fraction: bool, digits: int) -> str:
    """A heat map cell: a fraction as a percentage (``digits`` decimals), other values in three
    significant figures (``1.2k`` from a thousand)."""
    if math.isnan(value):
        return ""
    if fraction:
        return f"{100 * value:.{digits}f}"
    if abs(value) >= 1000:
        return f"{value / 1000:.1f}k" if abs(value) < 1e5 else f"{value:.0e}"
    return f"{value:.3g}"


# ---------------------------------------------------------------------------- every seed


def _per_seed(view: FolderView) -> str:
    """Every seed's value at every length: one row per (task, metric, encoding, seed)."""
    records = view.records
    lengths = sorted({r.length for r in records})
    cells: dict[tuple[str, str, str, int], dict[int, float]] = {}
    for r in records:
        cells.setdefault((r.task, r.metric, r.encoding, r.seed), {})[r.length] = r.value
    order = {enc: i for i, enc in enumerate(view.rows)}
    body = []
    for (task, metric, enc, seed), values in sorted(
        cells.items(), key=lambda item: (item[0][0], item[0][1], order.get(item[0][2], 1e9), item[0][3])
    ):
        fmt = _value_format(view, metric)
        row = "".join(f'<td class="num">{fmt(values[n]) if n in values else ""}</td>' for n in lengths)
        body.append(
            f"<tr><td>{html.escape(task)}</td><td>{html.escape(metric)}</td>"
            f'<td><code>{html.escape(enc)}</code></td><td class="num">{seed}</td>{row}</tr>'
        )
    head = "".join(f'<th class="num">{n}</th>' for n in lengths)
    return (
        f'<details id="per-seed"><summary>Every seed at every length ({len(records)} records, '
        f"{len({r.seed for r in records})} seed(s))</summary>"
        f'<div class="scroll"><table id="results"><thead><tr><th>task</th><th>metric</th><th>encoding</th>'
        f"<th>seed</th>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div></details>"
    )


def _value_format(view: FolderView, metric: str) -> Callable[[float], str]:
    """The task's metric as the task writes it; any other metric in four significant figures."""
    if view.headline is not None and metric == view.headline.name:
        return view.headline.format
    return lambda value: f"{value:.4g}"
