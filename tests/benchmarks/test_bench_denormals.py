"""The denormal benchmark (posenc.benchmarks.bench_denormals) prints its rows, flushed and kept side by side."""

from __future__ import annotations

import subprocess
import sys


def test_denormal_bench_prints_its_rows_with_the_cpu_and_the_flush_scope():
    done = subprocess.run(
        [sys.executable, "-m", "posenc.benchmarks.bench_denormals", "--sizes", "384", "--repeats", "1",
         "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "CPUs (" in done.stdout and "flush scope: " in done.stdout
    for row in (
        "| 384 | fwd | plain causal SDPA (floor) |",
        "| 384 | fwd+bwd | split, flushed (auto now) |",
        "| 384 | fwd+bwd | split, denormals kept |",
        "| 384 | fwd | dense float mask, flushed |",
        "| 384 | fwd+bwd | dense float mask, kept |",
    ):
        assert row in done.stdout, done.stdout
