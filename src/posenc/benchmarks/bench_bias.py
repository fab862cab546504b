"""Bias attention (T5 buckets, ALiBi), causal, one layer with projections: posenc vs baselines.

Rows: plain SDPA without any bias (the floor), posenc on ``auto`` (the row names the backend
``auto`` ran, as the layer reports it: ``blocked`` below 1024 tokens, ``near_far`` from there),
posenc forced onto ``sdpa`` with the dense bias as float mask (what SDPA users do), HF
``T5Attention`` (dense ``position_bias``), x-transformers ``RelativePositionBias`` /
``AlibiPositionalBias`` feeding SDPA a dense mask, and the seed-000 T5 code (``T5RelativePositionBias``
building the dense ``(1, H, L, L)`` bias, then plain softmax attention) written as the seed describes it.
Every row includes the q/k/v/o projections; batch 1, 8 heads of 64, float32.

    python -m posenc.benchmarks.bench_bias [--sizes 512,1024,2048,4096] [--repeats 3] [--encoding t5|alibi]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
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
AUTO = "posenc auto"  # its rows are labelled with the backend auto ran: "posenc auto (near_far)"
EMBED = HEADS * HEAD_DIM
BUCKETS, MAX_DISTANCE = 32, 128


# ---------------------------------------------------------------------------- baselines


class _Projections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(EMBED, EMBED, bias=False) for _ in range(4))

    def heads(self, x):
        b, t, _ = x.shape
        return [p(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v)]

    def out(self, y):
        b, h, t, d = y.shape
        return self.o(y.transpose(1, 2).reshape(b, t, h * d))


def _causal_additive(length: int, dtype=torch.float32) -> torch.Tensor:
    mask = torch.full((length, length), torch.finfo(dtype).min).triu(1)
    return mask[None, None]


class SeedT5Bias(nn.Module):
    """seed-000 ``T5RelativePositionBias``: bucket the (Lq, Lk) distance matrix, look up (1, H, Lq, Lk)."""

    def __init__(self) -> None:
        super().__init__()
        self.relative_attention_bias = nn.Embedding(BUCKETS, HEADS)

    @staticmethod
    def bucket(relative_position):
        n = -relative_position
        ret = (n < 0).long() * (BUCKETS // 2)
        n = n.abs()
        max_exact = BUCKETS // 2  # as the seed writes it (it does not halve the buckets per direction)
        is_small = n < max_exact
        large = (
            max_exact
            + (
                torch.log(n.float() / max_exact) / math.log(MAX_DISTANCE / max_exact) * (BUCKETS - max_exact)
            ).long()
        )
        large = torch.minimum(large, torch.full_like(large, BUCKETS - 1))
        # As written, the seed's buckets reach 16 + 31 = 47 for a 32-row table (IndexError);
        # clamp so that the recipe runs; the cost is the same.
        return (ret + torch.where(is_small, n, large)).clamp(max=BUCKETS - 1)

    def forward(self, q_len, k_len):
        relative = torch.arange(k_len)[None, :] - torch.arange(q_len)[:, None]
        return self.relative_attention_bias(self.bucket(relative)).permute(2, 0, 1).unsqueeze(0)


class SeedT5Attention(_Projections):
    """The seed's recipe: scores = QKᵀ/√d + bias (dense), causal mask, softmax, @V."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = SeedT5Bias()

    def forward(self, x):
        q, k, v = self.heads(x)
        length = x.shape[1]
        scores = (
            q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
            + self.bias(length, length)
            + _causal_additive(length)
        )
        return self.out(torch.softmax(scores, dim=-1) @ v)


class XTransformersBias(_Projections):
    """x-transformers bias module (dense [H, L, L]) added to a causal mask, then SDPA."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        from x_transformers.x_transformers import AlibiPositionalBias, RelativePositionBias

        if kind == "t5":
            self.bias = RelativePositionBias(
                scale=1.0, causal=True, num_buckets=BUCKETS, max_distance=MAX_DISTANCE, heads=HEADS
            )
        else:
            self.bias = AlibiPositionalBias(heads=HEADS, total_heads=HEADS)

    def forward(self, x):
        q, k, v = self.heads(x)
        length = x.shape[1]
        mask = self.bias(length, length)[None] + _causal_additive(length)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


class HFT5(nn.Module):
    """HF ``T5Attention`` (decoder self-attention with its relative bias) and its dense causal mask."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config
        from transformers.models.t5.modeling_t5 import T5Attention

        config = T5Config(
            d_model=EMBED,
            d_kv=HEAD_DIM,
            num_heads=HEADS,
            relative_attention_num_buckets=BUCKETS,
            relative_attention_max_distance=MAX_DISTANCE,
            is_decoder=True,
            dropout_rate=0.0,
        )
        config._attn_implementation = "eager"
        self.attn = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)

    def forward(self, x):
        return self.attn(x, mask=_causal_additive(x.shape[1]))[0]


