"""The piecewise-RoPE benchmark (posenc.benchmarks.bench_piecewise) prints its rows, and a reference
form too large for ``--reference-gb`` is a row that says so instead of a run."""

from __future__ import annotations

import subprocess
import sys

from posenc.benchmarks.bench_piecewise import HEADS, reference_gb


def test_piecewise_bench_prints_its_rows():
    done = subprocess.run(
        [sys.executable, "-m", "posenc.benchmarks.bench_piecewise", "--sizes", "600", "--repeats", "1",
         "--methods", "rerope", "--impls", "piecewise,reference", "--reference-gb", "0.04"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for row in (
        "| rerope | 600 | fwd | piecewise tiles (auto now) |",
        "| rerope | 600 | fwd+bwd | plain causal SDPA (floor) |",
        "| rerope | 600 | fwd | reference form (every part's [L, L] logits) |",
    ):
        assert row in done.stdout, done.stdout
    # ReRoPE's forward at 600: (2 parts + 2) x 8 heads x 600² float32 = 0.046 GB, over the limit
    assert reference_gb("rerope:window=4", 600) == 4 * HEADS * 600 * 600 * 4 / 1e9
    assert "needs about 0.046 GB of logits (over --reference-gb 0.04)" in done.stdout
