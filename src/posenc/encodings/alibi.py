"""ALiBi: attention with linear biases (Press, Smith and Lewis 2022, "Train Short, Test Long").

Each head ``h`` adds ``−m_h·distance`` to its scaled logits ``q·k/√d``; there is no input embedding.

Slopes (docs/conventions.md §6.1, the paper's ``get_slopes``): for a power of two ``n``,
``m_h = 2^(−8h/n)``, ``h = 1…n``. For other ``n``, with ``c = 2^floor(log2 n)``: the ``c`` slopes of
``c`` followed by the first ``n − c`` of the slopes of ``2c`` at even list indices (exponents
``−8·(2t+1)/(2c)``). 8 heads: ``1/2 … 1/256``; 12 heads: ``2^−1 … 2^−8, 2^−0.5, 2^−1.5, 2^−2.5,
2^−3.5``; 6 heads: ``[2^−2, 2^−4, 2^−6, 2^−8, 2^−1, 2^−3]`` (not monotone). Computed in float64,
stored as float32 (equal to HF BLOOM ``_get_alibi_slopes`` and x-transformers to float32 rounding).

Modes (``i`` query position, ``j`` key position):

* ``mode="causal"`` (the paper): ``bias = −m_h·(i − j)``, evaluated for every pair. Future keys
  (``j > i``) get a *positive* bias ``m_h·(j − i)``, harmless only because the causal mask removes
  them. A causal-mode encoding therefore refuses to join a layer built with ``causal=False``; use
  ``mode="symmetric"`` for encoders and for cross-attention (which is never masked causally, even
  in a ``causal=True`` layer). Under a causal mask the two modes give identical attention.
  The paper's reference code and HF BLOOM add ``m_h·j`` instead; that differs from ours by the row
  constant ``m_h·i``, so the softmax is identical under a causal mask (tested).
* ``mode="symmetric"`` (encoders; ofirpress issue #5, x-transformers ``AlibiPositionalBias``):
  ``bias = −m_h·|i − j|``.

Both depend on ``i − j`` only (shift invariant). No learnable parameters: the slopes are a
non-persistent buffer. Kind BIAS: ``bias_at`` is the single definition, used by the dense bias, the
eager, sdpa and blocked backends and the flex ``score_mod``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from .base import BiasEncoding, NearFar, SeparableBias
from .registry import at_least, register

__functional__ = ["alibi_slopes"]

Mode = Literal["causal", "symmetric"]
_MODES = ("causal", "symmetric")


def _power_of_two_slopes(n: int) -> list[float]:
    # Geometric sequence starting at 2^(-8/n) with that same ratio: 2^(-8h/n), h = 1..n.
    return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]


def alibi_slopes(num_heads: int) -> Tensor:
    """The ALiBi slopes ``[num_heads]`` (float32) by the paper's rule for any head count.

    Raises:
        ValueError: ``num_heads`` is not a positive integer.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"alibi: num_heads must be a positive integer, got num_heads={num_heads!r}")
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = _power_of_two_slopes(closest)
    # Heads beyond the power of two interleave between the existing slopes: every other slope of 2c.
    slopes += _power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64).to(torch.float32)


@register("alibi")
class ALiBi(BiasEncoding):
    """Linear distance penalty per head, no position embedding (Press et al. 2022)."""

    layer_sizes = ("num_heads",)
    option_ranges = {"num_heads": at_least(1)}
    derived_buffers = ("slopes",)
    shift_invariant = True
    noncausal_options = {"mode": "symmetric"}

    def __init__(self, num_heads: int, mode: Mode = "causal") -> None:
        """Args: ``num_heads`` (filled in by the layer); ``mode`` ``"causal"`` or ``"symmetric"``."""
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"alibi: mode must be one of {_MODES}, got mode={mode!r}")
        self.num_heads, self.mode = num_heads, mode
        # The causal form rewards distant *future* keys: only a causal mask makes it correct, so the
        # layer refuses it in non-causal and cross-attention (use mode="symmetric" there).
        self.causal_only = mode == "causal"
        self.slopes: Tensor
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """The slopes ``[H]`` in float32 (``.to(bf16)`` would round them)."""
        self.set_derived("slopes", alibi_slopes(self.num_heads))

    def bias_at(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``−m_head·(q_pos − k_pos)`` (causal) or ``−m_head·|q_pos − k_pos|`` (symmetric), float32."""
        # Negate in integers (k − i rather than −(i − k)) so the diagonal is +0.0, not −0.0.
        signed = k_pos - q_pos if self.mode == "causal" else -(q_pos - k_pos).abs()
        return self.slopes[head] * signed.to(torch.float32)

    def near_far(self) -> NearFar:
        """The bias is separable (:meth:`separable`)."""
        return NearFar(separable=self.separable)

    def separable(self, q_pos: Tensor, k_pos: Tensor) -> tuple[SeparableBias, ...]:
        """``−m(i − j) = −m·i + m·j`` (causal mode, every pair); symmetric mode: that before the
        diagonal and ``m·i − m·j`` after it. float64 ``[B|1, H, T]``, exact for integer positions."""
        slopes = self.slopes.double()[None, :, None]
        row, col = -slopes * q_pos.double()[:, None], slopes * k_pos.double()[:, None]
        if self.mode == "causal":
            return (SeparableBias("all", row, col),)
        return SeparableBias("before", row, col), SeparableBias("after", -row, -col)

    def preview(self) -> str:
        slopes = self.slopes.tolist()
        lines = [f"mode={self.mode}; slopes m_h for {self.num_heads} heads:"]
        for h, m in enumerate(slopes):
            lines.append(f"  head {h}: m = {m:.8g} = 2^{math.log2(m):.4g}")
        row = (
            self.bias(1, 8, q_offset=7)[0, 0] if self.mode == "causal" else self.bias(1, 9, q_offset=4)[0, 0]
        )
        where = "query 7, keys 0..7" if self.mode == "causal" else "query 4, keys 0..8"
        lines.append(f"  head 0 bias, {where}:")
        lines.append("    " + " ".join(f"{v:+.4f}" for v in row.tolist()))
        return "\n".join(lines)
