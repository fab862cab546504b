"""Relative-projection bias (Inkling; x-transformers ``RelativeProjPositionalBias``): a bias from the input.

Each query token ``i`` mixes a trained bank of bias-versus-distance curves ``P [d_rel, extent]`` with
its own weights ``r_i = W_r x_i`` (one ``d_rel`` vector per head, from the layer input before the
projections). The bias of query ``i`` on key ``j`` is

``bias(h, i, j) = (r_{i,h} · P)[i − j]`` for ``0 <= i − j < extent``, and 0 elsewhere,

with ``i − j`` counted in tokens of the sequence (cached ones included). Inkling's global layers also
multiply the bias by the log temperature of their queries, ``1 + a · ln(max((i + 1) / n, 1))``
(``log_scaling_alpha``, ``log_scaling_n_floor``: give the layer the same
:class:`~posenc.layers.temperature.LogQueryTemperature`). Equal to HF ``InklingRelativeLogits`` (``r_proj``
without bias, ``proj``) and to x-transformers ``RelativeProjPositionalBias`` (``bias=True``,
``distance_bank``), with copied weights.

Input-dependent: the layer calls :meth:`RelProj.token_states` on its input (``r`` as ``[B, H·d_rel,
T]``, the cached tokens' kept beside their keys), and the eager and sdpa backends evaluate
:meth:`RelProj.bias_from_states`, the flex backend's ``score_mod`` the same bias per score
(:meth:`RelProj.bias_at_index`). Queries and keys must come from one sequence (self-attention only).
``bias_at`` is the bias at zero input (0 everywhere), for plots.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .base import BiasEncoding, InputBias, TokenStates
from .registry import at_least, greater_than, register

__functional__ = ["relproj_bias"]


def _log_temperature(index: Tensor, alpha: float, n_floor: float | None) -> Tensor | None:
    """``1 + alpha · ln(max((i + 1) / n_floor, 1))`` per query index ``[Tq]`` (float32), or None."""
    if n_floor is None:
        return None
    ratio = (index.to(torch.float32) + 1.0) / n_floor
    return 1.0 + alpha * torch.log(ratio.clamp(min=1.0))


def relproj_bias(weights: Tensor, bank: Tensor, q_index: Tensor, k_index: Tensor) -> Tensor:
    """The bias ``[B, H, Tq, Tk]``: ``(weights[b, h, i] · bank)[i − j]`` for ``0 <= i − j < extent``.

    ``weights [B, H, Tq, d_rel]`` (the queries' ``r``), ``bank [d_rel, extent]``, ``q_index [Tq]`` and
    ``k_index [Tk]`` the tokens' indices in the sequence.
    """
    curves = weights @ bank.to(weights.dtype)  # [B, H, Tq, extent]
    distance = q_index[:, None] - k_index[None, :]
    inside = (distance >= 0) & (distance < bank.shape[1])
    index = distance.clamp(0, bank.shape[1] - 1).expand(*curves.shape[:2], -1, -1)
    return curves.gather(-1, index).masked_fill(~inside, 0.0)


@register("relproj")
class RelProj(BiasEncoding):
    """Inkling's relative-projection bias: per-token mixtures of a bank of bias-vs-distance curves."""

    layer_sizes = ("num_heads", "dim")
    option_ranges = {
        "num_heads": at_least(1),
        "dim": at_least(1),
        "d_rel": at_least(1),
        "extent": at_least(1),
        "init_std": greater_than(0),
        "log_scaling_n_floor": greater_than(0),
    }
    self_attention_only = True
    example_options = {"extent": 12}

    def __init__(
        self,
        num_heads: int,
        dim: int,
        d_rel: int = 16,
        extent: int = 1024,
        bias: bool = False,
        init_std: float = 0.02,
        log_scaling_alpha: float = 0.1,
        log_scaling_n_floor: float | None = None,
    ) -> None:
        """Args: ``num_heads`` and ``dim`` (the layer's, filled in by it); ``d_rel`` (curves in the
        bank, HF ``d_rel``, x-transformers ``num_distance_basis``); ``extent`` (distances with a bias,
        HF ``rel_extent``, x-transformers ``max_dist``); ``bias`` (a bias in ``W_r``: x-transformers
        has one, Inkling not); ``init_std`` (of the bank); ``log_scaling_n_floor`` and
        ``log_scaling_alpha`` (Inkling's global layers: the bias times ``1 + alpha · ln(max((i + 1) /
        n_floor, 1))``; None: not scaled)."""
        super().__init__()
        for option, value in (("num_heads", num_heads), ("dim", dim), ("d_rel", d_rel), ("extent", extent)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"relproj: {option} must be a positive integer, got {option}={value!r}")
        if not math.isfinite(log_scaling_alpha):
            raise ValueError(f"relproj: log_scaling_alpha must be finite, got {log_scaling_alpha}")
        self.num_heads, self.d_rel, self.extent = num_heads, d_rel, extent
        self.log_scaling_alpha = float(log_scaling_alpha)
        self.log_scaling_n_floor = None if log_scaling_n_floor is None else float(log_scaling_n_floor)
        self.to_weights = nn.Linear(dim, num_heads * d_rel, bias=bias)
        self.bank = nn.Parameter(torch.randn(d_rel, extent) * init_std)

    def _state_dtype(self) -> torch.dtype:
        return torch.promote_types(self.bank.dtype, torch.float32)

    def input_bias(self) -> InputBias:
        """The bias from the queries' weights ``r`` (:meth:`token_states`)."""
        return InputBias(self.token_states, self.bias_from_states, bias_at_index=self.bias_at_index)

    def token_states(
        self, x: Tensor, previous: Tensor | None = None, padding: Tensor | None = None
    ) -> Tensor:
        """``r = W_r x`` as ``[B, H·d_rel, T]`` for ``x [B, T, dim]`` (float32 or wider); each token's
        own, so ``previous`` and ``padding`` change nothing (a padded query's row is hidden anyway)."""
        return self.to_weights(x).to(self._state_dtype()).transpose(1, 2)

    def _weights(self, states: Tensor) -> Tensor:
        """``[B, H·d_rel, T]`` -> ``[B, H, T, d_rel]``."""
        batch, _, length = states.shape
        return states.view(batch, self.num_heads, self.d_rel, length).transpose(2, 3)

    def bias_from_states(self, states: TokenStates) -> Tensor:
        """The bias ``[B, H, Tq, Tk]`` (float32 or wider), times the log temperature when set."""
        bias = relproj_bias(self._weights(states.q), self.bank, states.q_index, states.k_index)
        scale = _log_temperature(states.q_index, self.log_scaling_alpha, self.log_scaling_n_floor)
        return bias if scale is None else bias * scale[:, None].to(bias.dtype)

    def bias_at_index(self, states: TokenStates, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        """The bias at batch, head, query and key indices, elementwise (the flex backend's score_mod)."""
        distance = states.q_index[q] - states.k_index[k]
        column = distance.clamp(0, self.extent - 1)
        bank = self.bank.to(self._state_dtype())
        bias = sum(states.q[b, h * self.d_rel + r, q] * bank[r, column] for r in range(self.d_rel))
        bias = torch.where((distance >= 0) & (distance < self.extent), bias, torch.zeros_like(bias))
        scale = _log_temperature(states.q_index[q], self.log_scaling_alpha, self.log_scaling_n_floor)
        return bias if scale is None else bias * scale.to(bias.dtype)

    def bias_at(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The bias at zero input (``r = 0`` without a bias in ``W_r``), for plots only."""
        base = self.to_weights.bias
        if base is None:
            shape = torch.broadcast_shapes(head.shape, q_pos.shape, k_pos.shape)
            return torch.zeros(shape, dtype=self._state_dtype(), device=self.bank.device)
        curves = base.to(self._state_dtype()).view(self.num_heads, self.d_rel) @ self.bank.to(
            self._state_dtype()
        )
        distance = q_pos - k_pos
        value = curves[head, distance.clamp(0, self.extent - 1)]
        return torch.where((distance >= 0) & (distance < self.extent), value, torch.zeros_like(value))
