"""Exact splits (near/far for T5 and ALiBi; mask segments for windows and documents) side by side.

Attention alone (no projections), B=1, H=8, d=64, float32, one process, interleaved repeats:

* **bias**: for each encoding, the plain SDPA floor (``is_causal``, or no mask for bidirectional),
  the blocked path of masked query blocks (``blocked_bias_attention``, the path before the split),
  and the near/far split (what ``auto`` runs now). T5's table is trainable (its gradient included).
  Shaw (k=16, key and value terms) and DeBERTa (c2p and p2c, span 256 without buckets), CONTENT:
  the ``relative`` backend's checkpointed query blocks (before) against the clipped split
  (``posenc.backends.clipped``, what ``auto`` runs now).
* **masks**: window 512 and 8 packed documents against one full causal SDPA pass: the masked blocks
  and the mask segments.

* **kernel** (asked for by name, not part of ``all``): where the split's time goes inside PyTorch's
  CPU flash kernel, and what the far part's extra head dimension costs on this CPU
  (:mod:`posenc.benchmarks.split_kernel`).

    python -m posenc.benchmarks.bench_split [--sizes 1024,2048,4096,8192] [--repeats 3] [--part bias|masks|kernel]
"""

from __future__ import annotations

import argparse
import sys

import torch

import posenc
from posenc.backends import AttentionRequest, segments
from posenc.backends.blocked import blocked_bias_attention
from posenc.backends.clipped import clipped_attention
from posenc.backends.near_far import near_far_attention
from posenc.backends.relative import relative_attention
from posenc.backends.segments import segment_attention
from posenc.benchmarks import split_kernel
from posenc.benchmarks._harness import (
    interleaved,
    machine,
    markdown_table,
    memory_cell,
    memory_main,
    peak_memory_mb,
)
from posenc.encodings.base import Kind
from posenc.masks.attention_mask import AttentionMask

HEADS, HEAD_DIM = 8, 64
#: encoding label -> (spec, causal)
ENCODINGS = {
    "t5 causal": ("t5:bidirectional=false", True),
    "t5 bidirectional": ("t5:bidirectional=true", False),
    "alibi causal": ("alibi", True),
    "alibi symmetric": ("alibi:mode=symmetric", False),
    "shaw k=16 causal": ("shaw:k=16", True),
    "shaw k=16 bidirectional": ("shaw:k=16", False),
    "deberta span 256 causal": ("deberta:position_buckets=-1,max_relative_positions=256", True),
    "deberta span 256 bidirectional": ("deberta:position_buckets=-1,max_relative_positions=256", False),
}


def _qkv(length: int, train: bool):
    torch.manual_seed(0)
    return [torch.randn(1, HEADS, length, HEAD_DIM, requires_grad=train) for _ in range(3)]


def _timed(fn, train: bool):
    def forward():
        with torch.no_grad():
            fn()

    def forward_backward():
        fn().sum().backward()

    return forward_backward if train else forward


