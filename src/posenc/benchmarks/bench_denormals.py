"""Denormals: a bias far below the row maximum, flushed and not, side by side.

ALiBi's key term sends far logits hundreds below the row maximum; ``exp`` of them, and the backward's
products, fall below float32's smallest normal, and an x86 CPU pays a microcode assist for each
denormal unless the thread flushes them. posenc flushes around its CPU kernel calls
(:mod:`posenc.backends.parts.denormals`: every intra-op thread, the caller's setting restored). Cases,
attention alone (B=1, H=8, d=64, float32, ALiBi causal), one process, interleaved repeats:

* **plain causal SDPA** (the floor: no bias);
* **split, flushed**: posenc's near/far split as ``auto`` runs it;
* **split, kept**: the same calls under :func:`~posenc.backends.parts.denormals.keep_denormals`;
* **dense float mask, flushed / kept**: ``F.scaled_dot_product_attention`` with ALiBi's dense bias
  as a float mask (HF BLOOM's form), forward and backward inside a flushed block, and not.

The last column is each case's time over its own ``kept`` twin: the denormal penalty of this CPU
(an Intel Xeon pays several times; an AMD EPYC less).

    python -m posenc.benchmarks.bench_denormals [--sizes 2048,4096] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

import posenc
from posenc.backends import AttentionRequest
from posenc.backends.near_far import near_far_attention
from posenc.backends.parts.denormals import flush_scope, flushed_denormals, keep_denormals
from posenc.benchmarks._harness import interleaved, machine, markdown_table

HEADS, HEAD_DIM = 8, 64
CASES = ("sdpa", "split flushed", "split kept", "dense flushed", "dense kept")
NAMES = {
    "sdpa": "plain causal SDPA (floor)",
    "split flushed": "split, flushed (auto now)",
    "split kept": "split, denormals kept",
    "dense flushed": "dense float mask, flushed",
    "dense kept": "dense float mask, kept",
}


def build_cases(length: int, train: bool) -> dict[str, Callable[[], object]]:
    """The timed calls of one (length, pass)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, requires_grad=train) for _ in range(3))
    layer = posenc.MultiheadAttention(HEADS * HEAD_DIM, HEADS, "alibi", causal=True)
    pos = torch.arange(length)[None]
    dense = layer.encoding.bias_for_positions(pos, pos).to(torch.float32).expand(1, HEADS, length, length)
    dense = dense.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))

    def split():
        request = AttentionRequest.from_keywords(
            q=q, k=k, v=v, encoding=layer.encoding, q_pos=pos, k_pos=pos, scale=layer.scale, causal=True
        )
        return near_far_attention(request)

    def masked():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=layer.scale)

    def timed(fn, flush: bool):
        def call():
            scope = flushed_denormals(length * length * HEADS) if flush else keep_denormals()
            with scope:
                if not train:
                    with torch.no_grad():
                        return fn()
                fn().sum().backward()

        return call

    return {
        "sdpa": timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), False),
        "split flushed": timed(split, True),
        "split kept": timed(split, False),
        "dense flushed": timed(masked, True),
        "dense kept": timed(masked, False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for length in (int(s) for s in args.sizes.split(",")):
        for train in (False, True):
            timings = interleaved(build_cases(length, train), args.repeats)
            floor = timings["sdpa"].median
            for case in CASES:
                twin = {"split flushed": "split kept", "dense flushed": "dense kept"}.get(case, case)
                rows.append(
                    [
                        str(length),
                        "fwd+bwd" if train else "fwd",
                        NAMES[case],
                        timings[case].cell(),
                        f"{timings[case].median / floor:.2f}×",
                        f"{timings[case].median / timings[twin].median:.2f}×",
                    ]
                )
    print(f"ALiBi causal, denormals flushed and kept (B=1, H={HEADS}, d={HEAD_DIM}, float32); {machine()}")
    print(f"flush scope: {flush_scope()}\n")
    print(markdown_table(["L", "pass", "case", "median (min–max)", "× floor", "× kept twin"], rows))


if __name__ == "__main__":
    main()
