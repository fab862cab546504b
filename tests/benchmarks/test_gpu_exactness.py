"""The GPU benchmark's exactness section (posenc.benchmarks.gpu._gpu_exactness): a backend off by more than eager
is a failure and fails the run; a nan is never within tolerance."""

from __future__ import annotations

import json
import math

import pytest
import torch

from posenc.benchmarks.gpu import _gpu_exactness, _gpu_timing, bench_gpu

pytestmark = pytest.mark.hf  # the generate section drives an HF Llama

QUICK = ["--device", "cpu", "--quick", "--threads", "1"]


def test_a_backend_off_by_more_than_eager_is_a_failure_and_fails_the_run(tmp_path, monkeypatch):
    """Corrupt sdpa's output by 1% (25x float32 rounding, more than twice eager's error): FAIL,
    exit status 1; the same on eager in bfloat16 is its dtype's reference, ``imprecise``."""
    run = _gpu_exactness._run

    def corrupted(layer, x, w, backend):
        out, grads = run(layer, x, w, backend)
        if backend == "sdpa":
            out = out + 0.01 * out.abs().max()
        return out, grads

    monkeypatch.setattr(_gpu_exactness, "_run", corrupted)
    out = tmp_path / "gpu.json"
    args = [*QUICK, "--sections", "exactness", "--encodings", "rope", "--backends", "eager,sdpa"]
    assert bench_gpu.main([*args, "--json", str(out)]) == 1
    rows = {(c["backend"], c["dtype"]): c for c in json.loads(out.read_text())["exactness"]}
    assert rows[("sdpa", "float32")]["status"] == "FAIL" and rows[("eager", "float32")]["status"] == "ok"
    assert rows[("sdpa", "float32")]["output_error"] == pytest.approx(0.01, rel=0.05)


def test_a_nan_is_never_within_tolerance():
    eager = _gpu_exactness.Check("rope", "eager", "float32", "", 1e-7, 1e-7)
    nan = _gpu_exactness.Check("rope", "sdpa", "float32", "", math.nan, 1e-7)
    assert _gpu_exactness._judged(nan, eager, torch.float32).status == "FAIL"
    assert math.isnan(_gpu_timing.relative_error(torch.tensor([math.nan]), torch.tensor([1.0])))
