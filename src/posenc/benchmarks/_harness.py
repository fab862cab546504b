"""Shared benchmark machinery: interleaved timing, peak memory in a fresh process, tables.

Every benchmark compares a baseline and posenc *in the same process*, with their repeats
interleaved (A B A B ...) so that load from other processes hits both alike; it reports the median
and the min–max of each, and the ratio of medians. Peak memory is measured for one call in a fresh
subprocess (``ru_maxrss`` after the call minus after set-up), so the allocator state of earlier
cases does not leak into it.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch


def machine() -> str:
    """``nproc``, CPU model and ISA, torch version and threads: the line every table is labelled with."""
    from ..experiments.study.precision import cpu_description

    cpu = cpu_description()
    isa = ", ".join(cpu["isa"]) or "no AVX2, AVX-512 or AMX"
    return (
        f"{os.cpu_count()} CPUs ({cpu['cpu']}; {isa}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}"
    )


@dataclass
class Timing:
    name: str
    seconds: list[float] = field(default_factory=list)
    skipped: str | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def cell(self) -> str:
        if self.skipped:
            return f"— ({self.skipped})"
        lo, hi = min(self.seconds), max(self.seconds)
        return f"{_fmt(self.median)} ({_fmt(lo)}–{_fmt(hi)})"


def layer_call(layer: torch.nn.Module, length: int, embed_dim: int, train: bool) -> Callable[[], object]:
    """One timed call of an attention ``layer`` on a ``[1, length, embed_dim]`` input.

    ``train``: forward and backward of ``out.sum()``; otherwise the forward under ``no_grad``. The
    callable carries the layer as ``.layer`` (:func:`ran_on` reads the backend it ran on).
    """
    x = torch.randn(1, length, embed_dim, requires_grad=train)

    def forward() -> None:
        with torch.no_grad():
            layer(x)

    def forward_backward() -> None:
        layer(x).sum().backward()

    call = forward_backward if train else forward
    call.layer = layer  # type: ignore[attr-defined]
    return call


def ran_on(label: str, call: Callable[[], object] | str) -> str:
    """``label`` with the backend the timed layer last ran on, as the layer reports it
    (``"posenc auto (near_far)"``): a row says what ``auto`` chose, not what it was expected to."""
    backend = getattr(getattr(call, "layer", None), "last_backend", None)
    return f"{label} ({backend})" if backend else label


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def interleaved(
    cases: dict[str, Callable[[], object] | str], repeats: int, warmup: int = 1
) -> dict[str, Timing]:
    """Time each callable ``repeats`` times, interleaved; a string value marks the case skipped."""
    timings = {name: Timing(name) for name in cases}
    for name, fn in cases.items():
        if isinstance(fn, str):
            timings[name].skipped = fn
    live = {name: fn for name, fn in cases.items() if not isinstance(fn, str)}
    for _ in range(warmup):
        for fn in live.values():
            fn()
    for _ in range(repeats):
        for name, fn in live.items():
            start = time.perf_counter()
            fn()
            timings[name].seconds.append(time.perf_counter() - start)
    return timings


def ratio(ours: Timing, base: Timing) -> str:
    if ours.skipped or base.skipped:
        return "—"
    return f"{ours.median / base.median:.2f}×"


def peak_memory_mb(module: str, case: str, **params) -> float | None:
    """Peak extra resident memory (MiB) of one call of ``case`` in a fresh process, or None on failure.

    ``module`` is a module of this package (``"bench_bias"``), run as ``python -m``; it must
    implement ``--memory-case CASE --params JSON`` (see :func:`memory_main`).
    """
    cmd = [
        sys.executable,
        "-m",
        f"{__package__}.{module}",
        "--memory-case",
        case,
        "--params",
        json.dumps(params),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return None
    for line in done.stdout.splitlines():
        if line.startswith("PEAK_MB "):
            return float(line.split()[1])
    return None


def memory_main(build: Callable[[str, dict], Callable[[], object]]) -> None:
    """Child side of :func:`peak_memory_mb`: build the case, then measure one call."""
    case = sys.argv[sys.argv.index("--memory-case") + 1]
    params = json.loads(sys.argv[sys.argv.index("--params") + 1])
    torch.set_num_threads(int(params.pop("threads", torch.get_num_threads())))
    fn = build(case, params)
    before = _reset_peak_rss()
    fn()
    after = _status_kib("VmHWM") if before is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if before is None:  # no /proc: ru_maxrss is a lifetime high-water mark, a lower bound here
        before = 0
    print(f"PEAK_MB {(after - before) / 1024:.1f}")


def _status_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise KeyError(field_name)


def _reset_peak_rss() -> int | None:
    """Reset the kernel's peak-RSS mark (``clear_refs`` 5) and return the current RSS in KiB."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_kib("VmRSS")
    except (OSError, KeyError):
        return None


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def memory_cell(mb: float | None) -> str:
    return "—" if mb is None else f"{mb:.0f} MiB"
