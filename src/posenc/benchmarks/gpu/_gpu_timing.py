"""Timing on a device for ``bench_gpu``: a time budget, synchronised timing, interleaved repeats,
peak device memory, and the relative error the exactness checks use."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "Budget",
    "gradients_error",
    "interleaved_times",
    "peak_mb",
    "relative_error",
    "synchronize",
    "timed",
]


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
