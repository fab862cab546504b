"""Where the near/far split spends its time inside PyTorch's CPU flash kernel, and what the far part's
extra head dimension costs on this CPU (``bench split --part kernel``).

The split's far part runs the CPU flash kernel on ``[1, H, L - block - 1, D]`` slices; ALiBi's
separable key term rides in one extra head dimension, so its far calls have ``D = 65`` where plain
SDPA has 64. How much that costs is a property of the CPU and its BLAS (the kernel's small GEMMs
with a 65-wide edge), not of posenc's code, so this part prints two tables a session on any
machine can read:

* **calls**: one forward+backward of the split for ALiBi and T5 (causal), and of plain causal SDPA
  beside them, under :mod:`torch.profiler`: the flash kernel's calls grouped by operator and query
  shape (how many, their time, their share of the whole call), then the time outside the kernel;
* **layouts**: the flash kernel alone at the far part's shape, forward and backward timed apart and
  interleaved, for the layouts the far part could take: ``D = 64`` (what SDPA runs), ``D = 65`` with
  dense rows (each row starting anywhere in a cache line), ``D = 65`` with rows starting on 64-byte
  boundaries (what the split runs: :data:`~posenc.backends.parts.exact.ROW_ALIGN_BYTES`) and
  ``D = 80`` (zero columns up to the next multiple of 16).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile

from posenc.backends.near_far import NEAR_BLOCK
from posenc.benchmarks._harness import interleaved

__all__ = ["FLASH_OPS", "LAYOUTS", "call_rows", "flash_calls", "layout_rows"]

#: The CPU flash kernel's operators as the profiler names them: forward, backward.
FLASH_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "forward",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "backward",
}


class Layout(NamedTuple):
    """How the far part's operands reach the kernel: the head dim it computes with, the floats between
    consecutive rows, and whether the key term comes as a broadcast float mask ``[1, H, 1, n]``."""

    dim: int
    row_floats: int
    key_mask: bool = False


#: layout name -> how the kernel sees the far part
LAYOUTS = {
    "D=64 (plain SDPA)": Layout(64, 64),
    "D=64, key term as a [1, H, 1, n] mask (near_far)": Layout(64, 64, key_mask=True),
    "D=65, dense rows": Layout(65, 65),
    "D=65, rows on 64 bytes": Layout(65, 80),
    "D=80, zero columns": Layout(80, 80),
}


def flash_calls(call: Callable[[], object]) -> tuple[list[tuple[str, tuple[int, ...], int, float]], float]:
    """The flash kernel's calls in one run of ``call`` under the profiler, grouped:
    ``[(pass, q shape, calls, milliseconds)]`` in order of first appearance, and the whole run's
    milliseconds (profiled, so a little above an unprofiled run)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        call()
    groups: dict[tuple[str, tuple[int, ...]], list[float]] = {}
    whole = 0.0
    for event in prof.events():
        if event.cpu_parent is None:
            whole += event.cpu_time_total / 1e3
        if event.name not in FLASH_OPS:
            continue
        shapes = event.input_shapes
        # The backward's first input is the output gradient, shaped like q: either names the rows.
        q_shape = tuple(shapes[1] if FLASH_OPS[event.name] == "backward" else shapes[0])
        groups.setdefault((FLASH_OPS[event.name], q_shape), []).append(event.cpu_time_total / 1e3)
    rows = [(kind, shape, len(times), sum(times)) for (kind, shape), times in groups.items()]
    return rows, whole


def _share(ms: float, whole: float) -> str:
    return f"{ms / whole:.0%}" if whole else "—"


def _part(rows: int, length: int) -> str:
    if rows == length:
        return "every row (SDPA)"
    return "far part" if rows == length - NEAR_BLOCK - 1 else "near band / edge"


def call_rows(cases: dict[str, Callable[[], object]], length: int) -> list[list[str]]:
    """Rows of the calls table for each ``label -> forward+backward callable`` at ``length``, each case
    closed by the time spent outside the flash kernel (the merges, copies and the explicit backward)."""
    rows = []
    for label, call in cases.items():
        call()  # warm-up: allocations and the first-call set-up stay out of the profile
        groups, whole = flash_calls(call)
        for kind, shape, count, ms in groups:
            rows.append(
                [label, str(length), kind, _part(shape[-2], length), "×".join(map(str, shape)), str(count),
                 f"{ms:.0f}", _share(ms, whole)]
            )  # fmt: skip
        outside = max(0.0, whole - sum(ms for *_, ms in groups))
        rows.append(
            [
                label,
                str(length),
                "both",
                "outside the flash kernel",
                "—",
                "—",
                f"{outside:.0f}",
                _share(outside, whole),
            ]
        )
    return rows


def _operands(rows: int, heads: int, dim: int, row_floats: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        storage = torch.zeros(1, heads, rows, row_floats)
        storage[..., : min(dim, 65)] = torch.randn(1, heads, rows, min(dim, 65), generator=generator)
        out.append(storage[..., :dim])
    return out


def _layout_calls(rows: int, heads: int, layout: Layout) -> tuple[Callable, Callable]:
    q, k, v = _operands(rows, heads, layout.dim, layout.row_floats)
    # An ALiBi-like key term, one row per head broadcast over the queries.
    term = -torch.arange(rows, dtype=torch.float32).flip(0) / 64
    mask = term.expand(1, heads, 1, rows).contiguous() if layout.key_mask else None
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, k, v, 0.0, True, attn_mask=mask, scale=0.125)
    grad = torch.randn_like(out)

    def forward() -> None:
        flash(q, k, v, 0.0, True, attn_mask=mask, scale=0.125)

    def backward() -> None:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, True, attn_mask=mask, scale=0.125
        )

    return forward, backward


def layout_rows(length: int, heads: int, repeats: int) -> list[list[str]]:
    """Rows of the layouts table: the flash kernel at the far part's rows (``length - block - 1``)."""
    rows_n = length - NEAR_BLOCK - 1
    cases = {}
    for name, layout in LAYOUTS.items():
        forward, backward = _layout_calls(rows_n, heads, layout)
        cases[f"{name}|forward"], cases[f"{name}|backward"] = forward, backward
    timings = interleaved(cases, repeats)
    table = []
    for name in LAYOUTS:
        for kind in ("forward", "backward"):
            timing, floor = timings[f"{name}|{kind}"], timings[f"{next(iter(LAYOUTS))}|{kind}"]
            table.append(
                [f"1×{heads}×{rows_n}", kind, name, timing.cell(), f"{timing.median / floor.median:.2f}×"]
            )
    return table
