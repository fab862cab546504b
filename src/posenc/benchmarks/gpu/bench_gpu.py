"""posenc on a CUDA device: every backend's exactness, FlexAttention against SDPA, the RoPE kernel, HF generate.

One run, one table per section, one JSON file, within a time budget (``--budget``, default 420 s:
under 8 minutes on one H100 with start-up). Five sections:

1. **Exactness.** Every registered encoding (its example options, 4 heads of 64, causal, batch 2,
   ``--length`` tokens) on every backend of the device's priority list that serves it, in float32
   and bfloat16: the output and the gradients of ``(out * w).sum()`` (``w`` fixed random) with
   respect to the input and every parameter, against the ``eager`` backend in float64 on the CPU.
   The error is ``max |got - ref| / max |ref|`` per tensor (the worst over the gradients); the
   tolerance is 2e-3 in float32 and 4e-2 in bfloat16 (its 8 mantissa bits: a rounding is 4e-3 of a
   value, and the sums over 64-wide heads and the softmax compound it). A backend that refuses the
   request is listed with its reason; a backend that serves it with an error above the tolerance
   is ``FAIL`` and the command exits with status 1.
2. **FlexAttention against SDPA** for T5 and ALiBi layers (16 heads of 64, bfloat16 on CUDA) at
   ``--lengths`` (default 4096, 8192, 16384), forward and forward+backward: posenc forced to
   ``flex``, to ``sdpa`` (the bias added as a dense ``[1, H, L, L]`` mask) and plain causal SDPA
   without a bias (the floor no bias can beat), interleaved, medians; peak memory per case on CUDA.
3. **The RoPE kernel** (:func:`posenc.kernels.rope.apply_rotary`, in place, both pairings, and the
   layer's path ``rotate_fresh``) on q and k of ``--rope-shape`` in float32 and bfloat16: effective
   bandwidth (q and k read and written once) as a share of copying q and k on the same device.
4. **HF generate**: a random Llama (4 layers, hidden 256, 8 heads) on the device, greedy
   ``--new`` tokens after a 128-token prompt, ``attn_implementation="sdpa"`` against ``"posenc"``:
   tokens per second, and whether the tokens are the same.
5. **Compiled HF generate**: the same Llama and prompt, each implementation's copy with its forward
   compiled (``torch.compile``) and a static cache (``cache_implementation="static"``), the fastest
   HF generation: prefill and per-token times apart (:func:`posenc.benchmarks.decoding.bench_compile.measure`),
   tokens/s against sdpa, the same tokens checked.

    python -m posenc.benchmarks.gpu.bench_gpu [--device cuda] [--json gpu.json] [--budget 420] [--quick]
        [--encodings rope,t5] [--backends flex,sdpa] [--sections exactness,flex,rope,generate,compiled]

On a CPU (``--device cpu``) every section runs the same code but the CUDA calls (synchronising the
device and reading its peak memory); ``tests/benchmarks/test_bench_gpu.py`` runs it so on small sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import posenc
from posenc.backends import NoBackendError, available_backends
from posenc.benchmarks._harness import machine, markdown_table
from posenc.benchmarks.decoding.bench_decode import generation_llama
from posenc.benchmarks.gpu._gpu_exactness import HEAD_DIM, exactness, exactness_table
from posenc.benchmarks.gpu._gpu_timing import Budget, interleaved_times, peak_mb, timed
from posenc.examples import build_example

SECTIONS = ("exactness", "flex", "rope", "generate", "compiled")


# ---------------------------------------------------------------------------- 2. flex against sdpa


@dataclass
class SpeedRow:
    case: str
    length: int
    mode: str
    median_ms: float | None
    times_ms: list[float] = field(default_factory=list)
    peak_mb: float | None = None
    note: str = ""


def _bias_layer(name: str, heads: int, device: torch.device, dtype: torch.dtype) -> posenc.MultiheadAttention:
    torch.manual_seed(0)
    encoding = build_example(name, num_heads=heads, head_dim=HEAD_DIM)
    return posenc.MultiheadAttention(heads * HEAD_DIM, heads, encoding=encoding, causal=True).to(
        device, dtype
    )


def flex_against_sdpa(
    device: torch.device, dtype: torch.dtype, lengths: list[int], heads: int, repeats: int, budget: Budget
) -> list[SpeedRow]:
    """Section 2: T5 and ALiBi forced to flex and to sdpa, and plain causal SDPA, per length and mode."""
    rows: list[SpeedRow] = []
    for name in ("t5", "alibi"):
        layer = _bias_layer(name, heads, device, dtype)
        for length in lengths:
            x = torch.randn(1, length, heads * HEAD_DIM, device=device, dtype=dtype)
            for train in (False, True):
                mode = "forward+backward" if train else "forward"
                cases = _speed_cases(layer, x, train)
                if budget.spent():
                    rows += [
                        SpeedRow(f"{name} {c}", length, mode, None, note="time budget spent") for c in cases
                    ]
                    continue
                rows += _measure(name, cases, length, mode, device, repeats, budget)
    return rows


def _speed_cases(layer: posenc.MultiheadAttention, x: Tensor, train: bool) -> dict[str, Callable[[], object]]:
    heads, head_dim = layer.num_heads, layer.head_dim
    q = torch.randn(1, heads, x.shape[1], head_dim, device=x.device, dtype=x.dtype, requires_grad=train)

    def floor() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        if train:
            out.sum().backward()

    def forced(backend: str) -> Callable[[], None]:
        inputs = x.detach().clone().requires_grad_(train)

        def run() -> None:
            with posenc.use_backend(backend), torch.set_grad_enabled(train):
                out = layer(inputs)
            if train:
                out.sum().backward()

        return run

    return {"flex": forced("flex"), "sdpa (dense bias)": forced("sdpa"), "plain causal SDPA, no bias": floor}


def _measure(
    name: str,
    cases: dict[str, Callable[[], object]],
    length: int,
    mode: str,
    device: torch.device,
    repeats: int,
    budget: Budget,
) -> list[SpeedRow]:
    live, rows = {}, []
    for case, fn in cases.items():
        try:
            timed(fn, device)  # compiles flex, builds tables; a refusal shows here
            live[case] = fn
        except (NoBackendError, RuntimeError, ValueError, NotImplementedError) as err:
            note = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            rows.append(SpeedRow(f"{name} {case}", length, mode, None, note=note))
    times = interleaved_times(live, device, repeats, budget)
    for case, fn in live.items():
        ms = [t * 1e3 for t in times[case]]
        median = sorted(ms)[len(ms) // 2] if ms else None
        rows.append(SpeedRow(f"{name} {case}", length, mode, median, ms, peak_mb(fn, device)))
    return rows


def speed_table(rows: list[SpeedRow], title: str) -> str:
    floors = {
        (r.case.split()[0], r.length, r.mode): r.median_ms
        for r in rows
        if r.case.endswith("no bias") and r.median_ms
    }
    body = []
    for r in rows:
        floor = floors.get((r.case.split()[0], r.length, r.mode))
        body.append(
            [
                r.case,
                str(r.length),
                r.mode,
                "—" if r.median_ms is None else f"{r.median_ms:.2f} ms",
                "—" if r.median_ms is None or not floor else f"{r.median_ms / floor:.2f}×",
                "—" if r.peak_mb is None else f"{r.peak_mb:.0f} MiB",
                r.note[:120],
            ]
        )
    header = ["case", "length", "mode", "median", "vs the no-bias floor", "peak memory", "note"]
    return f"### {title}\n\n" + markdown_table(header, body)


# ---------------------------------------------------------------------------- 3. the RoPE kernel


def rope_bandwidth(
    device: torch.device,
    shape: tuple[int, int, int, int],
    dtypes: list[torch.dtype],
    repeats: int,
    budget: Budget,
) -> list[dict[str, Any]]:
    """Section 3: the RoPE kernel's effective bandwidth as a share of copying q and k."""
    from posenc.kernels.rope import RotaryTables

    rows = []
    length, dim = shape[2], shape[3]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    positions = torch.arange(length, device=device)[None]
    cos, sin = RotaryTables(inv_freq.to(device)).tables(positions)
    for dtype in dtypes:
        if budget.spent():
            rows.append({"dtype": str(dtype), "case": "all", "note": "time budget spent"})
            continue
        q, k = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
        cases = _rope_cases(q, k, cos, sin, positions)
        times = interleaved_times(cases, device, repeats, budget)
        moved = 2 * 2 * q.numel() * q.element_size()  # q and k, each read once and written once
        copy_median = sorted(times["copy q,k"])[len(times["copy q,k"]) // 2]
        for case, seconds in times.items():
            median = sorted(seconds)[len(seconds) // 2]
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "case": case,
                    "median_ms": median * 1e3,
                    "gb_per_s": moved / median / 1e9,
                    "share_of_copy": copy_median / median,
                }
            )
    return rows


