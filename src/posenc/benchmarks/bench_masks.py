"""Attention patterns: sliding windows, packed documents and sinks against full causal attention.

Each row times one ``posenc.MultiheadAttention`` (RoPE, causal, batch 1, 8 heads of 64, float32)
with a pattern, side by side with the same layer without it (plain causal SDPA, its fastest path),
interleaved in one process. A ratio above 1 means the pattern runs that many times faster than full
causal attention at the same length. Peak memory of one forward+backward comes from a fresh
process.

    python -m posenc.benchmarks.bench_masks [--sizes 2048,8192] [--window 512] [--documents 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys

import torch

import posenc
from posenc.benchmarks._harness import (
    interleaved,
    machine,
    markdown_table,
    memory_cell,
    memory_main,
    peak_memory_mb,
)

HEADS, HEAD_DIM = 8, 64
EMBED = HEADS * HEAD_DIM


def _layer(**options) -> posenc.MultiheadAttention:
    torch.manual_seed(0)
    return posenc.MultiheadAttention(EMBED, HEADS, "rope", causal=True, **options)


def _call(layer, length: int, train: bool, documents: int | None = None):
    x = torch.randn(1, length, EMBED, requires_grad=train)
    kwargs = {}
    if documents:
        kwargs["document_ids"] = (torch.arange(length) * documents // length)[None]

    def forward():
        with torch.no_grad():
            layer(x, **kwargs)

    def forward_backward():
        layer(x, **kwargs).sum().backward()

    return forward_backward if train else forward


def build_case(case: str, params: dict):
    length, train = params["length"], params["train"]
    if case == "full":
        return _call(_layer(), length, train)
    if case == "window":
        return _call(_layer(window=params["window"]), length, train)
    if case == "documents":
        return _call(_layer(), length, train, documents=params["documents"])
    if case == "sinks":
        return _call(_layer(sinks=True), length, train)
    raise ValueError(f"unknown case {case!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2048,8192")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for length in (int(s) for s in args.sizes.split(",")):
        for train in (False, True):
            params = {"length": length, "train": train, "window": args.window, "documents": args.documents}
            cases = {name: build_case(name, params) for name in ("full", "window", "documents", "sinks")}
            timings = interleaved(cases, args.repeats)
            full = timings["full"].median
            memory = {}
            if train and not args.no_memory:
                memory = {
                    name: peak_memory_mb("bench_masks", name, threads=torch.get_num_threads(), **params)
                    for name in ("full", "window")
                }
            for name in ("window", "documents", "sinks"):
                speedup = full / timings[name].median
                rows.append(
                    [
                        str(length),
                        "fwd+bwd" if train else "fwd",
                        {
                            "window": f"window {args.window}",
                            "documents": f"{args.documents} documents",
                            "sinks": "sinks",
                        }[name],
                        timings["full"].cell(),
                        timings[name].cell(),
                        f"{speedup:.2f}×",
                        memory_cell(memory.get(name)) if name in memory else "—",
                        memory_cell(memory.get("full")) if name in memory else "—",
                    ]
                )
    print(
        f"Attention patterns vs full causal attention (RoPE layer, B=1, H={HEADS}, d={HEAD_DIM}); {machine()}\n"
    )
    header = [
        "L",
        "pass",
        "pattern",
        "full causal",
        "pattern time",
        "speed-up",
        "peak (pattern)",
        "peak (full)",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    if "--memory-case" in sys.argv:
        memory_main(build_case)
    else:
        main()
