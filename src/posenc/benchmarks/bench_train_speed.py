"""Training speed: posenc ``TransformerLM`` against x-transformers ``TransformerWrapper(Decoder)``.

Both models have the same width, depth, heads, head size and feed-forward width, run the same
AdamW training step (forward, cross-entropy, backward, optimizer step) on the same batches, in one
process, with repeats interleaved (ours, theirs, ours, theirs, ...) so that machine noise hits both.
Reported: training steps per second, median and min-max over repeats, and the ratio
ours / x-transformers (> 1: we are faster). Encodings compared where both libraries have them:
learned absolute, RoPE and ALiBi.

    python -m posenc.benchmarks.bench_train_speed                   # defaults: the extrapolate model size
    python -m posenc.benchmarks.bench_train_speed --d-model 256 --layers 4 --heads 8 --seq 256 --batch 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import posenc
from posenc.benchmarks._harness import machine

#: (posenc spec, x-transformers keyword arguments for TransformerWrapper / Decoder)
ENCODINGS = {
    "learned": ({"use_abs_pos_emb": True}, {}),
    "rope": ({"use_abs_pos_emb": False}, {"rotary_pos_emb": True}),
    "alibi": ({"use_abs_pos_emb": False}, {"alibi_pos_bias": True}),
}


def build_pair(name: str, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    from x_transformers import Decoder, TransformerWrapper

    wrapper_kw, decoder_kw = ENCODINGS[name]
    ours = posenc.TransformerLM(
        args.vocab,
        args.d_model,
        args.layers,
        args.heads,
        name,
        d_ff=4 * args.d_model,
        max_len=args.seq,
        backend=args.backend,
    )
    theirs = TransformerWrapper(
        num_tokens=args.vocab,
        max_seq_len=args.seq,
        attn_layers=Decoder(
            dim=args.d_model,
            depth=args.layers,
            heads=args.heads,
            attn_dim_head=args.d_model // args.heads,
            ff_mult=4,
            **decoder_kw,
        ),
        **wrapper_kw,
    )
    return ours, theirs


def steps_per_second(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]
) -> float:
    start = time.perf_counter()
    for tokens in batches:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return len(batches) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--encodings", default="learned,rope,alibi")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=48, help="tokens per example (the model sees seq - 1)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=68)
    parser.add_argument("--steps", type=int, default=20, help="training steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="auto", help="posenc attention backend (auto, sdpa, eager, ...)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq)) for _ in range(args.steps)]
    print(
        f"d_model={args.d_model} layers={args.layers} heads={args.heads} seq={args.seq} batch={args.batch} "
        f"threads={args.threads}, {args.steps} steps x {args.repeats} interleaved repeats; {machine()}"
    )
    print(
        f"{'encoding':<9} {'params ours/theirs':>19} {'posenc steps/s':>24} {'x-transformers steps/s':>24} {'ratio':>6}"
    )
    for name in args.encodings.split(","):
        ours, theirs = build_pair(name, args)
        runs = {
            "ours": (ours, torch.optim.AdamW(ours.parameters(), lr=1e-3)),
            "theirs": (theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-3)),
        }
        for model, optimizer in runs.values():  # warm-up (allocator, first-call overheads)
            steps_per_second(model, optimizer, batches[:3])
        rates: dict[str, list[float]] = {"ours": [], "theirs": []}
        for _ in range(args.repeats):
            for key, (model, optimizer) in runs.items():
                rates[key].append(steps_per_second(model, optimizer, batches))
        cells = [f"{statistics.median(v):7.1f} ({min(v):.1f}-{max(v):.1f})" for v in rates.values()]
        ratio = statistics.median(rates["ours"]) / statistics.median(rates["theirs"])
        params = f"{sum(p.numel() for p in ours.parameters())}/{sum(p.numel() for p in theirs.parameters())}"
        backends = ",".join(sorted({block.attn.last_backend for block in ours.blocks}))
        print(
            f"{name:<9} {params:>19} {cells[0]:>24} {cells[1]:>24} {ratio:6.2f}  (posenc backend: {backends})"
        )


if __name__ == "__main__":
    main()
