"""posenc on a CUDA device: every backend's exactness, FlexAttention against SDPA, the RoPE kernel, HF generate.

One run, one table per section, one JSON file, within a time budget (``--budget``, default 420 s:
under 8 minutes on one H100 with start-up). Four sections:

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

    python -m posenc.benchmarks.bench_gpu [--device cuda] [--json gpu.json] [--budget 420] [--quick]
        [--encodings rope,t5] [--backends flex,sdpa] [--sections exactness,flex,rope,generate]

On a CPU (``--device cpu``) every section runs the same code but the CUDA calls (synchronising the
device and reading its peak memory); ``tests/test_bench_gpu.py`` runs it so on small sizes.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
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
from posenc.examples import build_example

SECTIONS = ("exactness", "flex", "rope", "generate")
#: Relative error allowed per dtype in the exactness section (see the module docstring).
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 4e-2}
HEADS, HEAD_DIM = 4, 64


class Budget:
    """Seconds left of the run's time budget; work not started once it is spent is reported as such."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def spent(self) -> bool:
        return time.perf_counter() >= self.end


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``, the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def interleaved_times(
    cases: dict[str, Callable[[], object]], device: torch.device, repeats: int, budget: Budget
) -> dict[str, list[float]]:
    """Each case's times, repeats interleaved (A B A B ...) after one warm-up call each."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        timed(fn, device)
    for _ in range(repeats):
        if budget.spent() and all(times.values()):
            break
        for name, fn in cases.items():
            times[name].append(timed(fn, device))
    return times


def peak_mb(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak device memory (MiB) allocated during one call of ``fn`` above what was held before;
    None off CUDA (the CPU benchmarks measure it in a fresh process instead)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    held = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - held) / 2**20


def relative_error(got: Tensor, ref: Tensor, floor: float = 0.0) -> float:
    """``max |got - ref| / max(max |ref|, floor)`` in float64 on the CPU (nan when either holds a
    non-finite). ``floor``: the scale below which ``ref`` counts as zero (a gradient that is zero
    in exact arithmetic, such as the key projection's bias under softmax, is rounding noise)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if not (torch.isfinite(got).all() and torch.isfinite(ref).all()):
        return math.nan
    scale = max(float(ref.abs().max()), floor) or 1.0
    return float((got - ref).abs().max()) / scale


def gradients_error(got: list[Tensor], ref: list[Tensor]) -> float:
    """The worst :func:`relative_error` over gradient tensors, each floored at 1% of the largest
    reference gradient of all (the input's and every parameter's)."""
    largest = max(float(r.detach().abs().max()) for r in ref if r.numel())
    return max(relative_error(g, r, 1e-2 * largest) for g, r in zip(got, ref, strict=True))


# ---------------------------------------------------------------------------- 1. exactness


@dataclass
class Check:
    """One (encoding, backend, dtype) of the exactness section."""

    encoding: str
    backend: str
    dtype: str
    status: str  # "ok", "imprecise" (eager in a low dtype), "FAIL", "refused", "error", "not run"
    output_error: float | None = None
    gradient_error: float | None = None
    tolerance: float | None = None
    note: str = ""


def _layer(name: str) -> posenc.MultiheadAttention:
    """The encoding's example on a causal layer of HEADS x HEAD_DIM, float64, zero tables randomised."""
    torch.manual_seed(0)
    encoding = build_example(name, num_heads=HEADS, head_dim=HEAD_DIM)
    layer = posenc.MultiheadAttention(HEADS * HEAD_DIM, HEADS, encoding=encoding, causal=True)
    with torch.no_grad():
        for param in layer.encoding.parameters():
            if param.numel() and bool((param == 0).all()):  # CoPE, DeBERTa: zero-initialised tables
                param.normal_(0.0, 0.5)
    return layer.double().eval()


def _run(layer: posenc.MultiheadAttention, x: Tensor, w: Tensor, backend: str) -> tuple[Tensor, list[Tensor]]:
    """The output and the gradients (input, then every parameter) of ``(out * w).sum()`` on ``backend``."""
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    with posenc.use_backend(backend):
        out = layer(x)
    if layer.last_backend != backend:
        raise RuntimeError(f"asked for {backend}, ran {layer.last_backend}")
    (out * w.to(out.dtype)).sum().backward()
    grads = [x.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in layer.parameters()]
    return out.detach(), [g.detach() for g in grads]


def exactness(
    device: torch.device,
    dtypes: list[torch.dtype],
    length: int,
    encodings: list[str],
    backends: list[str] | None,
    budget: Budget,
) -> list[Check]:
    """Section 1: every encoding on every serving backend and dtype against float64 eager on the CPU."""
    order = [b for b in available_backends(device) if backends is None or b in backends]
    checks: list[Check] = []
    for name in encodings:
        reference = _layer(name)
        torch.manual_seed(1)
        x = torch.randn(2, length, HEADS * HEAD_DIM, dtype=torch.float64)
        w = torch.randn(2, length, HEADS * HEAD_DIM, dtype=torch.float64)
        expected = _run(reference, x, w, "eager")
        for dtype in dtypes:
            label = str(dtype).removeprefix("torch.")
            if budget.spent():
                checks += [Check(name, b, label, "not run", note="time budget spent") for b in order]
                continue
            eager = _served(reference, x, w, expected, name, "eager", dtype, device)
            for backend in order:
                found = (
                    eager
                    if backend == "eager"
                    else _served(reference, x, w, expected, name, backend, dtype, device)
                )
                checks.append(_judged(found, eager, dtype))
    return checks


def _served(
    reference: posenc.MultiheadAttention,
    x: Tensor,
    w: Tensor,
    expected: tuple[Tensor, list[Tensor]],
    name: str,
    backend: str,
    dtype: torch.dtype,
    device: torch.device,
) -> Check:
    """``backend``'s errors in ``dtype`` on ``device`` against ``expected`` (status not yet judged)."""
    label = str(dtype).removeprefix("torch.")
    layer = copy.deepcopy(reference).to(device=device, dtype=dtype)
    try:
        out, grads = _run(layer, x.to(device, dtype), w.to(device), backend)
    except NoBackendError as err:
        reasons = str(err).splitlines()[0].split(": ", 1)[-1]
        return Check(name, backend, label, "refused", note=reasons[:300])
    except (RuntimeError, ValueError, NotImplementedError) as err:  # a crash on this device: a finding
        return Check(name, backend, label, "error", note=f"{type(err).__name__}: {str(err)[:300]}")
    return Check(
        name, backend, label, "", relative_error(out, expected[0]), gradients_error(grads, expected[1])
    )


def _judged(found: Check, eager: Check, dtype: torch.dtype) -> Check:
    """``found`` with its status. Eager in ``dtype`` is the reference of that dtype: within
    ``TOLERANCE`` it is ``ok``, beyond it ``imprecise`` (the dtype's rounding, not a backend's
    fault). Another backend is ``ok`` within the tolerance or within 2x eager's output error and
    3x its gradient error in the same dtype (FlashAttention's test rule), else ``FAIL``."""
    if found.status:  # refused, error
        return found
    floor = TOLERANCE[dtype]
    assert found.output_error is not None and found.gradient_error is not None
    if found.backend == "eager" or eager.output_error is None or eager.gradient_error is None:
        out_tol = grad_tol = floor
        failed = "imprecise" if found.backend == "eager" else "FAIL"
    else:
        out_tol, grad_tol = max(floor, 2 * eager.output_error), max(floor, 3 * eager.gradient_error)
        failed = "FAIL"
    ok = found.output_error <= out_tol and found.gradient_error <= grad_tol  # nan is not <= anything
    return dataclasses.replace(found, status="ok" if ok else failed, tolerance=max(out_tol, grad_tol))


def exactness_table(checks: list[Check]) -> str:
    rows = [
        [
            c.encoding,
            c.backend,
            c.dtype,
            c.status,
            "" if c.output_error is None else f"{c.output_error:.1e}",
            "" if c.gradient_error is None else f"{c.gradient_error:.1e}",
            c.note.replace("|", "/")[:120],
        ]
        for c in checks
        if c.status != "refused"
    ]
    served = sum(c.status in ("ok", "imprecise", "FAIL") for c in checks)
    statuses = ("ok", "imprecise", "FAIL", "error", "refused", "not run")
    counts = {s: sum(c.status == s for c in checks) for s in statuses}
    head = (
        f"### Exactness against float64 eager on the CPU ({served} served: "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + ")\n\n"
    )
    header = ["encoding", "backend", "dtype", "status", "output error", "gradient error", "note"]
    return head + markdown_table(header, rows)


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
    import transformers

    import posenc.hf

    if budget.spent():
        return {"note": "time budget spent"}
    posenc.hf.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval().to(device)
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
    quick = args.quick
    length = args.length or (24 if quick else 256)
    lengths = [int(n) for n in (args.lengths or ("64" if quick else "4096,8192,16384")).split(",")]
    shape = tuple(int(n) for n in (args.rope_shape or ("1,2,64,32" if quick else "4,32,4096,128")).split(","))
    repeats = args.repeats or (2 if quick else 5)
    new = args.new or (8 if quick else 64)
    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = [torch.float32, torch.bfloat16]
    result: dict[str, Any] = {"machine": machine(), "device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)
    tables = [
        f"## posenc bench gpu: {result.get('device_name', str(device))}\n\nMachine: {result['machine']}"
    ]
    start = time.perf_counter()
    if "exactness" in sections:
        checks = exactness(device, dtypes, length, encodings, backends, budget)
        result["exactness"] = [asdict(c) for c in checks]
        tables.append(exactness_table(checks))
    if "flex" in sections:
        rows = flex_against_sdpa(device, low, lengths, 4 if quick else 16, repeats, budget)
        result["flex"] = [asdict(r) for r in rows]
        tables.append(
            speed_table(rows, f"FlexAttention against SDPA ({str(low).removeprefix('torch.')}, causal)")
        )
    if "rope" in sections:
        rope_rows = rope_bandwidth(device, shape, dtypes, repeats, budget)  # type: ignore[arg-type]
        result["rope"] = rope_rows
        tables.append(rope_table(rope_rows, shape))
    if "generate" in sections:
        result["generate"] = hf_generate(device, new, repeats, budget)
        tables.append(generate_table(result["generate"]))
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
