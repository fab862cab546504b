"""Self-Extend, ReRoPE, Leaky ReRoPE and Dual Chunk Attention against one plain causal attention.

Attention alone (no projections), B=1, H=8, d=64, float32, one process, interleaved repeats. For
each method and length, four rows:

* **plain causal SDPA**: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on the
  unrotated inputs, the floor (RoPE's own rotation is not in it; the methods' rotations are);
* **piecewise** (what ``auto`` runs from :data:`~posenc.backends.piecewise.PIECEWISE_MIN_LEN`
  queries): the tiles of the CPU flash kernel merged by their log-sum-exp;
* **relative**: posenc's query-blocked exact path before it (each part's logits per block of 256
  queries, checkpointed under autograd);
* **reference form**: what the reference patches compute: every part's full ``[L, L]`` logits,
  each pair's taken from its part, one softmax (the ``eager`` backend); run only where those
  logits fit in ``--reference-gb``, else the row says what it would need.

The methods' options are those of a model trained at 4096 positions read to 16k:
Self-Extend ``G=5, w_n=1024`` (reach ``(4096 - 1024)·5 + 1024 = 16384``), ReRoPE ``w=1024``,
Leaky ReRoPE ``w=1024, k=16``, DCA ``chunk_size=3072, local_size=512`` (ChunkLlama's 3/4 and 1/8).

    python -m posenc.benchmarks.bench_piecewise [--sizes 4096,16384] [--repeats 3] [--memory]
"""

from __future__ import annotations

import argparse

import torch

import posenc
from posenc.backends import AttentionRequest, get_backend
from posenc.backends.piecewise import piecewise_attention
from posenc.backends.relative import relative_attention
from posenc.benchmarks._harness import (
    interleaved,
    machine,
    markdown_table,
    memory_cell,
    memory_main,
    peak_memory_mb,
)

HEADS, HEAD_DIM = 8, 64
#: method label -> spec
METHODS = {
    "self_extend": "self_extend:group_size=5,neighbor_window=1024",
    "rerope": "rerope:window=1024",
    "leaky_rerope": "leaky_rerope:window=1024,leaky_factor=16",
    "dca": "dca:chunk_size=3072,local_size=512",
}
IMPL_NAMES = {
    "sdpa": "plain causal SDPA (floor)",
    "piecewise": "piecewise tiles (auto now)",
    "relative": "relative query blocks (before)",
    "reference": "reference form (every part's [L, L] logits)",
}


def reference_gb(spec: str, length: int) -> float:
    """GB of float32 logits the reference form holds at once: one ``[H, L, L]`` per part, the merged
    copy and the probabilities (forward)."""
    parts = 3 if spec.startswith("dca") else 2
    return (parts + 2) * HEADS * length * length * 4 / 1e9


def build_case(case: str, params: dict):
    """One timed call: ``case`` is ``"<method>|<impl>"``."""
    method, impl = case.split("|")
    length, train = params["length"], params["train"]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, requires_grad=train) for _ in range(3))
    enc = posenc.build(METHODS[method], head_dim=HEAD_DIM)
    pos = torch.arange(length)[None]

    def request():
        return AttentionRequest.from_keywords(
            q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=HEAD_DIM**-0.5, causal=True
        )

    run = {
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        "piecewise": lambda: piecewise_attention(request()),
        "relative": lambda: relative_attention(request()),
        "reference": lambda: get_backend("eager").run(request())[0],
    }[impl]

    def forward():
        with torch.no_grad():
            run()

    def forward_backward():
        run().sum().backward()

    return forward_backward if train else forward


def _cases(method: str, params: dict, reference_limit: float, impls: list[str]) -> dict:
    cases = {}
    for impl in impls:
        need = reference_gb(METHODS[method], params["length"]) * (2 if params["train"] else 1)
        if impl == "reference" and need > reference_limit:
            cases[impl] = f"needs about {need:.2g} GB of logits (over --reference-gb {reference_limit:g})"
        else:
            cases[impl] = build_case(f"{method}|{impl}", params)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--impls", default=",".join(IMPL_NAMES), help="implementations (sdpa always runs)")
    parser.add_argument("--modes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both")
    parser.add_argument("--reference-gb", type=float, default=6.0, help="largest reference form run (GB)")
    parser.add_argument("--memory", action="store_true", help="peak memory of each case in a fresh process")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    impls = ["sdpa"] + [i for i in args.impls.split(",") if i and i != "sdpa"]
    unknown = sorted(set(impls) - set(IMPL_NAMES))
    if unknown:
        parser.error(f"--impls: unknown {unknown}; choose from {', '.join(IMPL_NAMES)}")
    rows = []
    for method in (m for m in args.methods.split(",") if m):
        for length in (int(s) for s in args.sizes.split(",")):
            for mode in (m for m in args.modes.split(",") if m):
                params = {"length": length, "train": mode == "fwd+bwd"}
                timings = interleaved(_cases(method, params, args.reference_gb, impls), args.repeats)
                for impl in impls:
                    name = IMPL_NAMES[impl]
                    timing = timings[impl]
                    memory = "—"
                    if args.memory and not timing.skipped:
                        threads = torch.get_num_threads()
                        mb = peak_memory_mb("bench_piecewise", f"{method}|{impl}", threads=threads, **params)
                        memory = memory_cell(mb)
                    ratio = "—" if timing.skipped else f"{timing.median / timings['sdpa'].median:.2f}×"
                    rows.append([method, str(length), mode, name, timing.cell(), ratio, memory])
    print(
        f"Piecewise RoPE vs plain causal SDPA (attention only, B=1, H={HEADS}, d={HEAD_DIM}, float32); {machine()}\n"
    )
    print(markdown_table(["method", "L", "pass", "implementation", "time", "vs SDPA", "peak memory"], rows))


if __name__ == "__main__":
    import sys

    if "--memory-case" in sys.argv:
        memory_main(build_case)
    else:
        main()
