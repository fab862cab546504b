"""FIRE: functional interpolation for relative positions (Li et al. 2023, ICLR 2024).

A small MLP maps a normalised, log-transformed relative distance to one bias per head
(docs/conventions.md §10.2, from the paper's pseudo-code):

``b_h(i, j) = f_θ( ψ(i - j) / (ψ(max(i, L)) + eps) )_h``, ``ψ(x) = ln(|c·x| + 1)``

* ``i`` query position, ``j`` key position (causal attention, so ``i - j ≥ 0`` where it counts).
* ``c`` learnable, init 0.1; ``L = |L_mult · L_init|`` the progressive-interpolation threshold,
  ``L_init = 512`` frozen and ``L_mult`` learnable, init 1; ``eps = 1e-6``.
* ``f_θ = Linear(1, hidden) → ReLU → Linear(hidden, H)`` with ``hidden = 32``.

The bias is added to the scaled logits. Normalising by ``ψ(max(i, L))`` makes it depend on the
absolute query position beyond ``L``, so FIRE is not shift invariant. ``bias_at`` evaluates the MLP
elementwise, unrolled over its hidden units (pointwise ops only), so the eager, sdpa and blocked
backends and a compiled flex ``score_mod`` all run the same definition.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import BiasEncoding
from .registry import at_least, greater_than, register

__functional__ = ["fire_input"]


def fire_input(q_pos: Tensor, k_pos: Tensor, c: Tensor, threshold: Tensor, eps: float = 1e-6) -> Tensor:
    """The MLP input ``ψ(i - j) / (ψ(max(i, L)) + eps)`` with ``ψ(x) = ln(|c·x| + 1)``; broadcastable tensors."""
    dtype = torch.promote_types(c.dtype, torch.float32)
    i, j = q_pos.to(dtype), k_pos.to(dtype)
    distance = torch.log(torch.abs(c * (i - j)) + 1)
    normaliser = torch.log(torch.abs(c * torch.maximum(i, threshold.to(dtype))) + 1)
    return distance / (normaliser + eps)


@register("fire")
class FIRE(BiasEncoding):
    """FIRE (Li et al. 2023): an MLP of the log-normalised distance gives each head's bias; causal only."""

    layer_sizes = ("num_heads",)
    option_ranges = {
        "num_heads": at_least(1),
        "hidden_dim": at_least(1),
        "threshold_init": greater_than(0),
        "eps": greater_than(0),
    }
    causal_only = True

    def __init__(
        self,
        num_heads: int,
        hidden_dim: int = 32,
        c_init: float = 0.1,
        threshold_init: float = 512.0,
        eps: float = 1e-6,
    ) -> None:
        """Args: ``num_heads`` (filled in by the layer); ``hidden_dim`` of ``f_θ``; ``c_init``
        (initial ``c``); ``threshold_init`` (``L_init``, frozen); ``eps``."""
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"fire: num_heads must be a positive integer, got num_heads={num_heads!r}")
        self.num_heads, self.eps = num_heads, eps
        self.c = nn.Parameter(torch.tensor(float(c_init)))
        self.threshold_mult = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("threshold_init", torch.tensor(float(threshold_init)))
        self.mlp_in = nn.Linear(1, hidden_dim)
        self.mlp_out = nn.Linear(hidden_dim, num_heads)

    @property
    def threshold(self) -> Tensor:
        """``L = |L_mult · L_init|``."""
        return torch.abs(self.threshold_mult * self.threshold_init)

    def bias_at(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        x = fire_input(
            q_pos, k_pos, self.c, self.threshold, self.eps
        )  # float32 (float64 for a float64 model)
        dtype = x.dtype
        w_in, b_in = self.mlp_in.weight[:, 0].to(dtype), self.mlp_in.bias.to(dtype)
        w_out, b_out = self.mlp_out.weight.to(dtype), self.mlp_out.bias.to(dtype)
        # f_θ unrolled over its hidden units: only pointwise ops, so flex's score_mod compiles it, and
        # the dense bias never holds a [B, H, Tq, Tk, hidden] tensor.
        out = b_out[head]
        for unit in range(w_in.shape[0]):
            out = out + torch.relu(x * w_in[unit] + b_in[unit]) * w_out[head, unit]
        return out

    @torch.no_grad()
    def preview(self) -> str:
        bias = self.bias(1, 9, q_offset=8)[:, 0]
        rows = [f"c={float(self.c):.4g}, L={float(self.threshold):.4g}; bias of query 8 to keys 0..8:"]
        for h in range(min(self.num_heads, 4)):
            rows.append(f"head {h}: " + " ".join(f"{v:7.3f}" for v in bias[h].tolist()))
        return "\n".join(rows)
