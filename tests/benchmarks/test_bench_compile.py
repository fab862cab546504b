"""The compiled-generation benchmark (posenc.benchmarks.decoding.bench_compile) prints its rows for posenc's own
model against HF's Llama (compiling is slow: ``slow``), and refuses a model it does not know by name."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_compile_bench_prints_its_rows():
    done = subprocess.run(
        [sys.executable, "-m", "posenc.benchmarks.decoding.bench_compile", "--models", "lm", "--prompt", "16",
         "--new", "4", "--repeats", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # The llama4 rows' measurement (both copies compiled, the same tokens checked) is the one the GPU
    # bench's compiled section runs (tests/benchmarks/test_bench_gpu.py): not compiled a second time here.
    for row in (
        "HF generate: 16-token prompt, 4 new tokens",
        "| lm vs HF Llama | static + compile | sdpa |",
        "| lm vs HF Llama | static + compile | posenc TransformerLM |",
    ):
        assert row in done.stdout, done.stdout


def test_compile_bench_names_an_unknown_model():
    done = subprocess.run(
        [sys.executable, "-m", "posenc.benchmarks.decoding.bench_compile", "--models", "llama5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "--models: unknown ['llama5']" in done.stderr
