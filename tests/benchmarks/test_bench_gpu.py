"""``posenc bench gpu`` (:mod:`posenc.benchmarks.gpu.bench_gpu`) run on the CPU: every section's code
but the CUDA calls, on small sizes. The exactness verdicts are checked against errors injected
here, and the sections' rows against what each section promises."""

from __future__ import annotations

import json

import pytest
import torch

from posenc.backends import available_backends
from posenc.benchmarks.gpu import bench_gpu

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
    sections = "exactness,flex,rope,generate"  # the compiled section compiles two models: slow, below
    assert (
        bench_gpu.main(
            [*QUICK, "--encodings", "rope,t5,fire,shaw", "--sections", sections, "--json", str(out)]
        )
        == 0
    )
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


@pytest.mark.slow
def test_the_compiled_generate_section_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert bench_gpu.main([*QUICK, "--sections", "compiled", "--new", "4", "--json", str(out)]) == 0
    found = json.loads(out.read_text())["compiled"]["implementations"]
    assert set(found) == {"sdpa", "posenc"} and all(r["token"] > 0 for r in found.values())
    assert "static cache + torch.compile" in capsys.readouterr().out
