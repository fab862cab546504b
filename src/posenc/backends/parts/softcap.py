"""Logit soft-capping (Gemma 2, Grok-1): ``s <- c * tanh(s / c)`` on each logit before the softmax.

What is capped is the logit made from q and k: ``q·kᵀ·scale`` (or a CONTENT encoding's whole
``logits``, whose position terms cannot be told apart from its content terms). A BIAS encoding's bias,
a user's float mask and hidden keys are added *after* the cap, as FlashAttention adds ALiBi after its
``softcap`` and HF Gemma 2 adds its mask after capping. Only backends that form each logit before the
softmax can apply it (``serves_softcap = True``); a fused kernel that takes no logits cannot.
"""

from __future__ import annotations

import math
import numbers

from torch import Tensor

__all__ = ["SOFTCAP_REASON", "check_softcap", "soft_cap", "soft_cap_backward"]

#: Why a backend without ``serves_softcap = True`` refuses a soft-capped request.
SOFTCAP_REASON = (
    "logit soft-capping (softcap) needs each logit before the softmax, and this backend's kernel takes "
    "none: eager, blocked, relative and flex serve it"
)


def check_softcap(softcap: object, where: str = "softcap") -> float | None:
    """``softcap`` as a float, or None (no capping): finite and > 0, else a ValueError naming ``where``.

    A cap of 0 divides by zero, a negative one flips every logit's sign, inf caps nothing (pass None).
    """
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ValueError(
            f"{where} must be a number > 0 (the logit cap c in c * tanh(s / c), Gemma 2 uses 50.0) or None, "
            f"got {softcap!r} ({type(softcap).__name__})"
        )
    value = float(softcap)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{where} must be finite and > 0 (the logit cap c in c * tanh(s / c), Gemma 2 uses 50.0); "
            f"pass None for no capping, got {softcap!r}"
        )
    return value


def soft_cap(logits: Tensor, softcap: float | None) -> Tensor:
    """``softcap * tanh(logits / softcap)`` (same shape and dtype); ``logits`` unchanged for None."""
    if softcap is None:
        return logits
    return (logits / softcap).tanh() * softcap


def soft_cap_backward(grad: Tensor, capped: Tensor, softcap: float) -> Tensor:
    """The gradient of the logits before the cap from ``grad`` of the capped ones ``capped``:
    ``d/ds [c tanh(s / c)] = 1 - tanh² = 1 - (capped / c)²``."""
    tanh = capped / softcap
    return grad * (1 - tanh * tanh)
