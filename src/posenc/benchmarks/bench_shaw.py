"""Shaw relative attention (k=16, key and value terms), one layer with projections: posenc vs the seed.

Rows: SDPA and plain eager attention without positions (floors), posenc ``shaw:k=16`` (``auto``:
the ``relative`` backend, one block while the dense logits are small, checkpointed query blocks
beyond), and the seed-000 ``RelPosAttention`` recipe: ``R = rel_emb(rel_pos)`` as an ``(L, L, d_k)``
tensor and ``einsum('bhld,lmd->bhlm', Q, R)``, with the value term written the same way
(``einsum('bhlm,lmd->bhld', attn, R_v)``; the seed shows only the key term). Non-causal, batch 1,
8 heads of 64, float32.

    python -m posenc.benchmarks.bench_shaw [--sizes 512,1024,2048] [--long 16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import nn

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

HEADS, HEAD_DIM = 8, 64
EMBED = HEADS * HEAD_DIM
CLIP = 16
SEED_LIMIT = 2048  # the seed's (L, L, 64) float32 tensors: 1 GiB each at L = 2048


class SeedShaw(nn.Module):
    """seed-000 ``RelPosAttention`` (unclipped table of 2·max_len − 1 rows), plus a value term."""

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(EMBED, EMBED) for _ in range(4))
        self.rel_emb = nn.Embedding(2 * max_len - 1, HEAD_DIM)
        self.rel_emb_v = nn.Embedding(2 * max_len - 1, HEAD_DIM)
        self.max_len = max_len

    def forward(self, x):
        b, length, _ = x.shape
        q, k, v = (
            w(x).view(b, length, HEADS, HEAD_DIM).transpose(1, 2) for w in (self.W_q, self.W_k, self.W_v)
        )
        rel_pos = torch.arange(length)[:, None] - torch.arange(length)[None, :] + self.max_len - 1
        r_k = self.rel_emb(rel_pos)  # (L, L, d_k)
        scores = (q @ k.transpose(-2, -1) + torch.einsum("bhld,lmd->bhlm", q, r_k)) / math.sqrt(HEAD_DIM)
        attn = torch.softmax(scores, dim=-1)
        out = attn @ v + torch.einsum("bhlm,lmd->bhld", attn, self.rel_emb_v(rel_pos))
        return self.W_o(out.transpose(1, 2).reshape(b, length, EMBED))


def build_layer(impl: str, length: int) -> nn.Module:
    if impl == "sdpa (no PE)":
        return posenc.MultiheadAttention(EMBED, HEADS, None)
    if impl == "eager (no PE)":
        return posenc.MultiheadAttention(EMBED, HEADS, None, backend="eager")
    if impl == "posenc shaw k=16":
        return posenc.MultiheadAttention(EMBED, HEADS, f"shaw:k={CLIP}")
    if impl == "seed-000 einsum (L,L,d)":
        return SeedShaw(length)
    raise ValueError(f"unknown implementation {impl!r}")


IMPLS = ["sdpa (no PE)", "eager (no PE)", "posenc shaw k=16", "seed-000 einsum (L,L,d)"]


def make_call(impl: str, length: int, train: bool):
    torch.manual_seed(0)
    layer = build_layer(impl, length)
    return layer_call(layer, length, EMBED, train)


def _memory_build(case: str, params: dict):
    return make_call(case, params["length"], params["train"])


def _skip_reason(impl: str, length: int, long: bool) -> str | None:
    if impl == "seed-000 einsum (L,L,d)" and length > SEED_LIMIT:
        gib = 2 * length * length * HEAD_DIM * 4 / 2**30
        return f"needs ≥ {gib:.0f} GiB for its two (L,L,d) tensors"
    if impl == "eager (no PE)" and long:
        return f"dense logits {HEADS * length * length * 4 / 2**30:.0f} GiB"
    return None


def run(sizes: list[int], long_sizes: list[int], repeats: int, memory: bool, long_train: bool) -> str:
    rows = []
    for length in sizes + long_sizes:
        long = length in long_sizes
        for train in (False, True):
            if long and train and not long_train:
                continue
            cases = {
                impl: (_skip_reason(impl, length, long) or make_call(impl, length, train)) for impl in IMPLS
            }
            timings = interleaved(cases, 1 if long else repeats, warmup=0 if long else 1)
            floor = (
                timings["eager (no PE)"] if not timings["eager (no PE)"].skipped else timings["sdpa (no PE)"]
            )
            measure_memory = memory and train and (length == max(sizes) or long)
            for impl, timing in timings.items():
                mem = None
                if measure_memory and not timing.skipped and impl != "sdpa (no PE)":
                    mem = peak_memory_mb(
                        "bench_shaw", impl, length=length, train=train, threads=torch.get_num_threads()
                    )
                rows.append(
                    [
                        str(length),
                        "fwd+bwd" if train else "fwd",
                        ran_on(impl, cases[impl]) if impl == "posenc shaw k=16" else impl,
                        timing.cell(),
                        ratio(timing, floor),
                        ratio(timing, timings["seed-000 einsum (L,L,d)"]),
                        memory_cell(mem) if measure_memory else "",
                    ]
                )
            print(f"  L={length} {'fwd+bwd' if train else 'fwd'} done", file=sys.stderr, flush=True)
    header = [
        "L",
        "pass",
        "implementation",
        "median (min–max)",
        "× eager floor",
        "× seed",
        "peak mem (fwd+bwd)",
    ]
    title = (
        f"### Shaw k={CLIP} (key + value terms), non-causal, B=1, H={HEADS}, d={HEAD_DIM}, float32\n\n"
        f"Machine: {machine()}\n\n(× eager floor: vs plain eager attention; at long L, vs SDPA.)\n\n"
    )
    return title + markdown_table(header, rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512,1024,2048")
    parser.add_argument(
        "--long", default="16384", help="long lengths run once (posenc and SDPA only); '' for none"
    )
    parser.add_argument(
        "--long-train", action="store_true", help="also fwd+bwd at the long lengths (minutes)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    long_sizes = [int(s) for s in args.long.split(",") if s]
    table = run(sizes, long_sizes, args.repeats, not args.no_memory, args.long_train)
    print(table)
    return table


if __name__ == "__main__":
    if "--memory-case" in sys.argv:
        memory_main(_memory_build)
    else:
        main()
