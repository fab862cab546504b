"""What the command line prints reads as written: no Rich markup read out of data, labels taken
from the dispatcher, ``--help`` paragraphs unbroken."""

from __future__ import annotations

import inspect
import io
import itertools

import pytest
import torch
import typer
from rich.console import Console
from typer.testing import CliRunner

import posenc
from posenc.cli import experiments as experiments_cli
from posenc.cli.app import _load_command_modules, app
from posenc.experiments.results.summary import INTERVAL_NOTE, SummaryTable

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
    from posenc.backends import dispatch, memo

    monkeypatch.setitem(dispatch.PRIORITY, "cpu", tuple(reversed(dispatch.DEFAULT_PRIORITY)))
    memo.bump()
    try:
        result = runner.invoke(app, ["list"], terminal_width=250)
    finally:
        monkeypatch.undo()
        memo.bump()
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


# ---------------------------------------------------------------------------- --help


def _commands(command, path=()):
    """(path, click command) for the group and every command under it, from a fresh build of the app:
    the docstrings and help strings as written."""
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


COMMANDS = list(_commands(typer.main.get_command(app)))


def _help(path, columns, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))
    result = runner.invoke(app, [*path, "--help"], terminal_width=columns)
    assert result.exit_code == 0, result.output
    return result.output


def _paragraphs(text: str) -> list[str]:
    """The paragraphs of a docstring or help string, each as one line of single spaces."""
    return [" ".join(p.split()) for p in inspect.cleandoc(text).split("\n\n") if p.strip()]


def test_every_command_is_checked():
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"", "list", "show", "plot", "extrapolate", "compare", "merge", "report", "bench"} <= names
    assert {"submit", "slurm-torchrun", "models", "models fetch"} <= names


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "posenc")
def test_help_paragraphs_are_never_broken_where_the_source_wraps(path, monkeypatch):
    """On a terminal wide enough for any paragraph, each docstring paragraph and each option's help
    is one line: a line break inside one is the source's hard wrap, which Rich kept (at 100 columns
    it broke `posenc compare`'s summary after "per-seed difference")."""
    command = dict(COMMANDS)[path]
    lines = [" ".join(line.replace("│", " ").split()) for line in _help(path, 3000, monkeypatch).splitlines()]
    wanted = _paragraphs(command.help or "")
    wanted += [p for param in command.params for p in _paragraphs(getattr(param, "help", None) or "")]
    assert wanted, f"{path}: no help text at all"
    for paragraph in wanted:
        assert any(paragraph in line for line in lines), (
            f"{' '.join(path)} --help: not on one line: {paragraph!r}"
        )
    if path == ():  # the command list shows each command's first paragraph
        for name, sub in command.commands.items():
            first = _paragraphs(sub.help or "")[0]
            assert any(line.startswith(f"{name} {first}") for line in lines), (name, first)


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "posenc")
def test_help_at_100_columns_wraps_only_where_the_next_word_does_not_fit(path, monkeypatch):
    """At 100 columns: each line of a paragraph ends only where its next word would not fit (Rich's
    wrapping, not the source's), no "<bool>" on flags and no default cut with an ellipsis."""
    text = _help(path, 100, monkeypatch)
    assert "<bool>" not in text and "…" not in text, text
    assert all(len(line) <= 100 for line in text.splitlines()), [
        line for line in text.splitlines() if len(line) > 100
    ]
    lines = text.splitlines()
    # the description: the lines between the usage line and the first panel, one space of margin
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("Usage:")) + 1
    end = next((i for i, line in enumerate(lines) if line.startswith("╭")), len(lines))
    block = [line.strip() for line in lines[start:end]]
    for line, following in itertools.pairwise(block):
        if line and following:
            assert len(line) + 1 + len(following.split()[0]) > 98, f"broken early: {line!r} / {following!r}"
    # panels: a cell's continuation line is blank up to the column its text starts in
    inner = [line[1:-1] for line in lines if line.startswith("│") and line.endswith("│")]
    for row, following in itertools.pairwise(inner):
        column = len(following) - len(following.lstrip())
        if column < 10 or not following.strip() or row[column - 1] != " " or row[column] == " ":
            continue  # not the continuation of a cell that starts in that column
        word = following.split()[0]
        if word.startswith(("[default", "[required", "[env")):
            continue  # typer puts these on a line of their own
        end = len(row.rstrip())
        assert end + 1 + len(word) > len(row) - 2, f"broken early: {row.rstrip()!r} / {following.strip()!r}"


def test_the_command_list_shows_what_the_library_does_first_and_the_cluster_last(monkeypatch):
    text = _help((), 100, monkeypatch)
    listed = [line.split()[1] for line in text.splitlines() if line.startswith("│ ") and line[2] != " "]
    listed = [name for name in listed if not name.startswith("-")]
    assert listed == [
        "list",
        "show",
        "plot",
        "extrapolate",
        "compare",
        "merge",
        "report",
        "bench",
        "models",
        "submit",
        "slurm-torchrun",
    ]
    merge = _help(("merge",), 100, monkeypatch)
    assert "DIRS" not in merge and "one of FOLDERS" in merge
    extrapolate = " ".join(_help(("extrapolate",), 3000, monkeypatch).split())
    assert (
        "the factor defaults to the longest evaluated sequence over the longest trained one, in tokens"
        in extrapolate
    )
