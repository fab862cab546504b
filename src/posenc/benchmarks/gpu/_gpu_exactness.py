"""Section 1 of ``bench_gpu``: every registered encoding on every backend of the device and dtype,
output and gradients against float64 eager on the CPU (see :mod:`posenc.benchmarks.gpu.bench_gpu`)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

import posenc
from posenc.backends import NoBackendError, available_backends
from posenc.benchmarks._harness import markdown_table
from posenc.benchmarks.gpu._gpu_timing import Budget, gradients_error, relative_error
from posenc.examples import build_example

__all__ = ["HEADS", "HEAD_DIM", "TOLERANCE", "Check", "exactness", "exactness_table"]

#: Relative error allowed per dtype in the exactness section (see :mod:`posenc.benchmarks.gpu.bench_gpu`).
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 4e-2}
HEADS, HEAD_DIM = 4, 64


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
