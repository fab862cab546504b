"""Section 1, the verdict: task, L and seeds in one line; the fit table in the order of the ranking
beyond L (each score with its 95% interval across seeds), rows that did not fit listed as not
ranked; each neighbour pair's ``posenc compare DIR A B`` verdict
(:func:`posenc.experiments.results.compare.rank_rows`); and the task's metric against length."""

from __future__ import annotations

import html

from ...experiments.results.compare import Ranking
from ...experiments.results.records import INTERVAL_METHOD
from ...experiments.results.summary import SummaryTable
from .length_curves import lead_figure
from .view import FolderView, Summary

__all__ = ["HEADING", "ID", "render"]

ID = "verdict"
HEADING = "Which encodings extrapolate beyond L, and how sure"


def render(view: FolderView) -> str:
    if view.study_table is not None:
        paired = "" if view.study_verdict is None else _study_table(view.study_verdict, "paired")
        table = paired + _study_table(view.study_table)
    elif view.summary is not None:
        table = _fit_table(view.summary, view.ranking, view.why_unranked)
    else:
        table = ""
    return _lede(view) + table + lead_figure(view)


def _study_table(table: SummaryTable, id: str = "summary") -> str:
    """A context-extension study's table as the command line prints it: its paired verdict (``id``
    ``paired``: one row per bucket or retrieval length) first, then one row per variant."""
    head = f"<th>{html.escape(table.columns[0])}</th>" + "".join(
        f'<th class="num">{html.escape(c)}</th>' for c in table.columns[1:]
    )
    body = "".join(
        f"<tr><td><code>{html.escape(row[0])}</code></td>"
        + "".join(f'<td class="num">{html.escape(cell)}</td>' for cell in row[1:])
        + "</tr>"
        for row in table.rows
    )
    notes = "".join(f'<p class="note">{html.escape(note)}</p>' for note in table.notes)
    caption = "" if id == "summary" else f"<caption>{html.escape(table.title)}</caption>"
    return (
        f'<div class="scroll"><table id="{id}">{caption}<thead><tr>{head}</tr></thead>'
        f'<tbody>{body}</tbody></table></div><div class="notes">{notes}</div>'
    )


def _lede(view: FolderView) -> str:
    """Task, L, evaluated lengths, seeds, rows, steps and the metric in one line."""
    settings = view.settings
    lengths = sorted({r.length for r in view.records})
    parts = []
    if settings.get("task"):
        parts.append(f"task <b>{html.escape(str(settings['task']))}</b>")
    if settings.get("hf_model"):  # a pretrained model, scored as it is: L is its context
        parts.append(
            f"pretrained {html.escape(str(settings['hf_model']))}, context <b>L = {int(settings['train_len'])}</b>"
        )
    elif settings.get("train_len"):
        parts.append(f"trained on sizes &le; <b>L = {int(settings['train_len'])}</b>")
    parts.append(f"evaluated at {lengths[0]}..{lengths[-1]}")
    parts.append(f"<b>{_count(len({r.seed for r in view.records}), 'seed')}</b>")
    parts.append(_count(len(view.encodings), "row"))
    if settings.get("steps"):
        parts.append(f"{settings['steps']} steps")
    if view.headline is not None:
        parts.append(f"scored by {html.escape(view.headline.label)}")
    if view.study:
        parts.append(_machine(view))
    return f'<p class="lede">{" · ".join(parts)}</p>'


def _machine(view: FolderView) -> str:
    """A study's precision and the CPU it ran on, with the ISA that decides its speed (``config.json``'s
    ``runtime``; a folder from before says "CPU not recorded")."""
    runtime = view.config.get("runtime") or {}
    dtype = html.escape(str(view.settings.get("dtype", "float32")))
    if not runtime.get("cpu"):
        return f"in {dtype}, CPU not recorded"
    isa = ", ".join(runtime.get("isa") or []) or "no AVX-512 or AMX"
    return f"in {dtype} on {html.escape(str(runtime['cpu']))} ({html.escape(isa)})"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _fit_table(summary: Summary, ranking: Ranking | None, why: str) -> str:
    """The fit table in ranking order (rank, in-distribution score with the seeds that fit, the
    score beyond L with its interval, the verdict against the next row), the neighbours'
    verdicts as sentences, then the table's notes."""
    table = summary.table
    head = "".join(f'<th class="num">{html.escape(c)}</th>' for c in table.columns[1:])
    head = f'<th class="num">rank</th><th>encoding</th>{head}<th>against the next</th>'
    notes = "".join(f'<p class="note">{html.escape(note)}</p>' for note in table.notes)
    return (
        f'<div class="scroll"><table id="summary"><thead><tr>{head}</tr></thead>'
        f"<tbody>{_table_body(summary, ranking, why)}</tbody></table></div>"
        f'{_neighbours(ranking)}<div class="notes">{notes}</div>'
    )


def _table_body(summary: Summary, ranking: Ranking | None, why: str) -> str:
    """One row per table row: the ranked first (numbered), then the rest (``-``, and why not ranked)."""
    cells_of = {row[0]: row[1:] for row in summary.table.rows}
    ranked = [name for name in (ranking.rows if ranking else []) if name in cells_of]
    against = _against_next(ranking)
    body = []
    for place, name in enumerate(ranked + [name for name in cells_of if name not in ranked], start=1):
        cells = "".join(f'<td class="num">{html.escape(cell)}</td>' for cell in cells_of[name])
        if name in ranked:
            kind, rank, last = "fit", str(place), against.get(name, "")
        else:
            mark = summary.unfit.get(name) or (ranking.unranked.get(name) if ranking else None)
            kind, rank, last = "unfit", "-", f"not ranked ({html.escape(mark or why or 'no ranking')})"
        body.append(
            f'<tr class="{kind}"><td class="num">{rank}</td>'
            f"<td><code>{html.escape(name)}</code></td>{cells}<td>{last}</td></tr>"
        )
    return "".join(body)


def _against_next(ranking: Ranking | None) -> dict[str, str]:
    """``{row: "beats <code>next</code>"}``: each ranked row's verdict against the row after it."""
    if ranking is None:
        return {}
    against = {}
    for comparison in ranking.neighbours:
        word = {"a": "beats", "b": "loses to"}.get(comparison.verdict, "cannot tell from")
        against[comparison.a] = f"{word} <code>{html.escape(comparison.b)}</code>"
    for (a, b), reason in ranking.uncompared.items():
        against[a] = (
            f'<span title="{html.escape(reason)}">no verdict against <code>{html.escape(b)}</code></span>'
        )
    return against


def _neighbours(ranking: Ranking | None) -> str:
    """Each neighbour pair's ``posenc compare`` verdict as a sentence, naming the interval method."""
    if ranking is None or not (ranking.neighbours or ranking.uncompared):
        return ""
    seeds = max((len(c.scores) for c in ranking.neighbours), default=1)
    method = (
        f"paired by seed, 95% {INTERVAL_METHOD} interval of the mean difference beyond L"
        if seeds > 1
        else "paired by seed; with one seed there is no interval, so no verdict (run --seeds 0,1,2)"
    )
    items = "".join(f"<li>{html.escape(c.sentence())}</li>" for c in ranking.neighbours)
    items += "".join(
        f"<li>{html.escape(a)} vs {html.escape(b)}: no verdict ({html.escape(why)})</li>"
        for (a, b), why in ranking.uncompared.items()
    )
    return (
        f'<div id="neighbours"><p>Neighbours in the ranking, as <code>posenc compare DIR A B</code> '
        f"judges them ({html.escape(method)}; cannot tell when it contains 0):</p><ul>{items}</ul></div>"
    )
