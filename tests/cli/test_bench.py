"""``posenc bench`` (posenc.cli.bench) works from any directory (the benchmarks ship in the package,
posenc.benchmarks), and without names runs what its ``--help`` says."""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import posenc.benchmarks
from posenc.cli import bench as bench_cli
from posenc.cli.app import app, load_command_modules

load_command_modules()

POSENC = str(Path(sys.executable).with_name("posenc"))


def _run_outside_checkout(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [POSENC, *args],
        cwd=tmp_path,
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_benchmark_module_imports():
    modules = [info.name for info in pkgutil.iter_modules(posenc.benchmarks.__path__)]
    assert {"_harness", "bench_bias", "bench_rope", "bench_shaw", "bench_train_speed"} <= set(modules)
    for name in modules:
        module = importlib.import_module(f"posenc.benchmarks.{name}")
        if name.startswith("bench_"):
            assert callable(module.main), f"{name} has no main()"


def test_bench_help_outside_the_checkout(tmp_path):
    done = _run_outside_checkout(tmp_path, "bench", "--help")
    assert done.returncode == 0, done.stderr
    for name in ("bias", "shaw", "rope"):
        assert name in done.stdout


def test_tiny_bench_runs_outside_the_checkout(tmp_path):
    out = tmp_path / "tables.md"
    done = _run_outside_checkout(
        tmp_path, "bench", "rope", "--args", "--shape 1,2,16,8 --repeats 1 --no-compile", "-o", str(out)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    table = out.read_text()
    assert "RoPE on q and k (1, 2, 16, 8)" in table
    assert "| posenc apply_rotary (out of place) |" in table and "| HF apply_rotary_pos_emb |" in table


# ----------------------------------------------------------------------------
# ``posenc bench`` without names runs what its ``--help`` says it runs (issue 49, item 14).


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