def _rope_cases(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor
) -> dict[str, Callable[[], object]]:
    """Copying q and k (the floor), the kernel in place in both pairings, and the layer's path."""
    from posenc.kernels.rope import apply_rotary

    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k)]  # the layer's [B, H, T, D]
    layer_rope = posenc.build("rope", head_dim=q.shape[-1]).to(q.device)

    def both(pairing: str) -> Callable[[], object]:
        return lambda: [apply_rotary(t, cos, sin, pairing=pairing, inplace=True) for t in (q, k)]

    return {
        "copy q,k": lambda: (q_out.copy_(q), k_out.copy_(k)),
        "apply_rotary, half, in place": both("half"),
        "apply_rotary, interleaved, in place": both("interleaved"),
        "layer path (rotate_fresh, half)": lambda: layer_rope.rotate_fresh(*views, positions, positions),
    }


def rope_table(rows: list[dict[str, Any]], shape: tuple[int, ...]) -> str:
    body = [
        [
            r["case"],
            r["dtype"],
            f"{r['median_ms']:.3f} ms" if "median_ms" in r else "—",
            f"{r['gb_per_s']:.0f} GB/s" if "gb_per_s" in r else "—",
            f"{100 * r['share_of_copy']:.0f}%" if "share_of_copy" in r else r.get("note", ""),
        ]
        for r in rows
    ]
    header = ["case", "dtype", "median", "effective bandwidth", "% of copy"]
    return f"### RoPE on q and k {tuple(shape)}\n\n" + markdown_table(header, body)


