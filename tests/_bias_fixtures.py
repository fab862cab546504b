"""Small BIAS encodings and an independent attention formula, shared by the backend tests.

The reference is the textbook formula written here in float64 with autograd:
``softmax(q kᵀ · scale + bias + mask) v``, masked logits set to ``finfo.min`` (as the eager
reference and HF do) and rows that see no key set to zero, so tests of the blocked and flex backends do not depend on posenc's eager code.
"""

from __future__ import annotations

import torch
from torch import nn

from posenc.encodings.base import BiasEncoding


class ClippedTableBias(BiasEncoding):
    """Learned per-head bias of the clipped distance ``clip(k - q, -D, D)`` (shift invariant)."""

    shift_invariant = True
    name = "test_clipped_table_bias"

    def __init__(self, num_heads: int = 2, max_distance: int = 7) -> None:
        super().__init__()
        self.num_heads, self.max_distance = num_heads, max_distance
        self.table = nn.Parameter(torch.randn(num_heads, 2 * max_distance + 1))

    def bias_at(self, head, q_pos, k_pos):
        index = (k_pos - q_pos).clamp(-self.max_distance, self.max_distance) + self.max_distance
        return self.table[head, index].float()

    def formula(self, q_pos, k_pos):
        """The same bias written independently: ``[B, H, Tq, Tk]`` in the table's dtype."""
        dist = (k_pos[:, None, None, :] - q_pos[:, None, :, None]).clamp(
            -self.max_distance, self.max_distance
        )
        return self.table.t()[dist + self.max_distance].squeeze(1).permute(0, 3, 1, 2)


class QueryNormalisedBias(BiasEncoding):
    """``-slope_h · log1p(|q - k|) / log(2 + q)``: depends on the query position (not shift invariant)."""

    name = "test_query_normalised_bias"

    def __init__(self, num_heads: int = 2) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.slope = nn.Parameter(torch.rand(num_heads) + 0.5)

    def bias_at(self, head, q_pos, k_pos):
        dist = (q_pos - k_pos).abs().to(self.slope.dtype)
        return -self.slope[head] * torch.log1p(dist) / torch.log(2.0 + q_pos.to(self.slope.dtype))

    def formula(self, q_pos, k_pos):
        qp = q_pos[:, None, :, None].double()
        dist = (qp - k_pos[:, None, None, :].double()).abs()
        return -self.slope.double()[None, :, None, None] * torch.log1p(dist) / torch.log(2.0 + qp)


def reference_attention(q, k, v, bias, scale, *, causal=False, offset=0, padding=None, attn_mask=None):
    """``softmax(q kᵀ·scale + bias + mask) v`` with key heads repeated for grouped-query attention."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = q @ k.transpose(-1, -2) * scale + bias.to(q.dtype)
    allowed = torch.ones(logits.shape[-2:], dtype=torch.bool)
    if causal:
        allowed = torch.arange(k.shape[2])[None, :] <= torch.arange(q.shape[2])[:, None] + offset
    allowed = allowed.expand_as(logits)
    if padding is not None:
        allowed = allowed & ~padding[:, None, None, :]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = allowed & attn_mask
    elif attn_mask is not None:
        allowed = allowed & ~torch.isneginf(attn_mask)  # -inf hides a key, as False does
        logits = logits + attn_mask.to(q.dtype).masked_fill(torch.isneginf(attn_mask), 0.0)
    logits = logits.masked_fill(~allowed, torch.finfo(q.dtype).min)
    # A query row that sees no key outputs zeros (posenc's rule for every backend).
    probs = torch.softmax(logits, dim=-1).masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
    return probs @ v
