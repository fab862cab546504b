"""The metrics against length (:mod:`posenc.viz.curves`): the task's metric leads the verdict, the
other metrics follow the heat maps. Without the task's metric the first curve leads."""

from __future__ import annotations

from ..curves import SMALL_MULTIPLES_ABOVE, curve_figure
from .pieces import image
from .view import FolderView

__all__ = ["lead_figure", "other_figures"]

#: The width of every curve figure (inches).
WIDTH = 12.0


def lead_figure(view: FolderView) -> str:
    """The figure under the verdict: the task's metric against length (or the first curve)."""
    task, metric = _lead(view)
    return _headline_figure(view, task, metric) if _is_headline(view, metric) else _figure(view, task, metric)


def other_figures(view: FolderView) -> str:
    """Every other metric against length."""
    lead = _lead(view)
    return "".join(
        _figure(view, task, metric)
        for task, metric in _pairs(view)
        if (task, metric) != lead and not _is_headline(view, metric)
    )


def _pairs(view: FolderView) -> list[tuple[str, str]]:
    return sorted({(r.task, r.metric) for r in view.records})


def _is_headline(view: FolderView, metric: str) -> bool:
    return view.headline is not None and metric == view.headline.name


def _lead(view: FolderView) -> tuple[str, str]:
    """The last pair scored by the task's metric, else the first pair."""
    pairs = _pairs(view)
    return next((pair for pair in reversed(pairs) if _is_headline(view, pair[1])), pairs[0])


def _label(task: str, metric: str) -> str:
    return f"{task + ' · ' if task else ''}{metric} against length"


def _headline_figure(view: FolderView, task: str, metric: str) -> str:
    headline = view.headline
    assert headline is not None
    fig = curve_figure(
        view.records, task, metric, view.rows, binomial=headline.fits, unfit=view.unfit,
        log_scale=headline.log_scale, width=WIDTH, title="",
    )  # fmt: skip
    # Small multiples: the L line's label is on the first panel; say what the grey lines are.
    many = len({r.encoding for r in view.records if r.metric == metric}) > SMALL_MULTIPLES_ABOVE
    panels = "; each panel one encoding over the others in grey" if many else ""
    alt = f"{_label(task, metric)}{panels}; band: 95% interval; dashed line: L"
    return image(fig, alt, dpi=80, id="headline-figure")


def _figure(view: FolderView, task: str, metric: str) -> str:
    # A fraction (token accuracy) keeps its band inside [0, 1]; with one seed it has none
    # (the records' example counts are not its trials).
    values = [r for r in view.records if r.task == task and r.metric == metric]
    bounded = all(0 <= r.value <= 1 for r in values) and len({r.seed for r in values}) > 1
    fig = curve_figure(view.records, task, metric, view.rows, width=WIDTH, binomial=bounded)
    return image(fig, _label(task, metric), dpi=80)
