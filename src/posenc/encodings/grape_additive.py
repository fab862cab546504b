"""GRAPE, additive: a rank-1 unipotent action that adds a linear bias (Zhang et al., ICLR 2026, "Group
Representational Position Encoding", arXiv 2512.07805; code: github.com/model-architectures/GRAPE,
``model/llama-mha-grape-a-keygated.py``).

Additive GRAPE lifts queries and keys to ``D + 2`` dimensions and lets a position act by the
unipotent ``G(n) = exp(n ω E) = I + n ω E``, ``E = e_a e_bᵀ`` (``E² = 0``; ``a``, ``b`` the two new
coordinates). With the lifted query ``q̃_i = G(i)⁻ᵀ [q; 1; 0] = [q; 1; −ω i]`` and key
``k̃_j = G(j) [k; 0; 1] = [k; ω j; 1]`` (:func:`grape_additive_lift`),

    ``q̃_i · k̃_j = [q; 1; 0]ᵀ G(j − i) [k; 0; 1] = q·k − ω (i − j)``:

an exact relative law, and ALiBi (``ω = m_h``, its slope) as the special case. Replacing the phase
``ω n`` by a token's cumulative log forget gate with the sign flipped (``φ_n = −c_n``) gives
``q·k + c_i − c_j``, FoX's bias: the Forgetting Transformer is the contextual special case (both
checked against posenc's ``alibi`` and ``fox``; docs/conventions.md §7.16).

This encoding serves the positional (ungated) form as a bias, without lifting: head ``h`` adds
``−ω_h · max(i − j, 0)`` to its scaled logits, with ``ω_h = softplus(ρ_h) · m_h`` (``m_h`` ALiBi's
slope, ``ρ_h`` trainable, initialised to ``softplus⁻¹(omega_init)``, ``omega_init = 1``): at
initialisation exactly ALiBi, then a learned slope per head, as the authors' ``KeyGatedAdditiveBias``
parameterises it (their ``dist = (i − j).clamp_min(0)``: keys after the query get no bias). Their
key gate ``softplus(u_h·k_j/√D)`` (a content-dependent factor) is not implemented.

Backends: every bias backend (eager, sdpa, blocked, flex); with frozen slopes (``learnable=False``)
also the near/far split (the bias is ``−ω i + ω j`` before the diagonal, zero after it:
:class:`~posenc.encodings.base.SeparableBias`), which builds no ``[B, H, L, L]`` tensor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .alibi import alibi_slopes
from .base import BiasEncoding, NearFar, SeparableBias
from .registry import at_least, greater_than, register

__functional__ = ["grape_additive_lift"]


def grape_additive_lift(q: Tensor, k: Tensor, q_phase: Tensor, k_phase: Tensor) -> tuple[Tensor, Tensor]:
    """The unipotent lift ``q̃ = [q; 1; −φ_i]``, ``k̃ = [k; φ_j; 1]`` of ``q [..., Tq, D]``, ``k [..., Tk, D]``
    with phases ``[..., Tq]``, ``[..., Tk]`` (``φ_n = ω n`` for positions): ``q̃·k̃ = q·k + φ_j − φ_i``.

    Raises:
        ValueError: a phase whose last axis is not its tensor's token axis (the message names it).
    """
    if q_phase.shape[-1] != q.shape[-2] or k_phase.shape[-1] != k.shape[-2]:
        raise ValueError(
            f"grape_additive_lift: q_phase / k_phase must have one entry per token, got {tuple(q_phase.shape)} "
            f"for q {tuple(q.shape)} and {tuple(k_phase.shape)} for k {tuple(k.shape)}"
        )
    q_phase = q_phase.to(q.dtype).expand(*q.shape[:-1])
    k_phase = k_phase.to(k.dtype).expand(*k.shape[:-1])
    q_lift = torch.cat((q, torch.ones_like(q_phase)[..., None], -q_phase[..., None]), dim=-1)
    k_lift = torch.cat((k, k_phase[..., None], torch.ones_like(k_phase)[..., None]), dim=-1)
    return q_lift, k_lift


#: The largest ``omega_init``: it multiplies ALiBi's slopes (below 1 logit per token of distance),
#: so past 100 the bias drops by up to ~70 logits a token, a mask on all but the nearest keys rather
#: than a slope to learn from (and ``softplus⁻¹`` by ``log(expm1(ω))`` overflowed at 710).
MAX_OMEGA_INIT = 100.0


def _checked_omega_init(omega_init: float) -> float:
    """``omega_init`` as a float in ``(0, MAX_OMEGA_INIT]``; ValueError naming it otherwise."""
    value = float(omega_init)
    if not 0 < value <= MAX_OMEGA_INIT:
        raise ValueError(
            f"grape_a: omega_init must be in (0, {MAX_OMEGA_INIT:g}], got omega_init={omega_init!r}: it scales "
            "ALiBi's slopes (logits per token of distance), and a larger one masks all but the nearest keys"
        )
    return value


def _inverse_softplus(omega: float) -> float:
    """``softplus⁻¹(ω) = log(e^ω − 1) = ω + log(1 − e^−ω)``: the second form never overflows."""
    return omega + math.log(-math.expm1(-omega))


@register("grape_a")
class GRAPEAdditive(BiasEncoding):
    """Additive GRAPE (Zhang et al. 2026): −ω_h·max(i − j, 0), ω_h = softplus(ρ_h)·m_h learned; ALiBi at init."""

    layer_sizes = ("num_heads",)
    option_ranges = {"num_heads": at_least(1), "omega_init": greater_than(0)}
    derived_buffers = ("slopes",)
    shift_invariant = True

    def __init__(self, num_heads: int, omega_init: float = 1.0, learnable: bool = True) -> None:
        """Args: ``num_heads`` (filled in by the layer); ``omega_init`` (``softplus(ρ)`` at start, the
        authors' 1: ALiBi's slopes); ``learnable`` (train ``ρ``)."""
        super().__init__()
        self.num_heads = num_heads
        raw = _inverse_softplus(_checked_omega_init(omega_init))
        self.omega_raw = nn.Parameter(torch.full((num_heads,), raw), requires_grad=learnable)
        self.slopes: Tensor
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """ALiBi's slopes ``[H]`` in float32."""
        self.set_derived("slopes", alibi_slopes(self.num_heads))

    def omega(self) -> Tensor:
        """``ω [H] = softplus(ρ) · m`` in the wider of float32 and the parameter's dtype."""
        dtype = torch.promote_types(self.omega_raw.dtype, torch.float32)
        return F.softplus(self.omega_raw.to(dtype)) * self.slopes.to(dtype)

    def bias_at(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``−ω_head · max(q_pos − k_pos, 0)``."""
        omega = self.omega()
        distance = (q_pos - k_pos).clamp_min(0).to(omega.dtype)
        return -omega[head] * distance

    def near_far(self) -> NearFar | None:
        """The bias is separable (:meth:`separable`) when the slopes are frozen (``learnable=False``);
        the near/far engine does not differentiate a learned slope through its near band."""
        return None if self.omega_raw.requires_grad else NearFar(separable=self.separable)

    def separable(self, q_pos: Tensor, k_pos: Tensor) -> tuple[SeparableBias, ...]:
        """``−ω(i − j) = −ω·i + ω·j`` at and before the diagonal, ``0`` after it, ``[B|1, H, T]``."""
        omega = self.omega().double()[None, :, None]
        row, col = -omega * q_pos.double()[:, None], omega * k_pos.double()[:, None]
        after_row, after_col = torch.zeros_like(row), torch.zeros_like(col)
        return SeparableBias("before", row, col), SeparableBias("after", after_row, after_col)

    def preview(self) -> str:
        omega = ", ".join(f"{v:.4g}" for v in self.omega().tolist()[:8])
        return f"ω_h = softplus(ρ_h)·m_h = [{omega}{', ...' if self.num_heads > 8 else ''}]; bias −ω_h·max(i − j, 0)"
