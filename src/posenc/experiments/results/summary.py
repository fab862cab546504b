"""The summary of an experiment: one row per encoding (and variant), fit first, as plain text cells.

:func:`summary_table` reads records only; the command line draws the :class:`SummaryTable` with
Rich, ``str(table)`` gives it as plain text, and the HTML report shows the same cells.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import ExperimentConfig, RunSpec
from ..tasks.catalog import Metric
from ..variant_specs import row_labels
from .records import IID, INTERVAL_METHOD, Record, SummaryRow, as_records, summarize

__all__ = ["INTERVAL_NOTE", "SummaryTable", "missing_runs", "missing_runs_note", "summary_table"]


@dataclass(frozen=True)
class SummaryTable:
    """The summary of an experiment as plain text cells (the CLI draws it with Rich)."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    #: Lines under the table: which rows cannot be ranked, and why.
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        widths = [max(len(c), *(len(row[i]) for row in self.rows)) for i, c in enumerate(self.columns)]
        lines = [self.title, "  ".join(c.ljust(w) for c, w in zip(self.columns, widths))]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in self.rows]
        return "\n".join(lines + list(self.notes))

    # ------------------------------------------------------------------ Rich (the terminal)

    def column_groups(self, width: int) -> list[list[int]]:
        """The number columns' indices in groups, each group drawn as one Rich table (with the first
        column repeated) no wider than ``width`` characters: a table wider than the terminal would
        have its cells cut to ``4…``. A column too wide for any table gets a group of its own."""
        widths = self._natural_widths()
        groups: list[list[int]] = []
        used = width + 1  # start a group at the first column
        for index in range(1, len(self.columns)):
            needed = widths[index] + _RULE
            if used + needed > width:
                groups.append([])
                used = _RULE + widths[0] + _RULE
            groups[-1].append(index)
            used += needed
        return groups or [[]]

    def rich_tables(self, width: int) -> list[Any]:
        """The table as Rich tables no wider than ``width`` (:meth:`column_groups`): the title over
        the first, the notes under the last. Every piece is plain text, never Rich markup (a cell
        ``63.3% [4.5%, 100%]`` prints as written); numbers are right-aligned and never cut: a
        column that cannot fit folds onto the next line instead."""
        from rich.table import Table
        from rich.text import Text

        groups = self.column_groups(width)
        tables = []
        for number, group in enumerate(groups):
            last = number == len(groups) - 1
            caption = Text("\n".join(self.notes)) if self.notes and last else None
            title = Text(self.title) if number == 0 else None
            table = Table(title=title, caption=caption, caption_justify="left")
            table.add_column(self.columns[0], justify="left", min_width=self._first_min_width(group, width),
                             overflow="fold")  # fmt: skip
            for index in group:
                table.add_column(self.columns[index], justify="right", overflow="fold")
            for row in self.rows:
                table.add_row(*(Text(row[i]) for i in [0, *group]))
            tables.append(table)
        return tables

    def _first_min_width(self, group: list[int], width: int) -> int:
        """The first column's least content width in the table of ``group``: its natural one, less
        what the group's columns need to fit in ``width``. Held at its natural width, a long
        encoding name on a narrow terminal left no room and Rich dropped every number column."""
        widths = self._natural_widths()
        others = sum(widths[i] + _RULE for i in group)
        return max(1, min(widths[0] - 2, width - 2 * _RULE - others - 2))

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from self.rich_tables(options.max_width)

    def __rich_measure__(self, console: Any, options: Any) -> Any:
        """Its natural width is that of one table holding every column."""
        from rich.measure import Measurement

        natural = _RULE + sum(width + _RULE for width in self._natural_widths())
        first = 2 * _RULE + self._natural_widths()[0]
        return Measurement(min(first, options.max_width), min(natural, options.max_width))

    def _natural_widths(self) -> list[int]:
        """Each column's width on the terminal, padding included: its header or widest cell
        (encoding names up to 40 characters), plus one space on each side."""
        widths = [max([len(c), *(len(row[i]) for row in self.rows)]) for i, c in enumerate(self.columns)]
        widths[0] = min(widths[0], 40)
        return [width + 2 for width in widths]


