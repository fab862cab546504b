"""The decode benchmark (posenc.benchmarks.decoding.bench_decode) prints the step, split and generation tables."""

from __future__ import annotations

import pytest


@pytest.mark.hf
def test_decode_bench_prints_the_step_split_and_generation_tables(capsys, monkeypatch):
    from posenc.benchmarks.decoding import bench_decode

    monkeypatch.setattr(
        "sys.argv",
        [
            "bench_decode",
            "--caches",
            "16",
            "--steps",
            "3",
            "--repeats",
            "1",
            "--prompt",
            "4",
            "--new",
            "3",
            "--no-compile",
        ],
    )
    bench_decode.main()
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("| 16 |")]
    assert [row.split("|")[2].strip() for row in steps] == [
        "plain loop",
        "posenc KVCache()",
        "posenc KVCache(max_length)",
    ]
    split = {row.split("|")[1].strip(): row for row in out.splitlines() if "µs |" in row and "%" in row}
    parts = {
        "cache check (writer, batch, device)",
        "cache write (in place)",
        "nan test (q, new key and value)",
    }
    parts |= {"projections q, k, v", "rotation (RoPE)", "kernel (sdpa)", "one step, all of it"}
    assert parts <= set(split)
    generation = [
        line for line in out.splitlines() if line.startswith(("| HF Llama", "| posenc TransformerLM"))
    ]
    assert len(generation) == 4 and all("×" in row for row in generation)
