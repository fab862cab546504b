"""RoPE application on q and k of shape (4, 32, 2048, 128) float32: posenc vs HF and rotary-embedding-torch.

Rows: the machine's copy bandwidth (``copy_`` of q and k into preallocated tensors: the floor),
HF ``apply_rotary_pos_emb`` (Llama, full-width cos/sin as HF's rotary embedding returns them),
``rotary_embedding_torch.RotaryEmbedding.rotate_queries_or_keys`` (interleaved pairs, cached
frequencies), posenc's ``rope`` encoding ``rotate`` as it is, the attention layer's path (the
encoding's ``rotate_fresh`` in place on ``[B, H, T, D]`` views of the projections, half pairs
through the compiled loop of :mod:`posenc.kernels.rope_native` and through the eager passes it
replaces, and interleaved pairs as :func:`posenc.switch_rope_pairing_` makes them), and the fused kernel
``posenc.kernels.rope.apply_rotary`` (out of place, in place, interleaved, and under
``torch.compile``). Effective bandwidth counts reading and writing q and k once.

    python -m posenc.benchmarks.bench_rope [--shape 4,32,2048,128] [--repeats 5] [--no-compile]
"""

from __future__ import annotations

import argparse

import torch

import posenc
from posenc.benchmarks._harness import interleaved, machine, markdown_table
from posenc.kernels import rope_native
from posenc.kernels.rope import RotaryTables, apply_rotary, rotary_reference


def half_eager(encoding, projections, positions):
    """The layer's half-pair rotation through the eager passes the compiled loop replaces."""
    with rope_native.eager_only():
        return encoding.rotate_fresh(*projections, positions, positions)


def build_cases(shape: tuple[int, int, int, int], compile_too: bool) -> dict:
    from rotary_embedding_torch import RotaryEmbedding
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    _batch, _heads, length, dim = shape
    torch.manual_seed(0)
    q, k = torch.randn(shape), torch.randn(shape)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    tables = RotaryTables(inv_freq)
    positions = torch.arange(length)[None]
    cos, sin = tables.tables(positions)  # [1, T, dim/2] float32, cached
    hf_cos, hf_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # HF's [1, T, dim]
    ret = RotaryEmbedding(dim=dim)
    ret.rotate_queries_or_keys(q[:, :, :8].clone())  # build its frequency cache
    enc = posenc.build("rope", head_dim=dim)
    enc.cos_sin(positions)  # build its tables

    def copy():
        q_out.copy_(q)
        k_out.copy_(k)

    # The attention layer's path: q and k are [B, H, T, D] views of the fresh projections [B, T, H·D],
    # rotated in place (a rotation keeps norms, so rotating the same tensors again is a fair repeat).
    projections = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k)]
    assert projections[0].stride(1) == dim  # heads interleaved in memory, as the layer's views are
    layer_encodings = {
        pairing: posenc.build(f"rope:pairing={pairing}", head_dim=dim) for pairing in ("half", "interleaved")
    }
    for layer_enc in layer_encodings.values():
        layer_enc.cos_sin(positions)

    cases = {
        "copy q,k (bandwidth floor)": copy,
        "HF apply_rotary_pos_emb": lambda: apply_rotary_pos_emb(q, k, hf_cos, hf_sin),
        "rotary-embedding-torch (interleaved)": lambda: (
            ret.rotate_queries_or_keys(q),
            ret.rotate_queries_or_keys(k),
        ),
        "posenc rope encoding .rotate": lambda: enc.rotate(q, k, positions, positions),
        "layer path: half pairs in place on the projection views": lambda: layer_encodings[
            "half"
        ].rotate_fresh(*projections, positions, positions),
        "layer path: half pairs, eager passes (the fallback)": lambda: half_eager(
            layer_encodings["half"], projections, positions
        ),
        "layer path: interleaved pairs (posenc.switch_rope_pairing_)": lambda: layer_encodings[
            "interleaved"
        ].rotate_fresh(*projections, positions, positions),
        "posenc apply_rotary (out of place)": lambda: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)),
        "posenc apply_rotary (out=, preallocated)": lambda: (
            apply_rotary(q, cos, sin, out=q_out),
            apply_rotary(k, cos, sin, out=k_out),
        ),
        "posenc apply_rotary (in place)": lambda: (
            apply_rotary(q, cos, sin, inplace=True),
            apply_rotary(k, cos, sin, inplace=True),
        ),
        "posenc apply_rotary (interleaved, in place)": lambda: (
            apply_rotary(q, cos, sin, pairing="interleaved", inplace=True),
            apply_rotary(k, cos, sin, pairing="interleaved", inplace=True),
        ),
    }
    if compile_too:
        compiled = torch.compile(rotary_reference, dynamic=False)
        compiled(q, cos, sin)  # compile outside the timing
        cases["posenc rotary_reference under torch.compile"] = lambda: (
            compiled(q, cos, sin),
            compiled(k, cos, sin),
        )
    return cases


def run(shape: tuple[int, int, int, int], repeats: int, compile_too: bool) -> str:
    cases = build_cases(shape, compile_too)
    timings = interleaved(cases, repeats, warmup=1)
    numel = 1
    for size in shape:
        numel *= size
    moved = 2 * 2 * numel * 4  # q and k, read once and written once, float32
    floor = timings["copy q,k (bandwidth floor)"]
    hf = timings["HF apply_rotary_pos_emb"]
    ret = timings["rotary-embedding-torch (interleaved)"]
    rows = []
    for name, timing in timings.items():
        gbps = moved / timing.median / 1e9
        rows.append(
            [
                name,
                timing.cell(),
                f"{gbps:.1f} GB/s",
                f"{100 * floor.median / timing.median:.0f}%",
                f"{hf.median / timing.median:.2f}×",
                f"{ret.median / timing.median:.2f}×",
            ]
        )
    header = [
        "implementation",
        "median (min–max)",
        "effective bandwidth",
        "% of copy",
        "speed-up vs HF",
        "speed-up vs rotary-embedding-torch",
    ]
    title = (
        f"### RoPE on q and k {tuple(shape)} float32\n\nMachine: {machine()}\n\n"
        f"Half pairs: {rope_native.status()}\n\n"
    )
    return title + markdown_table(header, rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,32,2048,128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    if len(shape) != 4:
        raise SystemExit("--shape must be B,H,T,D")
    table = run(shape, args.repeats, not args.no_compile)
    print(table)
    return table


if __name__ == "__main__":
    main()
