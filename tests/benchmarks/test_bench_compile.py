"""The compiled-generation benchmark (posenc.benchmarks.bench_compile) prints its rows for the random
Llama and for posenc's own model against it (compiling is slow: ``slow``), and refuses a model it does
not know by name."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_compile_bench_prints_its_rows():
    done = subprocess.run(
        [sys.executable, "-m", "posenc.benchmarks.bench_compile", "--models", "llama4,lm", "--prompt", "16",
         "--new", "4", "--repeats", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for row in (
        "| llama4 | static + compile | posenc |",
        "| llama4 | eager, dynamic cache | sdpa |",
        "| lm vs HF Llama | static + compile | posenc TransformerLM |",
    ):
        assert row in done.stdout, done.stdout


def test_compile_bench_names_an_unknown_model():
    done = subprocess.run(
        [sys.executable, "-m", "posenc.benchmarks.bench_compile", "--models", "llama5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "--models: unknown ['llama5']" in done.stderr
