"""Dynamic MLP position bias: an MLP of the (log-)distance gives one bias per head.

The semantics of x-transformers' ``DynamicPositionBias`` (REFERENCE.md §10.4; used by
``AttentionLayers(rel_pos_bias=False, dynamic_pos_bias=True)``):

* input ``r = i - j`` (query ``i``, key ``j``), or ``sign(r)·ln(|r| + 1)`` with ``log_distance``;
* ``Linear(1, hidden)`` [+ norm] + SiLU, then ``depth - 1`` × (``Linear(hidden, hidden)`` [+ LayerNorm]
  + SiLU), then ``Linear(hidden, H)``; ``bias[h, i, j] = MLP(r)[h]``, added to the scaled logits.
* ``hidden = dim // 4`` (the model width over 4, as x-transformers' ``AttentionLayers``) unless given,
  ``depth = 2``.
* With ``norm=True`` the first norm is x-transformers' bias-free ``LayerNorm`` (a gain, no shift),
  the later ones are ``nn.LayerNorm`` with gain and shift, exactly as there.

:meth:`bias_at` is the single, elementwise definition (flex ``score_mod`` evaluates it per pair).
The dense path evaluates it once per distinct distance and gathers, which gives the same numbers
because the bias depends on ``i - j`` only (shift invariant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import Kind, PositionalEncoding
from ..registry import register

__functional__ = ["log_distance"]


def log_distance(relative: Tensor) -> Tensor:
    """``sign(r) · ln(|r| + 1)``: the log-distance input of the dynamic position bias."""
    return torch.sign(relative) * torch.log(relative.abs() + 1)


@register("mlp_bias")
class MLPBias(PositionalEncoding):
    """Dynamic position bias (x-transformers DynamicPositionBias): an MLP of i - j gives each head's bias."""

    kind = Kind.BIAS
    shift_invariant = True

    def __init__(
        self,
        num_heads: int,
        dim: int,
        hidden_dim: int | None = None,
        depth: int = 2,
        log_distance: bool = False,
        norm: bool = False,
    ) -> None:
        """Args: ``num_heads``, ``dim`` (model width; filled in by the layer); ``hidden_dim`` (default
        ``dim // 4``); ``depth`` (≥ 1 hidden layers); ``log_distance``; ``norm``."""
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"mlp_bias: num_heads must be a positive integer, got num_heads={num_heads!r}")
        if depth < 1:
            raise ValueError(f"mlp_bias: depth must be >= 1, got depth={depth}")
        hidden = hidden_dim if hidden_dim is not None else dim // 4
        if hidden <= 0:
            raise ValueError(f"mlp_bias: hidden_dim must be positive, got hidden_dim={hidden} (dim={dim})")
        self.num_heads, self.hidden_dim, self.depth = num_heads, hidden, depth
        self.log_distance, self.norm = log_distance, norm
        self.linears = nn.ModuleList([nn.Linear(1, hidden)] + [nn.Linear(hidden, hidden) for _ in range(depth - 1)])
        self.first_norm_gain = nn.Parameter(torch.ones(hidden)) if norm else None
        self.norms = nn.ModuleList([nn.LayerNorm(hidden) for _ in range(depth - 1)]) if norm else None
        self.out = nn.Linear(hidden, num_heads)

    def _hidden(self, relative: Tensor) -> Tensor:
        """The last hidden layer ``[..., hidden]`` for relative distances ``relative`` (float32 or float64).

        Parameters are cast to ``relative``'s dtype, so a bf16 model still gets a float32 bias.
        """
        dtype = relative.dtype
        x = log_distance(relative) if self.log_distance else relative
        first = self.linears[0]
        h = x[..., None] * first.weight[:, 0].to(dtype) + first.bias.to(dtype)
        if self.first_norm_gain is not None:
            h = F.layer_norm(h, (self.hidden_dim,)) * self.first_norm_gain.to(dtype)
        h = F.silu(h)
        for index, linear in enumerate(self.linears[1:]):
            h = F.linear(h, linear.weight.to(dtype), linear.bias.to(dtype))
            if self.norms is not None:
                norm = self.norms[index]
                h = F.layer_norm(h, (self.hidden_dim,), norm.weight.to(dtype), norm.bias.to(dtype), norm.eps)
            h = F.silu(h)
        return h

    def bias_at(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        dtype = torch.promote_types(self.out.weight.dtype, torch.float32)
        hidden = self._hidden((q_pos - k_pos).to(dtype))
        out = (hidden * self.out.weight[head].to(dtype)).sum(-1) + self.out.bias[head].to(dtype)
        return out

    def bias_for_positions(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Dense ``[B, H, Tq, Tk]``: :meth:`bias_at` on each distinct distance, gathered (the MLP runs 2L-1 times, not L²)."""
        relative = q_pos[:, :, None] - k_pos[:, None, :]  # [B, Tq, Tk]
        if relative.numel() == 0:
            return super().bias_for_positions(q_pos, k_pos)
        low, high = int(relative.min()), int(relative.max())
        distances = torch.arange(low, high + 1, device=relative.device)
        heads = torch.arange(self.num_heads, device=relative.device)
        table = self.bias_at(heads[:, None], distances[None, :], torch.zeros_like(distances)[None, :])  # [H, R]
        return table[:, relative - low].transpose(0, 1)

    @torch.no_grad()
    def preview(self) -> str:
        bias = self.bias(1, 9, q_offset=8)[:, 0]
        rows = [f"hidden={self.hidden_dim}, depth={self.depth}, log_distance={self.log_distance}; query 8, keys 0..8:"]
        for h in range(min(self.num_heads, 4)):
            rows.append(f"head {h}: " + " ".join(f"{v:7.3f}" for v in bias[h].tolist()))
        return "\n".join(rows)
