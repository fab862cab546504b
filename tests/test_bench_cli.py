"""``posenc bench`` without names runs what its ``--help`` says it runs (issue 49, item 14)."""

from __future__ import annotations

import re
import subprocess

from typer.testing import CliRunner

from posenc.cli import bench as bench_cli
from posenc.cli.app import _load_command_modules, app

_load_command_modules()


def _help_default() -> list[str]:
    """The benchmarks ``posenc bench --help`` says run by default, read from the printed help."""
    result = CliRunner().invoke(app, ["bench", "--help"], terminal_width=250)
    assert result.exit_code == 0, result.output
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())  # the help panel's frame, rewrapped
    found = re.search(r"\(default: ([^)]*)\)", text)
    assert found, text
    names = [name.strip() for name in found.group(1).split(",")]
    return list(bench_cli.BENCHMARKS) if names == ["all"] else names


def test_bench_without_names_runs_what_its_help_says(monkeypatch):
    """The help said "(default: all)" while the command ran bias, shaw and rope."""
    ran: list[str] = []

    def fake_run(argv, **kwargs):
        ran.append(argv[2].rsplit(".", 1)[1])  # python -m posenc.benchmarks.<module>
        return subprocess.CompletedProcess(argv, 0, stdout="| table |\n", stderr="")

    monkeypatch.setattr(bench_cli.subprocess, "run", fake_run)
    result = CliRunner().invoke(app, ["bench"])
    assert result.exit_code == 0, result.output
    promised = _help_default()
    assert set(promised) <= set(bench_cli.BENCHMARKS), promised
    assert ran == [bench_cli.BENCHMARKS[name][0] for name in promised]