def build_layer(impl: str, encoding: str) -> nn.Module:
    spec = (
        f"t5:num_buckets={BUCKETS},max_distance={MAX_DISTANCE},bidirectional=False"
        if encoding == "t5"
        else "alibi"
    )
    if impl == "sdpa (no bias, floor)":
        return posenc.MultiheadAttention(EMBED, HEADS, None, causal=True, bias=False)
    if impl == AUTO:
        return posenc.MultiheadAttention(EMBED, HEADS, spec, causal=True, bias=False)
    if impl == "posenc sdpa + dense bias":
        return posenc.MultiheadAttention(EMBED, HEADS, spec, causal=True, bias=False, backend="sdpa")
    if impl == "HF T5Attention (dense bias)":
        return HFT5()
    if impl.startswith("x-transformers"):
        return XTransformersBias(encoding)
    if impl == "seed-000 T5 (dense bias)":
        return SeedT5Attention()
    raise ValueError(f"unknown implementation {impl!r}")


def implementations(encoding: str) -> list[str]:
    names = ["sdpa (no bias, floor)", AUTO, "posenc sdpa + dense bias"]
    if encoding == "t5":
        return [
            *names,
            "HF T5Attention (dense bias)",
            "x-transformers RelativePositionBias + SDPA",
            "seed-000 T5 (dense bias)",
        ]
    return [*names, "x-transformers AlibiPositionalBias + SDPA"]


def make_call(impl: str, encoding: str, length: int, train: bool):
    torch.manual_seed(0)
    layer = build_layer(impl, encoding)
    return layer_call(layer, length, EMBED, train)


def _memory_build(case: str, params: dict):
    return make_call(case, params["encoding"], params["length"], params["train"])


def run(sizes: list[int], repeats: int, encoding: str, memory: bool, peers_up_to: int) -> str:
    rows = []
    for length in sizes:
        for train in (False, True):
            cases = {}
            for impl in implementations(encoding):
                floor_or_ours = impl.startswith("sdpa (") or impl == AUTO
                if not floor_or_ours and length > peers_up_to:
                    cases[impl] = f"L>{peers_up_to} skipped by default"
                else:
                    cases[impl] = make_call(impl, encoding, length, train)
            timings = interleaved(cases, repeats)
            floor = timings["sdpa (no bias, floor)"]
            for impl, timing in timings.items():
                mem = None
                if memory and length == max(sizes) and not timing.skipped:
                    mem = peak_memory_mb(
                        "bench_bias",
                        impl,
                        encoding=encoding,
                        length=length,
                        train=train,
                        threads=torch.get_num_threads(),
                    )
                rows.append(
                    [
                        str(length),
                        "fwd+bwd" if train else "fwd",
                        ran_on(impl, cases[impl]) if impl == AUTO else impl,
                        timing.cell(),
                        ratio(timing, floor),
                        memory_cell(mem) if memory and length == max(sizes) else "",
                    ]
                )
            print(f"  L={length} {'fwd+bwd' if train else 'fwd'} done", file=sys.stderr, flush=True)
    header = ["L", "pass", "implementation", "median (min–max)", "× SDPA floor", "peak mem (largest L)"]
    title = f"### {encoding} bias attention, causal, B=1, H={HEADS}, d={HEAD_DIM}, float32\n\nMachine: {machine()}\n\n"
    return title + markdown_table(header, rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--encoding", choices=["t5", "alibi"], default="t5")
    parser.add_argument(
        "--peers-up-to", type=int, default=2048, help="largest L for the slow dense baselines"
    )
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    table = run(sizes, args.repeats, args.encoding, not args.no_memory, args.peers_up_to)
    print(table)
    return table


if __name__ == "__main__":
    if "--memory-case" in sys.argv:
        memory_main(_memory_build)
    else:
        main()
