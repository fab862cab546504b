"""The exact splits' benchmark (posenc.benchmarks.bench_split) prints its rows."""

from __future__ import annotations

import subprocess
import sys


def _bench_split(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m posenc.benchmarks.bench_split ARGS`` in a fresh process, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "posenc.benchmarks.bench_split", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_split_bench_prints_its_rows():
    done = _bench_split(
        "--sizes", "300", "--repeats", "1", "--encodings", "alibi causal", "--window", "64", "--documents", "3"
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for row in (
        "| alibi causal | 300 | fwd+bwd | split (auto now) |",
        "| window (64) | 300 | fwd |",
        "| documents (3) |",
    ):
        assert row in done.stdout, done.stdout


def test_the_kernel_part_names_the_far_part_s_calls_and_the_layouts():
    """The far part runs the flash kernel on rows L - 128 - 1 at the layer's head dim (64) for ALiBi (its
    key term as a mask) and for T5 (a far constant), plain SDPA's calls beside them and each case's time
    outside the kernel. The layouts table times the kernel at those rows."""
    done = _bench_split("--part", "kernel", "--sizes", "300", "--repeats", "1", "--threads", "1")
    assert done.returncode == 0, done.stderr
    for row in (
        "| alibi causal | 300 | forward | far part | 1×8×171×64 | 1 |",
        "| alibi causal | 300 | backward | far part | 1×8×171×64 | 1 |",
        "| t5 causal | 300 | forward | far part | 1×8×171×64 | 1 |",
        "| t5 causal | 300 | both | outside the flash kernel | — | — |",
        "| plain causal SDPA | 300 | backward | every row (SDPA) | 1×8×300×64 | 1 |",
        "| 1×8×171 | backward | D=64, key term as a [1, H, 1, n] mask (near_far) |",
        "| 1×8×171 | forward | D=65, rows on 64 bytes |",
        "| 1×8×171 | forward | D=64 (plain SDPA) | ",
    ):
        assert row in done.stdout, done.stdout


def test_an_unknown_encoding_label_is_refused_by_name():
    """A label the bias part does not know (``alibi`` for ``alibi causal``) exits 2 naming it and the
    labels there are, instead of being timed as a mask case under that name."""
    done = _bench_split(
        "--part", "bias", "--sizes", "300", "--repeats", "1", "--encodings", "alibi,t5 causal", timeout=120
    )
    assert done.returncode == 2, done.stdout
    assert "--encodings: unknown ['alibi']" in done.stderr and "alibi causal" in done.stderr
