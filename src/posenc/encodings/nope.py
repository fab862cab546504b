"""NoPE: no positional information (Haviv et al. 2022; Kazemnejad et al. 2023).

Plain dot-product attention; order can only come from a causal mask. Without a mask, attention is
permutation-equivariant (docs/conventions.md §2.4). Kind ABSOLUTE with a zero embedding, so attention
is plain dot-product attention, run by the sdpa backend (or eager).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import AbsoluteEncoding
from .registry import register

__functional__: list[str] = []


@register("nope")
class NoPE(AbsoluteEncoding):
    """No positional encoding: attention sees order only through the causal mask."""

    shift_invariant = True

    def __init__(self) -> None:
        super().__init__()

    def encode(self, positions: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        return torch.zeros(*positions.shape, 0, dtype=dtype or torch.float32, device=positions.device)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return x

    def preview(self) -> str:
        return "NoPE adds nothing: logits are q·k/sqrt(d), order comes only from the causal mask."