def build_case(case: str, params: dict):
    """One timed call: ``case`` is ``"<label>|<impl>"``."""
    length, train = params["length"], params["train"]
    label, impl = case.split("|")
    q, k, v = _qkv(length, train)
    pos = torch.arange(length)[None]
    if label in ENCODINGS:
        spec, causal = ENCODINGS[label]
        # Through a layer: it fills in the encoding's sizes, and DeBERTa projects its table with the
        # layer's own projections.
        layer = posenc.MultiheadAttention(HEADS * HEAD_DIM, HEADS, spec, causal=causal)
        enc = layer.encoding
        content = enc.kind is Kind.CONTENT

        def request():
            return AttentionRequest.from_keywords(
                q=q,
                k=k,
                v=v,
                encoding=enc,
                q_pos=pos,
                k_pos=pos,
                scale=layer.scale,
                causal=causal,
                layer=layer,
            )

        run = {
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
            "blocked": lambda: (relative_attention if content else blocked_bias_attention)(request()),
            "split": lambda: (clipped_attention if content else near_far_attention)(request()),
        }[impl]
        return _timed(run, train)
    nope = posenc.build("nope")
    options = {"window": dict(window=params["window"])}.get(label, {})
    if label == "documents":
        docs = (torch.arange(length) * params["documents"] // length)[None]
        options = dict(q_document_ids=docs, k_document_ids=docs)

    def masked_request():
        mask = AttentionMask.build(q_len=length, k_len=length, batch=1, heads=HEADS, causal=True, **options)
        return AttentionRequest(q=q, k=k, v=v, encoding=nope, q_pos=pos, k_pos=pos, scale=0.125, mask=mask)

    def segments_mode():
        previous, segments.SEGMENT_MODE = segments.SEGMENT_MODE, "segments"
        try:
            return segment_attention(masked_request())
        finally:
            segments.SEGMENT_MODE = previous

    run = {
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        "blocked": lambda: blocked_bias_attention(masked_request()),
        "split": lambda: segment_attention(masked_request()),
        "segments": segments_mode,
    }[impl]
    return _timed(run, train)


IMPL_NAMES = {
    "sdpa": "plain causal SDPA (floor)",
    "blocked": "masked blocks / query blocks (before)",
    "split": "split (auto now)",
}
#: Mask rows only: the segment engine's other mode, anticausal / full / causal parts per block
#: (``SEGMENT_MODE="segments"``; auto runs ``"bands"``, one masked call per block shape).
MASK_ONLY = {"segments": "maskless segments + triangles"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part", choices=("bias", "masks", "all", "kernel"), default="all")
    parser.add_argument("--encodings", default=",".join(ENCODINGS))
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--memory", action="store_true", help="peak memory of fwd+bwd in a fresh process")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part == "kernel":
        _print_kernel_part([int(s) for s in args.sizes.split(",")], args.repeats)
        return
    labels = []
    if args.part in ("bias", "all"):
        asked = [e.strip() for e in args.encodings.split(",") if e.strip()]
        unknown = [e for e in asked if e not in ENCODINGS]
        if unknown:
            parser.error(f"--encodings: unknown {unknown}; choose from {', '.join(ENCODINGS)}")
        labels += asked
    if args.part in ("masks", "all"):
        labels += ["window", "documents"]
    rows = []
    for label in labels:
        for length in (int(s) for s in args.sizes.split(",")):
            for train in (False, True):
                params = {
                    "length": length,
                    "train": train,
                    "window": args.window,
                    "documents": args.documents,
                }
                impls = IMPL_NAMES if label in ENCODINGS else {**IMPL_NAMES, **MASK_ONLY}
                cases = {impl: build_case(f"{label}|{impl}", params) for impl in impls}
                timings = interleaved(cases, args.repeats)
                floor = timings["sdpa"].median
                for impl, name in impls.items():
                    memory = "—"
                    if args.memory and train:
                        memory = memory_cell(
                            peak_memory_mb(
                                "bench_split", f"{label}|{impl}", threads=torch.get_num_threads(), **params
                            )
                        )
                    floor_name = (
                        "no-mask SDPA (floor)"
                        if impl == "sdpa" and not ENCODINGS.get(label, ("", True))[1]
                        else name
                    )
                    rows.append(
                        [
                            label
                            if label in ENCODINGS
                            else f"{label} ({args.window if label == 'window' else args.documents})",
                            str(length),
                            "fwd+bwd" if train else "fwd",
                            floor_name,
                            timings[impl].cell(),
                            f"{timings[impl].median / floor:.2f}×",
                            memory,
                        ]
                    )
    print(
        f"Exact splits vs the SDPA floor (attention only, B=1, H={HEADS}, d={HEAD_DIM}, float32); {machine()}\n"
    )
    print(
        markdown_table(
            ["case", "L", "pass", "implementation", "median (min–max)", "× floor", "peak (fwd+bwd)"], rows
        )
    )


def _print_kernel_part(lengths: list[int], repeats: int) -> None:
    calls, layouts = [], []
    for length in lengths:
        params = {"length": length, "train": True}
        cases = {label: build_case(f"{label}|split", params) for label in ("alibi causal", "t5 causal")}
        cases["plain causal SDPA"] = build_case("alibi causal|sdpa", params)
        calls += split_kernel.call_rows(cases, length)
        layouts += split_kernel.layout_rows(length, HEADS, repeats)
    print(f"The split's calls of the CPU flash kernel (one fwd+bwd, torch.profiler); {machine()}\n")
    print(markdown_table(["case", "L", "pass", "part", "q shape", "calls", "ms", "share"], calls))
    print(f"\nThe flash kernel alone at the far part's rows, by layout; {machine()}\n")
    print(markdown_table(["q shape", "pass", "layout", "median (min–max)", "× D=64"], layouts))


if __name__ == "__main__":
    if "--memory-case" in sys.argv:
        memory_main(build_case)
    else:
        main()
