"""The exact splits' benchmark (posenc.benchmarks.bench_split) prints its rows."""

from __future__ import annotations

import subprocess
import sys


def test_split_bench_prints_its_rows():
    done = subprocess.run(
        [sys.executable, "-m", "posenc.benchmarks.bench_split", "--sizes", "300", "--repeats", "1",
         "--encodings", "alibi causal", "--window", "64", "--documents", "3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for row in (
        "| alibi causal | 300 | fwd+bwd | split (auto now) |",
        "| window (64) | 300 | fwd |",
        "| documents (3) |",
    ):
        assert row in done.stdout, done.stdout
