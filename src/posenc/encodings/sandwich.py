"""Sandwich: a bias from the dot product of sinusoidal embeddings (Chi et al. 2023, "Dissecting Transformer
Length Extrapolation via the Lens of Receptive Field Analysis").

The paper keeps only the position-position term ``p_i·p_j`` of sinusoidal attention: with
sinusoidal embeddings of a (hyper-parameter) width ``d'`` it is a function of the distance alone,
``p_i·p_j = Σ_{k=1}^{d'/2} cos((i − j) / base^(2k/d'))``. posenc adds, for head ``h = 1 … H``
(docs/conventions.md §10.5),

    b_h(i, j) = (Σ_{k=1}^{d'/2} cos((i − j) · base^(−2k/d')) − d'/2) / (8h/H)

as NVIDIA NeMo's ``SandwichRelativePositionEmbedding`` does: the sum runs over ``k = 1 … d'/2``
(the paper's index, so the fastest frequency is ``base^(−2/d')``, not 1), ``d'/2`` is subtracted
so the bias is 0 at distance 0 and negative elsewhere, and each head is divided by the ALiBi-like
compensation ``8h/H`` (head 1 the sharpest). ``d'`` defaults to the layer's ``head_dim`` (NeMo's
``kv_channels``); ``base`` is 10000. The bias is even in ``i − j`` (encoders and decoders alike)
and shift invariant; it decays roughly logarithmically with distance and keeps oscillating past
any training length. No parameters: the frequencies and head factors are float32 buffers, and the
bias is computed in float32.

Backends: every backend that takes an additive bias (``bias_at`` is the single definition; the
blocked backend builds its per-distance table from it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import BiasEncoding, LayerContext
from .registry import at_least, greater_than, register

__functional__ = ["sandwich_inv_freq", "sandwich_head_factors", "sandwich_bias"]


def _check_dim(dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(
            f"sandwich: dim (d', the sinusoidal width) must be a positive even integer, got dim={dim!r}"
        )
    return dim


def sandwich_inv_freq(dim: int, base: float = 10000.0) -> Tensor:
    """``base^(−2k/d')`` for ``k = 1 … d'/2`` (float32, computed in float64): the paper's sum index."""
    _check_dim(dim)
    if not base > 1.0:
        raise ValueError(f"sandwich: base must be > 1, got base={base}")
    exponents = torch.arange(1, dim // 2 + 1, dtype=torch.float64) * 2 / dim
    return (float(base) ** -exponents).float()


def sandwich_head_factors(num_heads: int) -> Tensor:
    """The compensation ``8h/H`` for heads ``h = 1 … H`` (float32) that each head's sum is divided by."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"sandwich: num_heads must be a positive integer, got num_heads={num_heads!r}")
    return torch.arange(1, num_heads + 1, dtype=torch.float64).mul(8.0 / num_heads).float()


def sandwich_bias(distance: Tensor, inv_freq: Tensor) -> Tensor:
    """``Σ_k cos(distance · inv_freq_k) − len(inv_freq)`` elementwise in ``distance`` (float32), before the head factor.

    One term at a time, so the memory is that of ``distance`` whatever ``d'``.
    """
    distance = distance.to(torch.float32)
    total = torch.zeros_like(distance)
    for index in range(inv_freq.shape[0]):
        total = total + torch.cos(distance * inv_freq[index])
    return total - inv_freq.shape[0]


@register("sandwich")
class Sandwich(BiasEncoding):
    """Sandwich (Chi et al. 2023): the sinusoidal dot product ``p_i·p_j − d'/2`` as a bias, divided by ``8h/H`` per head."""

    layer_sizes = ("num_heads",)
    option_ranges = {"num_heads": at_least(1), "dim": at_least(2), "base": greater_than(1)}
    derived_buffers = ("inv_freq", "head_factors")
    shift_invariant = True

    def __init__(self, num_heads: int, dim: int | None = None, base: float = 10000.0) -> None:
        """Args: ``num_heads`` (filled in by the layer); ``dim`` the sinusoidal width ``d'`` (even;
        a layer fills in its ``head_dim`` when the spec leaves it out); ``base`` (10000)."""
        super().__init__()
        if dim is None:
            raise ValueError(
                "sandwich: give dim (d', the sinusoidal width), or build it in a layer (default head_dim)"
            )
        self.num_heads, self.dim, self.base = num_heads, _check_dim(dim), float(base)
        sandwich_head_factors(num_heads)  # validates num_heads
        sandwich_inv_freq(self.dim, self.base)  # validates base
        self.inv_freq: Tensor
        self.head_factors: Tensor
        self.reset_buffers()

    @classmethod
    def layer_defaults(cls, ctx: LayerContext) -> dict[str, Any]:
        """``dim = head_dim`` (NeMo's ``kv_channels``) unless the spec sets it."""
        return {"dim": ctx.head_dim}

    def reset_buffers(self) -> None:
        """The frequencies ``[d'/2]`` and the head factors ``[H]``, float32."""
        self.set_derived("inv_freq", sandwich_inv_freq(self.dim, self.base))
        self.set_derived("head_factors", sandwich_head_factors(self.num_heads))

    def bias_at(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``(Σ_k cos((q − k)·θ_k) − d'/2) / (8(head + 1)/H)``, float32."""
        return sandwich_bias(q_pos - k_pos, self.inv_freq) / self.head_factors[head]

    def preview(self) -> str:
        row = self.bias(1, 9, q_offset=8)[:, 0]
        lines = [f"dim (d')={self.dim}, base={self.base:g}; bias of query 8 to keys 0..8 per head:"]
        for h in range(min(self.num_heads, 4)):
            lines.append(f"head {h}: " + " ".join(f"{v:8.4f}" for v in row[h].tolist()))
        return "\n".join(lines)
