"""Facts about PyTorch's fused CPU flash-attention kernel, shared by the backends that call it
directly (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward)."""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from ...seams import cpu_flash_drift
from .denormals import flushed_denormals

__all__ = [
    "FLASH_DTYPES",
    "NONFINITE_REASON",
    "accumulation_dtype",
    "cpu_flash_available",
    "cpu_flash_limit",
    "flash_backward",
    "flash_forward",
    "kernel_layout",
]

#: The dtypes the CPU flash kernel takes.
FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: Why the CPU flash kernel must not see nan or inf (eager propagates them).
NONFINITE_REASON = "nan or inf in the inputs: PyTorch's CPU flash kernel would return finite numbers for them"


def cpu_flash_available() -> bool:
    """Whether this torch has the CPU flash kernel and its backward as ops, with the schemas posenc
    calls them with (:mod:`posenc.seams`). When a torch release changed them, the paths that call
    them are not taken (their backends state why, or run their exact non-flash path) and a warning
    names the change once."""
    ops = torch.ops.aten
    present = hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        ops, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )
    return present and _schema_drift() is None


def cpu_flash_limit(q: Tensor) -> str | None:
    """Why PyTorch's CPU flash kernel cannot take queries like ``q`` (its dtype and device), or None
    when it can: the one wording of this limit for every backend that calls the kernel itself
    (blocked, near_far, segments, clipped, sdpa with sinks)."""
    if q.device.type != "cpu":
        return f"PyTorch's CPU flash kernel takes CPU tensors only; q is on {q.device}"
    if q.dtype not in FLASH_DTYPES:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in FLASH_DTYPES)
        return f"PyTorch's CPU flash kernel takes {names}, not {q.dtype}"
    if not cpu_flash_available():
        return "PyTorch's CPU flash kernel is missing from this torch or has another schema (posenc.seams)"
    return None


@functools.lru_cache(maxsize=1)
def _schema_drift() -> str | None:
    line = cpu_flash_drift()
    if line is not None:
        warnings.warn(f"posenc does not call the CPU flash kernel: {line}", RuntimeWarning, stacklevel=3)
    return line


def kernel_layout(t: Tensor) -> Tensor:
    """``t`` with unit stride in its last dimension, copied only when it has another.

    The CPU flash kernel and its backward read every row of ``q``, ``k``, ``v``, ``out`` and
    ``grad_out`` as ``D`` adjacent elements: a ``[..., ::2]`` view, a transposed ``[.., D, T]``
    view or a stride-0 expand of the last dimension is read as if it were dense (wrong numbers,
    1.2-3.4 off at L=1031; ``F.scaled_dot_product_attention`` copies such inputs itself). Strides
    of the other dimensions, zero included (expands over batch, heads or positions), are read as
    they are. A float mask may have stride 0 in its last dimension (the kernel broadcasts it)."""
    if t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def _mask_layout(mask: Tensor | None) -> Tensor | None:
    if mask is None or mask.shape[-1] <= 1 or mask.stride(-1) in (0, 1):
        return mask
    return mask.contiguous()


def flash_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``aten::_scaled_dot_product_flash_attention_for_cpu``: ``(out, logsumexp)``.

    Inputs pass through :func:`kernel_layout` first (a copy only when the last stride is not 1).
    Looked up at call time, so importing a backend never needs the op (:func:`cpu_flash_available`
    guards the calls). Runs with denormals flushed (:mod:`.denormals`) when the call is large."""
    with flushed_denormals(_work(q, k), q.device):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            kernel_layout(q),
            kernel_layout(k),
            kernel_layout(v),
            dropout_p,
            is_causal,
            attn_mask=_mask_layout(attn_mask),
            scale=scale,
        )


def flash_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``aten::_scaled_dot_product_flash_attention_for_cpu_backward``: ``(dq, dk, dv)``, each shaped
    like its input (dense). Inputs pass through :func:`kernel_layout` as in :func:`flash_forward`,
    and denormals are flushed as there."""
    with flushed_denormals(_work(q, k), q.device):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            kernel_layout(grad_out),
            kernel_layout(q),
            kernel_layout(k),
            kernel_layout(v),
            kernel_layout(out),
            logsumexp,
            dropout_p,
            is_causal,
            attn_mask=_mask_layout(attn_mask),
            scale=scale,
        )


def _work(q: Tensor, k: Tensor) -> int:
    """A call's size in logits (``flushed_denormals`` itself leaves compiled graphs alone)."""
    return q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the kernels' row statistics and the merges accumulate in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
