"""What the command line prints reads as written: no Rich markup read out of data, labels taken
from the dispatcher, ``--help`` paragraphs unbroken."""

from __future__ import annotations

import io

from rich.console import Console

from posenc import experiments_cli
from posenc.cli import _load_command_modules
from posenc.experiments.summary import INTERVAL_NOTE, SummaryTable

_load_command_modules()


def test_the_interval_note_and_bracketed_cells_print_whole_on_a_terminal(monkeypatch):
    """Rich read "[low, high]" as a markup tag and printed the note as ": 95% Student's t ..."."""
    buffer = io.StringIO()
    terminal = Console(file=buffer, force_terminal=True, width=250, color_system=None)
    monkeypatch.setattr(experiments_cli, "console", terminal)
    summary = SummaryTable(
        title="copy: exact match by length [bold]x[/bold] (3 seeds)",
        columns=["encoding", "mean 17..48"],
        rows=[["shaw [b]", "63.3% [4.5%, 100%]"], ["rope", "19.7% [low, high]"]],
        notes=(INTERVAL_NOTE + "; kept inside [0%, 100%]",),
    )
    experiments_cli.print_table(experiments_cli.rich_table(summary))
    text = " ".join(buffer.getvalue().split())  # Rich wraps the caption to the table's width
    assert "[low, high]: 95% Student's t interval of the mean across the n seeds" in text, text
    assert "; kept inside [0%, 100%]" in text
    assert "[bold]x[/bold]" in text and "shaw [b]" in text and "19.7% [low, high]" in text
    assert "63.3% [4.5%, 100%]" in text
