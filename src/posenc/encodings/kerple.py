"""Kerple: kernelized relative positional bias (Chi et al. 2022, "KERPLE").

A learnable conditionally positive definite kernel of the causal distance
``D(i, j) = max(i - j, 0)`` (query ``i``, key ``j``; 0 on and above the diagonal, where the causal
mask removes it anyway), one pair of parameters per head (docs/conventions.md §10.1, chijames/KERPLE
``megatron/mpu/layers.py``):

* ``variant="log"``:   ``b_h(i, j) = -p_h · ln(1 + a_h · D)``
* ``variant="power"``: ``b_h(i, j) = -a_h · D^(p_h)``, ``p_h`` clamped to ``[0.01, 2]``

The bias is added to the scaled logits ``q·k/√d``. Parameters are initialised like the reference
(``p ~ U[0, 2)``, ``a ~ U[0, 1)``). The reference clamps them in place to ``≥ 0.01`` every forward;
here the clamp is part of :meth:`bias_at` (same values; no gradient flows to a parameter while it
sits below its bound), so the one elementwise definition serves eager, SDPA and flex.

Backends: every backend that takes an additive bias (``bias_at`` is the single definition).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from .base import BiasEncoding
from .registry import at_least, register

__functional__ = ["kerple_bias"]

Variant = Literal["log", "power"]
_MIN_PARAM = 0.01
_MAX_POWER = 2.0


def kerple_bias(distance: Tensor, p: Tensor, a: Tensor, variant: Variant = "log") -> Tensor:
    """The Kerple bias for non-negative ``distance`` (``max(i - j, 0)``) and broadcastable ``p``, ``a``.

    ``log``: ``-p · ln(1 + a·D)``; ``power``: ``-a · D^p``. Parameters are clamped as in the
    reference (``p, a ≥ 0.01``, power's ``p ≤ 2``). ``D^p`` is written so that ``D = 0`` gives 0 with
    a finite gradient in ``p``.
    """
    distance = distance.to(torch.promote_types(p.dtype, torch.float32))
    a = a.clamp(min=_MIN_PARAM)
    if variant == "log":
        return -p.clamp(min=_MIN_PARAM) * torch.log1p(a * distance)
    if variant == "power":
        p = p.clamp(min=_MIN_PARAM, max=_MAX_POWER)
        positive = distance > 0
        powered = torch.where(positive, distance.clamp(min=1.0) ** p, torch.zeros_like(distance))
        return -a * powered
    raise ValueError(f"kerple: variant must be 'log' or 'power', got {variant!r}")


@register("kerple")
class Kerple(BiasEncoding):
    """Kerple (Chi et al. 2022): learnable log or power kernel of the causal distance, per head."""

    layer_sizes = ("num_heads",)
    option_ranges = {"num_heads": at_least(1)}
    shift_invariant = True
    causal_only = True

    def __init__(self, num_heads: int, variant: Variant = "log") -> None:
        """Args: ``num_heads`` (filled in by the layer); ``variant`` ``"log"`` or ``"power"``."""
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"kerple: num_heads must be a positive integer, got num_heads={num_heads!r}")
        if variant not in ("log", "power"):
            raise ValueError(f"kerple: variant must be 'log' or 'power', got variant={variant!r}")
        self.num_heads, self.variant = num_heads, variant
        self.bias_p = nn.Parameter(torch.rand(num_heads) * 2)  # reference init U[0, 2)
        self.bias_a = nn.Parameter(torch.rand(num_heads))  # reference init U[0, 1)

    def bias_at(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        distance = (q_pos - k_pos).clamp(min=0)
        bias = kerple_bias(distance, self.bias_p[head], self.bias_a[head], self.variant)
        return bias if bias.dtype == torch.float64 else bias.float()

    @torch.no_grad()
    def preview(self) -> str:
        rows = [f"variant={self.variant}; bias of query 8 to keys 0..8 per head:"]
        bias = self.bias(1, 9, q_offset=8)[:, 0]
        for h in range(min(self.num_heads, 4)):
            rows.append(f"head {h}: " + " ".join(f"{v:7.3f}" for v in bias[h].tolist()))
        return "\n".join(rows)
