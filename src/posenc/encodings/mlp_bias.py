"""Dynamic MLP position bias: an MLP of the (log-)distance gives one bias per head.

The semantics of x-transformers' ``DynamicPositionBias`` (docs/conventions.md §10.3; used by
``AttentionLayers(rel_pos_bias=False, dynamic_pos_bias=True)``):

* input ``r = i - j`` (query ``i``, key ``j``), or ``sign(r)·ln(|r| + 1)`` with ``log_distance``;
* ``Linear(1, hidden)`` [+ norm] + SiLU, then ``depth - 1`` × (``Linear(hidden, hidden)`` [+ LayerNorm]
  + SiLU), then ``Linear(hidden, H)``; ``bias[h, i, j] = MLP(r)[h]``, added to the scaled logits.
* ``hidden = dim // 4`` (the model width over 4, as x-transformers' ``AttentionLayers``) unless given,
  ``depth = 2``.
* With ``norm=True`` the first norm is x-transformers' bias-free ``LayerNorm`` (a gain, no shift),
  the later ones are ``nn.LayerNorm`` with gain and shift, exactly as there.

:meth:`bias_at` is the single, elementwise definition. Called with 0-d indices (flex
``score_mod``) it evaluates the MLP unrolled over hidden units, with pointwise ops only, so the
compiled kernel can inline it. That compiles in seconds for the default ``depth=2`` without norm;
the inlined expression grows like ``hidden_dim^depth`` (minutes for ``depth=3`` or ``norm=True``), so
for those prefer the blocked backend, which evaluates ``bias_at`` once per distance. Called with
tensors it runs the same MLP vectorised. The dense path (:meth:`distance_table`, gathered) also
evaluates it once per distinct distance, which gives the same numbers because the bias depends on
``i - j`` only (shift invariant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import BiasEncoding, check_table_size
from .registry import Range, at_least, register

__functional__ = ["log_distance"]


def log_distance(relative: Tensor) -> Tensor:
    """``sign(r) · ln(|r| + 1)``: the log-distance input of the dynamic position bias."""
    return torch.sign(relative) * torch.log(relative.abs() + 1)


def _pointwise_layer_norm(units: list[Tensor], eps: float = 1e-5) -> list[Tensor]:
    """LayerNorm (no affine) over a list of same-shaped tensors, one per feature, with pointwise ops only."""
    mean = sum(units) / len(units)
    variance = sum((v - mean) ** 2 for v in units) / len(units)
    scale = torch.rsqrt(variance + eps)
    return [(v - mean) * scale for v in units]


def _select_head(per_head: Tensor, head: Tensor) -> Tensor:
    """``per_head[..., head]`` for ``per_head [..., H]`` and a ``head`` index broadcastable to ``per_head[..., 0]``.

    The MLP output of all heads is computed once per (query, key) pair and the head picked after,
    so the dense bias never holds a ``[B, H, Tq, Tk, hidden]`` tensor; with 0-d indices (flex
    ``score_mod``) it is a plain lookup.
    """
    shape = torch.broadcast_shapes(head.shape, per_head.shape[:-1])
    index = head.expand(shape)[..., None].to(torch.int64)
    return per_head.expand(*shape, per_head.shape[-1]).gather(-1, index).squeeze(-1)


@register("mlp_bias")
class MLPBias(BiasEncoding):
    """Dynamic position bias (x-transformers DynamicPositionBias): an MLP of i - j gives each head's bias."""

    layer_sizes = ("num_heads", "dim")
    option_ranges = {
        "num_heads": at_least(1),
        "dim": at_least(1),
        "hidden_dim": at_least(1),
        "depth": Range(low=1, high=64),  # each depth is a module: 100,000 of them took minutes to build
    }
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
        hidden = hidden_dim if hidden_dim is not None else dim // 4
        if hidden <= 0:
            raise ValueError(f"mlp_bias: hidden_dim must be positive, got hidden_dim={hidden} (dim={dim})")
        check_table_size("mlp_bias", "hidden_dim", hidden, hidden * hidden * max(depth - 1, 1))
        self.num_heads, self.hidden_dim, self.depth = num_heads, hidden, depth
        self.log_distance, self.norm = log_distance, norm
        self.linears = nn.ModuleList(
            [nn.Linear(1, hidden)] + [nn.Linear(hidden, hidden) for _ in range(depth - 1)]
        )
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

    def _pointwise(self, head: Tensor, relative: Tensor) -> Tensor:
        """The same MLP unrolled over hidden units (pointwise ops only), for flex's per-element ``score_mod``."""
        dtype = relative.dtype
        x = log_distance(relative) if self.log_distance else relative
        first = self.linears[0]
        w, b = first.weight[:, 0].to(dtype), first.bias.to(dtype)
        units = [x * w[u] + b[u] for u in range(self.hidden_dim)]
        if self.first_norm_gain is not None:
            gain = self.first_norm_gain.to(dtype)
            units = [v * gain[u] for u, v in enumerate(_pointwise_layer_norm(units))]
        units = [F.silu(v) for v in units]
        for index, linear in enumerate(self.linears[1:]):
            weight, bias = linear.weight.to(dtype), linear.bias.to(dtype)
            units = [
                sum((weight[v, u] * units[u] for u in range(self.hidden_dim)), bias[v])
                for v in range(self.hidden_dim)
            ]
            if self.norms is not None:
                norm = self.norms[index]
                gain, shift = norm.weight.to(dtype), norm.bias.to(dtype)
                units = [v * gain[u] + shift[u] for u, v in enumerate(_pointwise_layer_norm(units, norm.eps))]
            units = [F.silu(v) for v in units]
        weight, bias = self.out.weight.to(dtype), self.out.bias.to(dtype)
        return sum((weight[head, u] * units[u] for u in range(self.hidden_dim)), bias[head])

    def bias_at(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        dtype = torch.promote_types(self.out.weight.dtype, torch.float32)
        relative = (q_pos - k_pos).to(dtype)
        if head.dim() == 0 and relative.dim() == 0:  # one (head, query, key) at a time: flex score_mod
            return self._pointwise(head, relative)
        per_head = F.linear(
            self._hidden(relative), self.out.weight.to(dtype), self.out.bias.to(dtype)
        )  # [..., H]
        return _select_head(per_head, head)

    def distance_table(self, low: int, high: int, device: torch.device | None = None) -> Tensor:
        """``table[h, r - low] = bias_at(h, r, 0)`` for every distance ``r = i - j`` in ``[low, high]``: ``[H, high - low + 1]``.

        The bias depends on ``i - j`` only, so a kernel can look it up per element (a flex
        ``score_mod`` reading this table compiles quickly for any depth, unlike the unrolled MLP).
        """
        device = device or self.out.weight.device
        distances = torch.arange(low, high + 1, device=device)
        heads = torch.arange(self.num_heads, device=device)
        return self.bias_at(heads[:, None], distances[None, :], torch.zeros_like(distances)[None, :])

    def bias_for_positions(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Dense ``[B, H, Tq, Tk]``: :meth:`distance_table` gathered (the MLP runs on 2L-1 distances, not L² pairs)."""
        relative = q_pos[:, :, None] - k_pos[:, None, :]  # [B, Tq, Tk]
        if relative.numel() == 0:
            return super().bias_for_positions(q_pos, k_pos)
        low, high = int(relative.min()), int(relative.max())
        table = self.distance_table(low, high, relative.device)  # [H, R]
        return table[:, relative - low].transpose(0, 1)

    @torch.no_grad()
    def preview(self) -> str:
        bias = self.bias(1, 9, q_offset=8)[:, 0]
        rows = [
            f"hidden={self.hidden_dim}, depth={self.depth}, log_distance={self.log_distance}; query 8, keys 0..8:"
        ]
        for h in range(min(self.num_heads, 4)):
            rows.append(f"head {h}: " + " ".join(f"{v:7.3f}" for v in bias[h].tolist()))
        return "\n".join(rows)