# ---------------------------------------------------------------------------- 4. HF generate


def hf_generate(device: torch.device, new: int, repeats: int, budget: Budget) -> dict[str, Any]:
    """Section 4: greedy generate through HF, sdpa against posenc: tokens/s and the same tokens."""
    import posenc.hf

    if budget.spent():
        return {"note": "time budget spent"}
    posenc.hf.register()
    model = generation_llama().to(device)
    prompt = torch.randint(0, 128, (1, 128), device=device)
    options = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
    tokens: dict[str, Tensor] = {}

    def case(implementation: str) -> Callable[[], None]:
        def run() -> None:
            model.set_attn_implementation(implementation)
            with torch.no_grad():
                tokens[implementation] = model.generate(prompt, **options)

        return run

    times = interleaved_times({"sdpa": case("sdpa"), "posenc": case("posenc")}, device, repeats, budget)
    rates = {name: new / sorted(t)[len(t) // 2] for name, t in times.items()}
    return {
        "tokens_per_s": rates,
        "posenc_over_sdpa": rates["posenc"] / rates["sdpa"],
        "same_tokens": bool(torch.equal(tokens["sdpa"], tokens["posenc"])),
        "new_tokens": new,
    }


def generate_table(result: dict[str, Any]) -> str:
    if "tokens_per_s" not in result:
        return "### HF generate\n\n" + result.get("note", "")
    rates = result["tokens_per_s"]
    rows = [[name, f"{rate:.0f}", f"{rate / rates['sdpa']:.2f}×"] for name, rate in rates.items()]
    head = (
        f"### HF Llama generate (4 layers, hidden 256, greedy {result['new_tokens']} tokens); "
        f"same tokens: {'yes' if result['same_tokens'] else 'NO'}\n\n"
    )
    return head + markdown_table(["attn_implementation", "tokens/s", "vs sdpa"], rows)


def hf_compiled_generate(device: torch.device, new: int, repeats: int, budget: Budget) -> dict[str, Any]:
    """Section 5: the Llama of section 4 with a static cache and a compiled forward, sdpa against posenc."""
    from posenc.benchmarks.decoding.bench_compile import measure

    if budget.spent():
        return {"note": "time budget spent"}
    model = generation_llama().to(device)
    prompt = torch.randint(0, 128, (1, 128), device=device)
    results = measure(model, prompt, new, repeats, compiled=True)
    return {
        "implementations": results,
        "posenc_over_sdpa": results["sdpa"]["token"] / results["posenc"]["token"],
        "new_tokens": new,
    }


def compiled_generate_table(result: dict[str, Any]) -> str:
    head = "### HF Llama generate, static cache + torch.compile (same tokens checked)\n\n"
    if "implementations" not in result:
        return head + result.get("note", "")
    found = result["implementations"]
    base = found["sdpa"]["token"]
    rows = [
        [
            name,
            f"{r['warmup']:.1f} s",
            f"{r['prefill']:.1f} ms",
            f"{r['token']:.2f} ms",
            f"{base / r['token']:.2f}×",
        ]
        for name, r in found.items()
    ]
    return head + markdown_table(
        ["attn_implementation", "warm-up", "prefill", "per token", "tokens/s vs sdpa"], rows
    )


# ---------------------------------------------------------------------------- the run


def _names(text: str | None, known: list[str], option: str) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"{option}: unknown {unknown or 'empty list'}; choose from {', '.join(known)}")
    return names


def _raise_recompile_limit(limit: int) -> None:
    """Let dynamo compile FlexAttention for every (encoding, dtype, shape) this run asks for: past
    its limit posenc's flex backend refuses (it would run uncompiled), which is not what is measured."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(limit, getattr(torch._dynamo.config, name)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path, default=None, help="write every result to this JSON file")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; later work is reported not run")
    parser.add_argument("--quick", action="store_true", help="small sizes (what the CPU test runs)")
    parser.add_argument("--encodings", default=None, help="exactness: these encodings (default: all)")
    parser.add_argument("--backends", default=None, help="exactness: these backends (default: the device's)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--length", type=int, default=None, help="exactness: tokens (default 256; quick 24)")
    parser.add_argument("--lengths", default=None, help="flex: tokens (default 4096,8192,16384; quick 64)")
    parser.add_argument("--rope-shape", default=None, help="B,H,T,D (default 4,32,4096,128; quick 1,2,64,32)")
    parser.add_argument("--new", type=int, default=None, help="generate: new tokens (default 64; quick 8)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5; quick 2)")
    parser.add_argument("--threads", type=int, default=None)
    return parser.parse_args(argv)


@dataclass(frozen=True)
class _Sizes:
    """The sizes of a run: ``--quick``'s small ones or the full ones, each option overriding its own."""

    length: int
    lengths: list[int]
    shape: tuple[int, ...]
    repeats: int
    new: int
    flex_heads: int


def _sizes(args: argparse.Namespace) -> _Sizes:
    quick = args.quick
    return _Sizes(
        length=args.length or (24 if quick else 256),
        lengths=[int(n) for n in (args.lengths or ("64" if quick else "4096,8192,16384")).split(",")],
        shape=tuple(
            int(n) for n in (args.rope_shape or ("1,2,64,32" if quick else "4,32,4096,128")).split(",")
        ),
        repeats=args.repeats or (2 if quick else 5),
        new=args.new or (8 if quick else 64),
        flex_heads=4 if quick else 16,
    )


def _run_sections(
    sections: list[str],
    device: torch.device,
    encodings: list[str],
    backends: list[str] | None,
    sizes: _Sizes,
    budget: Budget,
    result: dict[str, Any],
) -> list[str]:
    """Run ``sections`` in their fixed order, each adding its results to ``result``; their tables."""
    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = [torch.float32, torch.bfloat16]
    tables = []
    if "exactness" in sections:
        checks = exactness(device, dtypes, sizes.length, encodings, backends, budget)
        result["exactness"] = [asdict(c) for c in checks]
        tables.append(exactness_table(checks))
    if "flex" in sections:
        rows = flex_against_sdpa(device, low, sizes.lengths, sizes.flex_heads, sizes.repeats, budget)
        result["flex"] = [asdict(r) for r in rows]
        tables.append(
            speed_table(rows, f"FlexAttention against SDPA ({str(low).removeprefix('torch.')}, causal)")
        )
    if "rope" in sections:
        rope_rows = rope_bandwidth(device, sizes.shape, dtypes, sizes.repeats, budget)  # type: ignore[arg-type]
        result["rope"] = rope_rows
        tables.append(rope_table(rope_rows, sizes.shape))
    if "generate" in sections:
        result["generate"] = hf_generate(device, sizes.new, sizes.repeats, budget)
        tables.append(generate_table(result["generate"]))
    if "compiled" in sections:
        result["compiled"] = hf_compiled_generate(device, sizes.new, sizes.repeats, budget)
        tables.append(compiled_generate_table(result["compiled"]))
    return tables


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    budget = Budget(args.budget)
    _raise_recompile_limit(64)  # one compiled flex per (encoding, dtype, shape): more than dynamo's default 8
    sections = _names(args.sections, list(SECTIONS), "--sections") or list(SECTIONS)
    encodings = _names(args.encodings, posenc.available(), "--encodings") or posenc.available()
    backends = _names(args.backends, available_backends(device), "--backends")
    sizes = _sizes(args)
    result: dict[str, Any] = {"machine": machine(), "device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)
    tables = [
        f"## posenc bench gpu: {result.get('device_name', str(device))}\n\nMachine: {result['machine']}"
    ]
    start = time.perf_counter()
    tables += _run_sections(sections, device, encodings, backends, sizes, budget, result)
    result["seconds"] = round(time.perf_counter() - start, 1)
    tables.append(f"Total {result['seconds']} s (budget {args.budget:.0f} s).")
    print("\n\n".join(tables))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    failed = [c for c in result.get("exactness", []) if c["status"] == "FAIL"]
    different = result.get("generate", {}).get("same_tokens") is False
    return 1 if failed or different else 0


if __name__ == "__main__":
    sys.exit(main())