def summary_table(
    config: ExperimentConfig,
    records: Sequence[Record | dict[str, Any]],
    metric: Metric,
    runs: list[dict[str, Any]] | None = None,
) -> SummaryTable:
    """Per encoding: the in-distribution score (mean over lengths ``<= L``) with how many seeds fit
    (``"97.5%, 2/2"``; without fit flags, a seeds column and the plain score), then ``metric`` at the
    training length, mean beyond it (with a 95% Student's t interval across seeds), at
    L+1 and at 2L.

    Fit first: an encoding whose seeds do not all fit their training lengths is marked and listed
    as not ranked (what it does beyond L says nothing about how it generalizes). ``runs``: the
    per-run records (``runs.jsonl``); with ``until_fit`` a note gives the steps each run took.
    Variants (``eval_variants``) are rows of their own; the title says how many seeds it rests on.
    """
    records = as_records(records)
    threshold = config.fit_threshold if metric.fits else None
    bounds = (0.0, 1.0) if metric.fits else None  # a fraction of examples: its mean stays in [0, 1]
    rows = summarize(records, metric.name, config.train_len, row_labels(config), threshold, bounds=bounds)
    L = config.train_len
    # With fit flags, "fit k/n" also says how many seeds there are (one column less: 80 columns).
    seeds_column = threshold is None
    columns = ["encoding"] + (["seeds", f"<={L}"] if seeds_column else [f"<={L}, fit"])
    columns += [f"at L={L}", f"mean {L + 1}..{config.eval_len}", f"at L+1={L + 1}", f"at 2L={2 * L}"]
    cells, unfit = [], []
    for row in rows:
        iid = _cell(row["iid"], metric)
        if row["fit"] is not None:
            iid += f", {row['fit']}/{row['seeds']}"
            if row["fit"] < row["seeds"]:
                unfit.append(f"{row['encoding']} (in-distribution {_cell(row['iid'], metric)})")
        cells.append(
            [row["encoding"]]
            + ([str(row["seeds"]), iid] if seeds_column else [iid])
            + [_cell(row["at_train"], metric), _with_interval(row["beyond"], row["beyond_interval"], metric)]
            + [_cell(row[key], metric) for key in ("at_next", "at_double")]
        )
    notes = []
    if unfit:
        notes.append(
            f"not ranked, did not fit (every seed must reach {metric.format(config.fit_threshold)} in-distribution): "
            + ", ".join(unfit)
        )
    if any(row["beyond_interval"] is not None for row in rows):
        notes.append(INTERVAL_NOTE + ("; kept inside [0%, 100%]" if metric.fits else ""))
    if any(row["seeds"] == 1 for row in rows):
        notes.append("one seed: no interval; several seeds (--seeds 0,1,2) give a 95% interval across seeds")
    notes += _steps_to_fit_notes(runs or [], config)
    incomplete = missing_runs_note(config.task, config.encodings, config.seeds, records)
    if incomplete:
        notes.append(incomplete)
    title = f"{config.task}: {metric.label} by length (trained on <= {L}, evaluated to {config.eval_len}; "
    title += _seed_count(rows) + ")"
    return SummaryTable(title, columns, cells, tuple(notes))


#: The width of the rule Rich draws between two columns (and at each edge).
_RULE = 1


#: The note under a table whose cells carry intervals: what ``[low, high]`` is.
INTERVAL_NOTE = (
    f"[low, high]: 95% {INTERVAL_METHOD} interval of the mean across the n seeds "
    "(mean ± t(0.975, n-1) * s / sqrt(n), s their standard deviation)"
)


def _with_interval(value: float | None, interval: tuple[float, float] | None, metric: Metric) -> str:
    """``value [low, high]`` (the 95% Student's t interval across seeds), or the plain cell."""
    if interval is None or value is None:
        return _cell(value, metric)
    return f"{_cell(value, metric)} [{metric.format(interval[0])}, {metric.format(interval[1])}]"


def _cell(value: float | None, metric: Metric) -> str:
    """A table cell: the metric's format, '-' when not measured."""
    if value is None or math.isnan(value):
        return "-"
    return metric.format(value)


def _seed_count(rows: list[SummaryRow]) -> str:
    """What the table rests on: ``"3 seeds"``, or ``"1-3 seeds"`` when rows differ."""
    counts = sorted({row["seeds"] for row in rows if row["seeds"]})
    if not counts:
        return "no seeds"
    text = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{text} seed{'s' if counts[-1] > 1 else ''}"


def _steps_to_fit_notes(runs: list[dict[str, Any]], config: ExperimentConfig) -> list[str]:
    """With ``until_fit``: one line giving, per encoding, the step at which each seed's fit check
    passed ("-": not within ``steps``), from the per-run records. The check's examples are not the
    evaluation's, so a run can pass it and score just under the threshold on the evaluation."""
    if not config.until_fit:
        return []
    taken: dict[str, list[str]] = {}
    for record in runs:
        if record.get("metric") == IID and "steps_to_fit" in record and "variant" not in record:
            step = record["steps_to_fit"]
            if record["encoding"] in config.encodings and record.get("seed") in config.seeds:
                taken.setdefault(record["encoding"], []).append("-" if step is None else str(step))
    if not taken:
        return []
    cells = "; ".join(f"{encoding} {', '.join(steps)}" for encoding, steps in taken.items())
    return [
        f"fit check passed at step, per seed (--until-fit, every {config.fit_check_every} steps on examples "
        f"apart from the evaluation's, so a row may pass it and still not fit here; '-': not within "
        f"{config.steps}): {cells}"
    ]


def missing_runs(
    task: str, encodings: Iterable[str], seeds: Iterable[int], records: Iterable[Record | dict[str, Any]]
) -> list[RunSpec]:
    """The runs of the (encoding x seed) grid of ``task`` that have no record in ``records`` (a
    record without a task counts as one of ``task``)."""
    present = {(r.encoding, r.seed) for r in as_records(records) if r.task in ("", task)}
    grid = [RunSpec(encoding, seed) for seed in seeds for encoding in encodings]
    return [run for run in grid if (run.encoding, run.seed) not in present]


def missing_runs_note(
    task: str, encodings: Iterable[str], seeds: Iterable[int], records: Iterable[Record | dict[str, Any]]
) -> str | None:
    """One line saying which runs of the grid this folder lacks (None when it holds them all)."""
    encodings, seeds = list(encodings), list(seeds)
    missing = missing_runs(task, encodings, seeds, records)
    if not missing:
        return None
    total = len(encodings) * len(seeds)
    shown = ", ".join(run.label for run in missing[:8]) + (", ..." if len(missing) > 8 else "")
    return (
        f"incomplete: {len(missing)} of {total} runs have no results here ({shown}); a shard holds part "
        "of the grid: combine the shards' folders with posenc merge"
    )
