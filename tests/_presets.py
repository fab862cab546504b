"""The paper presets' tests' shared pieces (tests/experiments/presets/): the tiny scale their command lines
train at, and the command line run with its output."""

from __future__ import annotations

from typer.testing import CliRunner

SCALE = ["--steps", "1", "--d-model", "16", "--num-layers", "1", "--num-heads", "2", "--d-ff", "16"]


SCALE += ["--batch-size", "4", "--eval-examples", "1", "--workers", "1", "--no-progress"]


def _cli(args):
    from posenc.cli.app import app, console, load_command_modules

    load_command_modules()
    # Wide enough for the preset tables' headers on one line, whatever terminal a test worker has
    # (rich reads its width once per console, not from each CliRunner's environment).
    width, console.width = console.width, 200
    try:
        return CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    finally:
        console.width = width
