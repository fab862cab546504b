"""The ``posenc`` command line (posenc.cli.app): list and show, and what it prints reads as written: labels
taken from the dispatcher, ``--help`` paragraphs unbroken, the command list in order."""

from __future__ import annotations

import inspect
import itertools
import subprocess
import sys

import pytest
import torch
import typer
from typer.testing import CliRunner

import posenc
from posenc.cli.app import app, load_command_modules

runner = CliRunner()

load_command_modules()


def test_list_shows_every_encoding_with_kind_and_backends():
    result = runner.invoke(app, ["list"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for name in posenc.available():
        assert name in result.output
    assert "eager" in result.output and "bias" in result.output


def test_show_t5_prints_config_and_the_bucket_row():
    result = runner.invoke(app, ["show", "t5"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "num_buckets" in result.output and "max_distance" in result.output
    # The canonical bidirectional bucket of distance +1 is 17 (docs/conventions.md §4.2).
    assert "17" in result.output


def test_show_unknown_name_exits_with_a_suggestion():
    result = runner.invoke(app, ["show", "alibj"], terminal_width=200)
    assert result.exit_code == 2
    assert "did you mean 'alibi'" in result.output


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "posenc", "show", "rope:base=500000"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "500000" in out.stdout


def test_show_fills_the_required_example_options_a_spec_leaves_out():
    # sinusoidal2d needs grid_width; a spec that sets only base still gets the class's example width.
    result = runner.invoke(app, ["show", "sinusoidal2d:base=100"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "grid_width" in result.output and "100" in result.output


def _recording(builder, label: str, built: dict):
    def build(spec, *args, **kwargs):
        enc = builder(spec, *args, **kwargs)
        built[label] = enc.config()
        return enc

    return build


def test_show_and_plot_build_the_same_encoding_for_every_registered_name(monkeypatch, tmp_path):
    """``posenc show`` and ``posenc plot`` (default sizes) build equal encodings, bare or with options."""
    import posenc.cli.plots
    import posenc.examples

    built: dict[str, dict] = {}
    monkeypatch.setattr(
        posenc.examples, "build_example", _recording(posenc.examples.build_example, "show", built)
    )
    monkeypatch.setattr(
        posenc.cli.plots, "build_example", _recording(posenc.cli.plots.build_example, "plot", built)
    )
    specs = [*posenc.available(), "sinusoidal2d:base=100", "alibi:num_heads=4", "sinusoidal:dim=32"]
    for spec in specs:
        built.clear()
        shown = runner.invoke(app, ["show", spec], terminal_width=200)
        listed = runner.invoke(app, ["plot", spec, "--list"], terminal_width=200)
        assert shown.exit_code == 0 and listed.exit_code == 0, (spec, shown.output, listed.output)
        assert built["show"] == built["plot"], spec


# ----------------------------------------------------------------------------
# What the command line prints reads as written: no Rich markup read out of data, labels taken from the
# dispatcher, ``--help`` paragraphs unbroken.


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


def test_every_command_is_checked():
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"", "list", "show", "plot", "extrapolate", "compare", "merge", "report", "bench"} <= names
    assert {"submit", "slurm-torchrun", "models", "models fetch", "inspect"} <= names


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
        "extend",
        "study",
        "compare",
        "merge",
        "report",
        "bench",
        "models",
        "inspect",
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
