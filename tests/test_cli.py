"""The `posenc` command line: list and show."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

import posenc
from posenc.cli import _load_command_modules, app

runner = CliRunner()
_load_command_modules()


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
