"""Shaw relative-position representations (Shaw, Uszkoreit & Vaswani 2018, "Self-Attention with
Relative Position Representations"; tensor2tensor ``_relative_attention_inner``).

Two learned tables of ``R = 2k+1`` rows and depth ``D`` (the per-head size), one for keys and one
for values. For query position ``i`` and key position ``j`` (docs/conventions.md §3.1)::

    a^K_ij = wK[clip(j - i, -k, k) + k]        a^V_ij = wV[clip(j - i, -k, k) + k]
    e_ij   = q_i · (k_j + a^K_ij) · scale      (scale = 1/sqrt(D): t2t scales q before both terms)
    z_i    = Σ_j softmax_j(e)_ij · (v_j + a^V_ij)

Conventions: the distance is **key − query** (t2t, the paper). The tables are shared over heads
(``per_head=True`` gives each head its own) and each attention layer has its own tables.
``k=None`` is the seed-000 "blog" variant (docs/conventions.md §3.2): an unclipped table of
``2·max_len − 1`` rows indexed by ``(j − i) + max_len − 1``; positions at or past ``max_len`` are
an error. The seed indexes by ``i − j``, so its table is the row-reversal of ours.

Computation (paper §3.3, never an ``(L, L, D)`` tensor): the key term is ``q @ wKᵀ`` on the
``R`` rows (``[B, H, Tq, R]``) gathered by the relative index; the value term sums the attention
probabilities per relative index (``scatter_add`` into ``[B, H, Tq, R]``) and multiplies by ``wV``.
Positions are explicit, so cached decoding and cross-attention work. Kind CONTENT: runs on the eager
backend and on the relative backend: query blocks checkpointed under autograd, or, for long square
self-attention on CPU, the clipped split (:meth:`ShawRelative.clipped_relative`; beyond distance
``k`` both terms are constant, so far keys take PyTorch's fused kernel).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .base import ClippedRelative, ContentEncoding, LayerContext, check_table_size
from .registry import at_least, register

__functional__ = ["shaw_relative_index", "shaw_relative_logits", "shaw_relative_values"]


def shaw_relative_index(q_pos: Tensor, k_pos: Tensor, k: int | None, max_len: int | None = None) -> Tensor:
    """Table row of every (query, key) pair: ``clip(k_pos - q_pos, -k, k) + k``.

    Args:
        q_pos: integer query positions ``[B or 1, Tq]``.
        k_pos: integer key positions ``[B or 1, Tk]``.
        k: clipping distance; ``None`` means unclipped with ``max_len - 1`` as the offset.
        max_len: only for ``k=None``: the table has ``2·max_len − 1`` rows.

    Returns:
        int64 ``[B or 1, Tq, Tk]`` in ``[0, 2k]`` (or ``[0, 2·max_len − 2]`` when every position is
        below ``max_len``).

    Example: ``L = 5, k = 2`` gives ``[[2,3,4,4,4],[1,2,3,4,4],[0,1,2,3,4],[0,0,1,2,3],[0,0,0,1,2]]``.
    """
    distance = k_pos.long()[..., None, :] - q_pos.long()[..., :, None]
    if k is None:
        if max_len is None:
            raise ValueError("shaw_relative_index: max_len is required when k is None")
        return distance + (max_len - 1)
    if k < 0:
        raise ValueError(f"shaw_relative_index: k must be non-negative, got {k}")
    return distance.clamp(-k, k) + k


def shaw_relative_logits(q: Tensor, table: Tensor, index: Tensor) -> Tensor:
    """The key term ``q_i · a^K_ij`` (unscaled) ``[B, H, Tq, Tk]``.

    Args:
        q: queries ``[B, H, Tq, D]``.
        table: ``wK`` rows ``[R, D]`` (shared over heads) or ``[H, R, D]`` (per head).
        index: relative index ``[B or 1, Tq, Tk]`` from :func:`shaw_relative_index`.
    """
    per_row = q @ table.transpose(-1, -2)  # [B, H, Tq, R]
    batch, heads, q_len, _ = per_row.shape
    gather_index = index[:, None].expand(batch, heads, q_len, index.shape[-1])
    return per_row.gather(-1, gather_index)


def shaw_relative_values(probs: Tensor, table: Tensor, index: Tensor) -> Tensor:
    """The value term ``Σ_j probs_ij · a^V_ij`` ``[B, H, Tq, D]``.

    Args:
        probs: attention probabilities ``[B, H, Tq, Tk]``.
        table: ``wV`` rows ``[R, D]`` or ``[H, R, D]``.
        index: relative index ``[B or 1, Tq, Tk]``.
    """
    batch, heads, q_len, k_len = probs.shape
    per_row = probs.new_zeros(batch, heads, q_len, table.shape[-2])
    per_row = per_row.scatter_add(-1, index[:, None].expand(batch, heads, q_len, k_len), probs)
    return per_row @ table.to(probs.dtype)


@register("shaw")
class ShawRelative(ContentEncoding):
    """Shaw et al. 2018 relative position representations: learned key and value terms, clipped at k."""

    integer_positions_reason = "Shaw's tables have one learned row per clipped whole distance"

    layer_sizes = ("head_dim", "num_heads")
    option_ranges = {
        "head_dim": at_least(1),
        "num_heads": at_least(1),
        "k": at_least(1),
        "max_len": at_least(1),
    }

    @classmethod
    def layer_defaults(cls, ctx: LayerContext) -> dict[str, Any]:
        """Unclipped (``k=None``), the table covers the model's ``max_len`` (when it has one)."""
        return {} if ctx.max_len is None else {"max_len": ctx.max_len}

    shift_invariant = True
    #: Clipping well inside the contract tests' lengths, so clipped rows are exercised.
    example_options = {"k": 4}

    def __init__(
        self,
        head_dim: int,
        num_heads: int = 1,
        k: int | None = 16,
        per_head: bool = False,
        value_term: bool = True,
        max_len: int = 512,
    ) -> None:
        """
        Args:
            head_dim: per-head size ``D`` (filled in by the attention layer).
            num_heads: heads ``H`` (filled in by the layer; used when ``per_head``).
            k: clipping distance (t2t ``max_relative_position``); ``None`` = unclipped seed variant.
            per_head: one table per head instead of one shared by all heads.
            value_term: add ``a^V`` to the values (the paper); False keeps the key term only.
            max_len: only for ``k=None``: positions must be below it (table of ``2·max_len − 1`` rows).
        """
        super().__init__()
        self.head_dim, self.num_heads, self.k = head_dim, num_heads, k
        self.per_head, self.value_term, self.max_len = per_head, value_term, max_len
        self.max_positions = max_len if k is None else None
        rows = 2 * k + 1 if k is not None else 2 * max_len - 1
        shape = (num_heads, rows, head_dim) if per_head else (rows, head_dim)
        tables = 2 if value_term else 1
        check_table_size("shaw", "k" if k is not None else "max_len", k or max_len, tables * math.prod(shape))
        self.key_table = nn.Parameter(torch.empty(shape))
        self.value_table = nn.Parameter(torch.empty(shape)) if value_term else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Same scale as a projected key/value of unit-variance inputs.
        for table in (self.key_table, self.value_table):
            if table is not None:
                nn.init.normal_(table, std=self.head_dim**-0.5)

    @property
    def num_rows(self) -> int:
        """Rows ``R`` of each table: ``2k + 1`` (or ``2·max_len − 1`` when ``k`` is None)."""
        return self.key_table.shape[-2]

    def _limit_hint(self) -> str:
        return (
            f"shaw with k=None has a table for positions below max_len={self.max_len}; raise max_len or set k"
        )

    def relative_index(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Table rows ``[B or 1, Tq, Tk]`` for positions ``[B or 1, Tq]`` and ``[B or 1, Tk]``."""
        if self.k is None:
            self.check_positions(q_pos, "q_pos")
            self.check_positions(k_pos, "k_pos")
        return shaw_relative_index(
            q_pos.to(self.key_table.device), k_pos.to(self.key_table.device), self.k, self.max_len
        )

    def logits(
        self,
        q: Tensor,
        k: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        *,
        scale: float,
        layer: nn.Module | None = None,
    ) -> Tensor:
        """``(q·kᵀ + q·a^K) · scale``: ``[B, H, Tq, Tk]`` from ``q [B, H, Tq, D]``, ``k [B, H, Tk, D]``."""
        index = self.relative_index(q_pos, k_pos)
        relative = shaw_relative_logits(q, self.key_table.to(q.dtype), index)
        return (q @ k.transpose(-1, -2) + relative) * scale

    def attend(self, probs: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``probs @ v`` plus the value term ``Σ_j probs_ij · a^V_ij``: ``[B, H, Tq, D]``."""
        out = probs @ v
        if self.value_table is None:
            return out
        return out + shaw_relative_values(probs, self.value_table, self.relative_index(q_pos, k_pos))

    def clipped_relative(self, layer: nn.Module | None = None, heads: int = 1) -> ClippedRelative | None:
        """Both tables as ``[H|1, 2k+1, D]`` rows, indexed by ``clip(d, −k, k) + k`` (None for the
        unclipped ``k=None`` variant)."""
        k = self.k
        if k is None:
            return None

        def rows(table: Tensor | None) -> Tensor | None:
            return None if table is None else (table if self.per_head else table[None])

        return ClippedRelative(
            index=lambda distance: distance.clamp(-k, k) + k,
            far_before=k,
            far_after=k,
            key_rows=rows(self.key_table),
            value_rows=rows(self.value_table),
        )

    def preview(self, length: int = 8) -> str:
        positions = torch.arange(length)[None]
        index = shaw_relative_index(positions, positions, self.k, self.max_len)[0]
        offset = self.k if self.k is not None else self.max_len - 1
        lines = [
            f"Table rows clip(j - i, -{offset}, {offset}) + {offset} for L = {length} "
            f"(row i = query, column j = key; {self.num_rows} rows, "
            f"{'one table per head' if self.per_head else 'shared over heads'}"
            f"{', key and value terms' if self.value_term else ', key term only'}):"
        ]
        lines += ["  " + " ".join(f"{int(v):3d}" for v in row) for row in index]
        return "\n".join(lines)
