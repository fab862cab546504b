"""What the command line prints reads as written: no Rich markup read out of data, labels taken
from the dispatcher, ``--help`` paragraphs unbroken."""

from __future__ import annotations

import io

import torch
from rich.console import Console
from typer.testing import CliRunner

import posenc
from posenc import experiments_cli
from posenc.cli import _load_command_modules, app
from posenc.experiments.summary import INTERVAL_NOTE, SummaryTable

_load_command_modules()
runner = CliRunner()


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


def _listed(output: str) -> dict[str, str]:
    """``posenc list``'s backends column per encoding (a row's wrapped lines joined)."""
    rows: dict[str, str] = {}
    name = None
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) != 6:
            continue
        if cells[1]:
            name = cells[1]
            rows[name] = cells[4]
        elif name is not None and cells[4]:
            rows[name] += " " + cells[4]
    return rows


def test_list_names_the_exact_splits_that_serve_long_calls():
    """The column left out near_far (T5, ALiBi: from 1024 tokens) and clipped (Shaw, DeBERTa: from
    512 tokens and eight near blocks), which auto runs on long square self-attention."""
    result = runner.invoke(app, ["list"], terminal_width=250)
    assert result.exit_code == 0, result.output
    rows = _listed(result.output)
    assert rows["t5"].startswith("near_far (long), blocked") and rows["alibi"].startswith("near_far (long)")
    assert rows["shaw"].startswith("clipped (long), relative") and rows["deberta"].startswith(
        "clipped (long)"
    )
    assert rows["rope"] == "segments, blocked, sdpa, eager" and rows["cope"] == "relative, eager"
    assert "near_far" not in rows["rope"] and "clipped" not in rows["t5"]
    # auto's own choice on a long T5 call is the column's first entry
    layer = posenc.MultiheadAttention(64, 4, "t5", causal=True)
    with torch.no_grad():
        layer(torch.randn(1, 1024, 64))
    assert layer.last_backend == "near_far"


def test_list_follows_the_dispatchers_order(monkeypatch):
    """The column is asked of the dispatcher: reorder auto's list and the column follows."""
    from posenc.backends import dispatch

    monkeypatch.setitem(dispatch.PRIORITY, "cpu", tuple(reversed(dispatch.DEFAULT_PRIORITY)))
    dispatch._memo.bump()
    try:
        result = runner.invoke(app, ["list"], terminal_width=250)
    finally:
        monkeypatch.undo()
        dispatch._memo.bump()
    assert result.exit_code == 0, result.output
    rows = _listed(result.output)
    assert rows["t5"] == "eager, sdpa, blocked, near_far (long)"
    assert rows["shaw"] == "eager, relative, clipped (long)"


def test_bench_rows_name_the_backend_auto_ran():
    """bench_bias labelled its rows "posenc auto (blocked)" while auto ran near_far from 1024 tokens."""
    from posenc.benchmarks import bench_bias

    table = bench_bias.run([512, 1024], repeats=1, encoding="alibi", memory=False, peers_up_to=0)
    labels = {
        (row.split("|")[1].strip(), row.split("|")[2].strip()): row.split("|")[3].strip()
        for row in table.splitlines()
        if "posenc auto" in row
    }
    assert labels == {
        ("512", "fwd"): "posenc auto (blocked)",
        ("512", "fwd+bwd"): "posenc auto (blocked)",
        ("1024", "fwd"): "posenc auto (near_far)",
        ("1024", "fwd+bwd"): "posenc auto (near_far)",
    }, table
