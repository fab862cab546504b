"""Attention sinks (gpt-oss): a learned logit per head that joins every row's softmax denominator.

With sink logit ``s_h``, a row's weights are ``p_j = exp(l_j) / (sum_k exp(l_k) + exp(s_h))``: the
sink takes part of the probability mass and contributes no value. Given a kernel's output ``o`` and
log-sum-exp ``lse`` of the row without the sink, the row with the sink is exact without recomputing:

* ``lse_total = logaddexp(lse, s_h)`` and ``o_sink = o * exp(lse - lse_total)``;
* backward: a FlashAttention backward fed ``(o_sink, lse_total)`` instead of ``(o, lse)`` recomputes
  ``p_j`` with the sink in the denominator and ``D = rowsum(dO * o_sink)``, so it returns exact
  ``dq, dk, dv``; the sink's own gradient is ``-sum over rows of exp(s_h - lse_total) * D``.

A row that sees no key puts all its mass on the sink and outputs zeros, as every backend does for
such rows anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .flash import accumulation_dtype

__all__ = ["merge_sinks", "sink_grad", "softmax_with_sinks"]


def softmax_with_sinks(logits: Tensor, sinks: Tensor | None) -> Tensor:
    """Softmax of ``logits [B, H, Tq, Tk]`` over the keys and one sink logit per head ``sinks [H]``.

    Returns the weights of the keys ``[B, H, Tq, Tk]`` (the sink's weight is dropped).
    """
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    batch, heads, q_len, _ = logits.shape
    column = sinks.to(logits.dtype).view(1, heads, 1, 1).expand(batch, heads, q_len, 1)
    return torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]


def merge_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(out_sink, lse_total)`` from a kernel's ``out [B, H, Tq, D]`` and ``lse [B, H, Tq]``."""
    lse_total = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return out * torch.exp(lse - lse_total).unsqueeze(-1).to(out.dtype), lse_total


def sink_grad(grad_out: Tensor, out_sink: Tensor, lse_total: Tensor, sinks: Tensor) -> Tensor:
    """The gradient of the sink logits ``[H]`` given the output gradient and the merged row stats."""
    acc = accumulation_dtype(out_sink.dtype)
    delta = (grad_out.to(acc) * out_sink.to(acc)).sum(-1)  # [B, H, Tq]
    mass = torch.exp(sinks.to(acc).view(1, -1, 1) - lse_total.to(acc))
    return -(mass * delta).sum(dim=(0, 2)).to(sinks.dtype)
