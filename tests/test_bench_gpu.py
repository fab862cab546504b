"""``posenc bench gpu`` (:mod:`posenc.benchmarks.bench_gpu`) run on the CPU: every section's code
but the CUDA calls, on small sizes. The exactness verdicts are checked against errors injected
here, and the sections' rows against what each section promises."""

from __future__ import annotations

import json
import math

import pytest
import torch

from posenc.backends import available_backends
from posenc.benchmarks import _gpu_exactness, _gpu_timing, bench_gpu

pytestmark = pytest.mark.hf  # the generate section drives an HF Llama

QUICK = ["--device", "cpu", "--quick", "--threads", "1"]


def _without_flex(monkeypatch):
    """The flex section without its flex rows: compiling FlexAttention on a CPU takes a minute;
    the slow test below runs it whole."""
    cases = bench_gpu._speed_cases
    monkeypatch.setattr(
        bench_gpu, "_speed_cases", lambda *a: {k: v for k, v in cases(*a).items() if k != "flex"}
    )


def test_every_section_runs_on_the_cpu_and_reports_what_it_promises(tmp_path, monkeypatch, capsys):
    _without_flex(monkeypatch)
    out = tmp_path / "gpu.json"
    assert bench_gpu.main([*QUICK, "--encodings", "rope,t5,fire,shaw", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # Exactness: every (encoding, backend of the CPU's order, dtype) once, eager served for all.
    rows = {(c["encoding"], c["backend"], c["dtype"]): c for c in result["exactness"]}
    expected = {
        (e, b, d)
        for e in ("rope", "t5", "fire", "shaw")
        for b in available_backends("cpu")
        for d in ("float32", "bfloat16")
    }
    assert set(rows) == expected and len(result["exactness"]) == len(expected)
    assert all(rows[(e, "eager", "float32")]["status"] == "ok" for e in ("rope", "t5", "fire", "shaw"))
    assert all(c["status"] in ("ok", "imprecise", "refused") for c in rows.values())
    assert all(c["note"] for c in rows.values() if c["status"] == "refused")  # the reason is kept
    assert rows[("rope", "sdpa", "float32")]["output_error"] < 1e-5  # float32 against float64
    # Flex against SDPA: both modes for T5 and ALiBi, each row timed or saying why not.
    flex = result["flex"]
    assert {(r["case"].split()[0], r["mode"]) for r in flex} == {
        (e, m) for e in ("t5", "alibi") for m in ("forward", "forward+backward")
    }
    assert all(r["median_ms"] is not None or r["note"] for r in flex)
    # RoPE: copy is 100% of itself; every case of both dtypes measured.
    rope = result["rope"]
    assert len(rope) == 8 and all(r["share_of_copy"] > 0 for r in rope)
    assert [r["share_of_copy"] for r in rope if r["case"] == "copy q,k"] == [1.0, 1.0]
    # Generate: the same tokens through sdpa and posenc.
    assert result["generate"]["same_tokens"] is True
    assert "### Exactness" in capsys.readouterr().out


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


def test_a_gradient_zero_in_exact_arithmetic_is_not_divided_by_its_rounding():
    """The key projection's bias gets no gradient under softmax (it shifts a row's logits alike):
    float64 gives ~1e-16, float32 ~1e-7; against the largest gradient that is no error."""
    ref = [torch.tensor([10.0], dtype=torch.float64), torch.tensor([1e-16], dtype=torch.float64)]
    got = [torch.tensor([10.0]), torch.tensor([2e-7])]
    assert _gpu_timing.relative_error(got[1], ref[1]) > 1e8  # what dividing by the noise gave
    assert _gpu_timing.gradients_error(got, ref) < 1e-5


def test_a_spent_budget_leaves_the_rest_not_run(tmp_path):
    out = tmp_path / "gpu.json"
    args = [*QUICK, "--sections", "exactness,rope", "--encodings", "rope", "--budget", "0"]
    assert bench_gpu.main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {c["status"] for c in result["exactness"]} == {"not run"}
    assert all(r.get("note") == "time budget spent" for r in result["rope"])


def test_bad_options_are_named():
    with pytest.raises(SystemExit, match="--encodings: unknown"):
        bench_gpu.main([*QUICK, "--encodings", "nosuch"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            bench_gpu.main(["--device", "cuda"])


@pytest.mark.slow
def test_the_flex_section_whole_on_the_cpu(tmp_path):
    """FlexAttention compiled on the CPU: its forward is timed; its backward is refused with the reason."""
    out = tmp_path / "gpu.json"
    assert bench_gpu.main([*QUICK, "--sections", "flex", "--lengths", "48", "--json", str(out)]) == 0
    rows = {(r["case"], r["mode"]): r for r in json.loads(out.read_text())["flex"]}
    for name in ("t5", "alibi"):
        backward = rows[(f"{name} flex", "forward+backward")]
        assert backward["median_ms"] is None and "backward" in backward["note"]
        assert rows[(f"{name} sdpa (dense bias)", "forward")]["median_ms"] is not None
