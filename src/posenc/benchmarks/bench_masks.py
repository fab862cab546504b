"""Attention patterns: sliding windows, packed documents and sinks against full causal attention.

Each row times one ``posenc.MultiheadAttention`` (RoPE, causal, batch 1, 8 heads of 64, float32)
with a pattern, side by side with the same layer without it (plain causal SDPA, its fastest path),
interleaved in one process. A ratio above 1 means the pattern runs that many times faster than full
causal attention at the same length. Peak memory of one forward+backward comes from a fresh
process.

A second table (issue 36) times a bidirectional sliding window (``causal=False, window=W``: key ``j``
visible from query ``i`` iff ``|i - j| < W``, backend ``auto``) against what a model without posenc
runs: the same layer on plain ``scaled_dot_product_attention`` (``backend="sdpa"``) with the window
as a dense ``[1, 1, L, L]`` bool ``attn_mask``, built once outside the timed call, as HF's sdpa
path does per forward.

    python -m posenc.benchmarks.bench_masks [--sizes 2048,8192] [--window 512] [--documents 8] [--repeats 3]
        [--bidirectional-window 256] [--patterns window,documents,sinks,bidirectional]
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
    ran_on,
)

HEADS, HEAD_DIM = 8, 64
EMBED = HEADS * HEAD_DIM


CAUSAL_PATTERNS = ("window", "documents", "sinks")
PATTERNS = (*CAUSAL_PATTERNS, "bidirectional")


def _layer(causal: bool = True, **options) -> posenc.MultiheadAttention:
    torch.manual_seed(0)
    return posenc.MultiheadAttention(EMBED, HEADS, "rope", causal=causal, **options)


def band_mask(length: int, window: int) -> torch.Tensor:
    """The bidirectional window as HF's sdpa path hands it to SDPA: bool ``[1, 1, L, L]``,
    True where ``|i - j| < window``."""
    i = torch.arange(length)
    return ((i[:, None] - i[None, :]).abs() < window)[None, None]


def _call(layer, length: int, train: bool, documents: int | None = None, attn_mask=None):
    x = torch.randn(1, length, EMBED, requires_grad=train)
    kwargs = {}
    if documents:
        kwargs["document_ids"] = (torch.arange(length) * documents // length)[None]
    if attn_mask is not None:
        kwargs["attn_mask"] = attn_mask

    def forward():
        with torch.no_grad():
            layer(x, **kwargs)

    def forward_backward():
        layer(x, **kwargs).sum().backward()

    call = forward_backward if train else forward
    call.layer = layer  # read by ran_on: the row names the backend auto chose
    return call


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
    if case == "bidirectional":
        return _call(_layer(causal=False, window=params["bidirectional_window"]), length, train)
    if case == "bidirectional dense":
        mask = band_mask(length, params["bidirectional_window"])
        return _call(_layer(causal=False, backend="sdpa"), length, train, attn_mask=mask)
    raise ValueError(f"unknown case {case!r}")


def _causal_rows(length: int, train: bool, params: dict, patterns: list[str], args) -> list[list[str]]:
    cases = {name: build_case(name, params) for name in ("full", *patterns)}
    timings = interleaved(cases, args.repeats)
    full = timings["full"].median
    memory = {}
    if train and not args.no_memory and "window" in patterns:
        memory = {
            name: peak_memory_mb("bench_masks", name, threads=torch.get_num_threads(), **params)
            for name in ("full", "window")
        }
    labels = {"window": f"window {args.window}", "documents": f"{args.documents} documents", "sinks": "sinks"}
    return [
        [
            str(length),
            "fwd+bwd" if train else "fwd",
            labels[name],
            timings["full"].cell(),
            timings[name].cell(),
            f"{full / timings[name].median:.2f}×",
            memory_cell(memory.get(name)) if name in memory else "—",
            memory_cell(memory.get("full")) if name in memory else "—",
        ]
        for name in patterns
    ]


def _bidirectional_row(length: int, train: bool, params: dict, args) -> list[str]:
    """The bidirectional window (auto) against the same layer on SDPA with the dense band mask."""
    cases = {name: build_case(name, params) for name in ("bidirectional dense", "bidirectional")}
    timings = interleaved(cases, args.repeats)
    dense, window = timings["bidirectional dense"], timings["bidirectional"]
    memory = {}
    if train and not args.no_memory:
        memory = {
            name: peak_memory_mb("bench_masks", name, threads=torch.get_num_threads(), **params)
            for name in cases
        }
    return [
        str(length),
        "fwd+bwd" if train else "fwd",
        ran_on(f"window {args.bidirectional_window}", cases["bidirectional"]),
        dense.cell(),
        window.cell(),
        f"{dense.median / window.median:.2f}×",
        memory_cell(memory["bidirectional"]) if memory else "—",
        memory_cell(memory["bidirectional dense"]) if memory else "—",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2048,8192")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--bidirectional-window", type=int, default=256, help="W of the bidirectional row")
    parser.add_argument("--patterns", default=",".join(PATTERNS), help=f"comma-separated, from {PATTERNS}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    args = parser.parse_args()
    patterns = args.patterns.split(",")
    if unknown := sorted(set(patterns) - set(PATTERNS)):
        parser.error(f"--patterns: unknown {unknown}; choose from {list(PATTERNS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    causal = [name for name in CAUSAL_PATTERNS if name in patterns]
    rows, bidirectional = [], []
    for length in (int(s) for s in args.sizes.split(",")):
        for train in (False, True):
            params = {
                "length": length,
                "train": train,
                "window": args.window,
                "documents": args.documents,
                "bidirectional_window": args.bidirectional_window,
            }
            if causal:
                rows += _causal_rows(length, train, params, causal, args)
            if "bidirectional" in patterns:
                bidirectional.append(_bidirectional_row(length, train, params, args))
    if rows:
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
    if bidirectional:
        print(
            f"\nBidirectional window vs SDPA with the dense [1, 1, L, L] bool mask (RoPE layer, non-causal, "
            f"B=1, H={HEADS}, d={HEAD_DIM}); {machine()}\n"
        )
        header = [
            "L",
            "pass",
            "window (backend)",
            "dense-mask SDPA",
            "window time",
            "speed-up",
            "peak (window)",
            "peak (dense)",
        ]
        print(markdown_table(header, bidirectional))


if __name__ == "__main__":
    if "--memory-case" in sys.argv:
        memory_main(build_case)
    else:
        main()
