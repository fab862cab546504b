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


def test_the_kernel_part_names_the_far_part_s_calls_and_the_layouts():
    """ALiBi's far part runs the flash kernel on rows L - 128 - 1 with one extra head dimension (65);
    T5's far constant needs none (64). The layouts table times the kernel at those rows."""
    done = subprocess.run(
        [sys.executable, "-m", "posenc.benchmarks.bench_split", "--part", "kernel", "--sizes", "300",
         "--repeats", "1", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for row in (
        "| alibi causal | 300 | forward | far part | 1×8×171×65 | 1 |",
        "| alibi causal | 300 | backward | far part | 1×8×171×65 | 1 |",
        "| t5 causal | 300 | forward | far part | 1×8×171×64 | 1 |",
        "| 1×8×171 | backward | D=65, rows on 64 bytes (near_far) |",
        "| 1×8×171 | forward | D=64 (plain SDPA) | ",
    ):
        assert row in done.stdout, done.stdout
