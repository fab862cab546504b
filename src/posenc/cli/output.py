"""What the commands print: Rich progress bars for the harness's callbacks, summary tables at the
terminal's width, and HF's own progress bars kept quiet while a command shows its own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .app import console

if TYPE_CHECKING:
    from ..experiments.results.summary import SummaryTable

__all__ = ["ProgressBars", "print_table", "quiet_hf_progress", "rich_table"]


class ProgressBars:
    """Rich progress bars for :func:`~posenc.experiments.run_experiment`'s callbacks: one bar for
    training and one for evaluation per run; log lines printed above them."""

    def __init__(self, console: Console, enabled: bool) -> None:
        self.enabled = enabled
        self.bars: dict[tuple[str, str], Any] = {}
        self.progress = Progress(
            TextColumn("{task.description:<28}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[note]}"),
            console=console,
            disable=not enabled,
        )

    def __enter__(self) -> ProgressBars:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def log(self, message: str) -> None:
        self.progress.console.print(message, style="cyan", markup=False, highlight=False, soft_wrap=True)

    def report(self, label: str, phase: str, done: int, total: int, note: str) -> None:
        if not self.enabled:
            return
        key = (label, phase)
        if key not in self.bars:
            self.bars[key] = self.progress.add_task(f"{phase:<5} {label}", total=total, note=note)
        self.progress.update(self.bars[key], completed=done, total=total, note=note)


def print_table(table: Table) -> None:
    """Print ``table``; into a file or pipe at its natural width (nothing there wraps lines), on a
    terminal at the terminal's."""
    width = None
    if not console.is_terminal:
        width = max(console.width, console.measure(table).maximum)
    console.print(table, width=width, crop=width is None)


def rich_table(summary: SummaryTable) -> SummaryTable:
    """What :func:`print_table` draws for a summary: the :class:`~posenc.experiments.results.summary.SummaryTable`
    itself, a Rich renderable that splits its columns into tables as wide as the terminal, so a
    number is never cut to ``4…`` (:meth:`~posenc.experiments.results.summary.SummaryTable.rich_tables`).

    Every piece is plain text, never Rich markup: the note ``[low, high]: 95% ...`` and a cell
    ``63.3% [4.5%, 100%]`` print as written."""
    return summary


@contextlib.contextmanager
def quiet_hf_progress() -> Iterator[None]:
    """HF transformers' own tqdm bars ("Loading weights", "Writing model shards") off inside the
    block, and as they were after it: ``--hf-model`` shows its own progress, and HF's bars printed
    into its output. Without transformers, nothing to do."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
