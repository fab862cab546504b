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


def test_the_compiled_case_keeps_its_block_open_across_repeats(monkeypatch):
    """The case opened ``cache.fixed_shapes()`` without a ``with``: the block's generator, left to the
    collector when the function returned, closed the block, and the first repeat's rewind failed."""
    import functools
    import gc

    import torch

    import posenc
    from posenc.benchmarks.decoding import bench_decode

    monkeypatch.setattr(bench_decode.torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(32, 4, "rope", causal=True).eval()
    prompt, xs = torch.randn(1, 5, 32), torch.randn(3, 1, 1, 32)
    case = bench_decode.compiled_case(layer, prompt, xs, 8)
    gc.collect()
    with torch.no_grad():
        outputs = []
        for _ in range(2):  # each repeat rewinds to the prompt and takes the same steps
            cache = case.setup()
            outputs.append([case.step(cache, i) for i in range(3)])
    assert all(torch.equal(a, b) for a, b in zip(*outputs, strict=True))
    torch._dynamo.reset()
