"""Facts about PyTorch's fused CPU flash-attention kernel, shared by the backends that call it
directly (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward)."""

from __future__ import annotations

import functools
import warnings

import torch

__all__ = [
    "FLASH_DTYPES",
    "NONFINITE_REASON",
    "accumulation_dtype",
    "cpu_flash_available",
    "flash_backward",
    "flash_forward",
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


@functools.lru_cache(maxsize=1)
def _schema_drift() -> str | None:
    from ..seams import cpu_flash_drift

    line = cpu_flash_drift()
    if line is not None:
        warnings.warn(f"posenc does not call the CPU flash kernel: {line}", RuntimeWarning, stacklevel=3)
    return line


def flash_forward(*args, **kwargs):
    """``aten::_scaled_dot_product_flash_attention_for_cpu``: ``(out, logsumexp)``.

    Looked up at call time, so importing a backend never needs the op (:func:`cpu_flash_available`
    guards the calls)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, **kwargs)


def flash_backward(*args, **kwargs):
    """``aten::_scaled_dot_product_flash_attention_for_cpu_backward``: ``(dq, dk, dv)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, **kwargs)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the kernels' row statistics and the merges accumulate in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
