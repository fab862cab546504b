"""The learnable and multimodal families of issue 37: ``auto`` against the ``eager`` reference, one layer.

For each family (HoPE, FoPE, ComRoPE, LieRE, STRING, GRAPE, GRAPE-A, PaTH, M-RoPE, and RoPE for
scale) one :class:`posenc.MultiheadAttention` with projections, causal, B=1, 4 heads of 64,
float32, is timed twice in one process with its repeats interleaved: ``backend="auto"`` (the row
names the backend it ran on) and ``backend="eager"`` (the reference every backend is checked
against: dense ``[B, H, L, L]`` logits). Forward under ``no_grad`` and forward + backward of
``out.sum()``; peak memory of one forward + backward in a fresh process. Long lengths (``--long``)
run once, without a warm-up call. PaTH's eager reference carries the keys one query at a time
(``O(L²·d)`` work, memory quadratic under autograd): past ``--path-eager`` tokens (forward) and
half that (forward + backward) its row says so and shows ``auto`` alone.

    python -m posenc.benchmarks.bench_families [--sizes 2048] [--long 8192] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys

import torch

import posenc
from posenc.benchmarks._harness import (
    interleaved,
    layer_call,
    machine,
    markdown_table,
    memory_cell,
    memory_main,
    peak_memory_mb,
    ran_on,
    ratio,
)

HEADS, HEAD_DIM = 4, 64
EMBED = HEADS * HEAD_DIM
#: The families timed (spec strings as ``posenc.build`` reads them); ``rope`` for scale.
FAMILIES = [
    "rope",
    "hope:train_length=2048",
    "fope",
    "comrope",
    "liere",
    "string",
    "grape",
    "grape_a",
    "path",
    "mrope",
]


def make_call(spec: str, backend: str, length: int, train: bool):
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(EMBED, HEADS, spec, causal=True, backend=backend)
    return layer_call(layer, length, EMBED, train)


def _memory_build(case: str, params: dict):
    spec, backend = case.split("@")
    return make_call(spec, backend, params["length"], params["train"])


def _eager_skip(spec: str, length: int, train: bool, path_eager: int) -> str | None:
    """Why the eager reference is not run (PaTH's dense carry past its limit), or None."""
    limit = path_eager // 2 if train else path_eager
    if spec == "path" and length > limit:
        return f"PaTH eager, O(L²·d) carry, {'memory' if train else 'time'}: run up to L={limit}"
    return None


def _measure(spec: str, length: int, train: bool, timing, memory: bool) -> str:
    if not memory or timing.skipped:
        return memory_cell(None) if memory else ""
    backend = timing.name
    mb = peak_memory_mb(
        "bench_families", f"{spec}@{backend}", length=length, train=train, threads=torch.get_num_threads()
    )
    return memory_cell(mb)


def run(
    sizes: list[int], long_sizes: list[int], repeats: int, memory: bool, path_eager: int, families: list[str]
):
    rows = []
    for length in sizes + long_sizes:
        long = length in long_sizes
        for train in (False, True):
            for spec in families:
                cases = {
                    "auto": make_call(spec, "auto", length, train),
                    "eager": _eager_skip(spec, length, train, path_eager)
                    or make_call(spec, "eager", length, train),
                }
                timings = interleaved(cases, 1 if long else repeats, warmup=0 if long else 1)
                auto, eager = timings["auto"], timings["eager"]
                measure = memory and train
                rows.append(
                    [
                        str(length),
                        "fwd+bwd" if train else "fwd",
                        ran_on(spec, cases["auto"]),
                        auto.cell(),
                        eager.cell(),
                        ratio(auto, eager),
                        _measure(spec, length, train, auto, measure),
                        _measure(spec, length, train, eager, measure),
                    ]
                )
                print(
                    f"  L={length} {'fwd+bwd' if train else 'fwd'} {spec} done", file=sys.stderr, flush=True
                )
    header = [
        "L",
        "pass",
        "family (auto's backend)",
        "auto",
        "eager",
        "auto / eager",
        "peak auto",
        "peak eager",
    ]
    title = (
        f"### New families: auto vs the eager reference, causal, B=1, H={HEADS}, d={HEAD_DIM}, float32\n\n"
        f"Machine: {machine()}\n\n(Median (min–max) of {repeats} interleaved repeats; long lengths once. "
        "Peak memory: one forward + backward in a fresh process.)\n\n"
    )
    return title + markdown_table(header, rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2048")
    parser.add_argument("--long", default="8192", help="long lengths, run once without warm-up; '' for none")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--path-eager", type=int, default=2048, help="longest length of PaTH's eager forward")
    parser.add_argument("--families", default=";".join(FAMILIES), help="spec strings separated by ';'")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    long_sizes = [int(s) for s in args.long.split(",") if s]
    families = [f for f in args.families.split(";") if f]
    table = run(sizes, long_sizes, args.repeats, not args.no_memory, args.path_eager, families)
    print(table)
    return table


if __name__ == "__main__":
    if "--memory-case" in sys.argv:
        memory_main(_memory_build)
    else:
        main()
