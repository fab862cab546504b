"""DeBERTa disentangled attention, v2/v3 form (He et al. 2021, "DeBERTa: Decoding-enhanced BERT
with Disentangled Attention"; microsoft/DeBERTa ``disentangled_attention.py``; HF
``DebertaV2``'s ``DisentangledSelfAttention``).

One relative embedding table ``P`` of ``2·att_span`` rows and width ``dim`` (the model width),
optionally LayerNorm-ed, is shared by every layer; each layer projects it with its own
projections. For query position ``i`` and key position ``j`` (docs/conventions.md §5)::

    r        = i - j                                  (query minus key)
    idx(i,j) = clamp(log_bucket(r) + att_span, 0, 2·att_span - 1)
    K_r, Q_r = P W_k + b_k, P W_q + b_q               (share_att_key: the layer's own q/k projections)
    logit    = (Q_i·K_j + Q_i·K_r[idx] + K_j·Q_r[idx]) / sqrt(D·s),   s = 1 + #{c2p, p2c}

p2c uses the **same row** ``idx(i, j)`` as c2p: that is what the original code and HF compute
(the paper's text writes ``δ(j, i)``; pretrained weights expect the code's convention, docs/conventions.md §5.3).

``att_span = position_buckets`` when ``position_buckets > 0`` (log buckets), else
``max_relative_positions`` (no buckets); ``max_relative_positions < 1`` means
``max_position_embeddings``, as in HF. Buckets are evaluated in float32 in HF's order.

Computation: c2p is ``q @ K_rᵀ`` on the ``2·att_span`` rows (``[B, H, Tq, 2·span]``) gathered
by ``idx``; p2c is ``k @ Q_rᵀ`` gathered by ``idxᵀ`` and transposed; never an ``(L, L, D)``
tensor. Positions are explicit, so ``Tq ≠ Tk`` (cached decoding, cross-attention) works; HF v2
raises for ``Tq ≠ Tk`` (docs/conventions.md §5.5). Kind CONTENT: runs on the eager backend and on
the relative backend: query blocks checkpointed under autograd, or, for long square self-attention
on CPU whose rows saturate within 257 positions, the clipped split
(:meth:`DebertaDisentangled.clipped_relative`: c2p is a row constant far away, p2c a key constant).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import ClippedRelative, ContentEncoding
from .registry import Range, at_least, greater_than, register

__functional__ = ["deberta_log_bucket", "deberta_att_span", "deberta_relative_index"]


def deberta_log_bucket(relative_position: Tensor, bucket_size: int, max_position: int) -> Tensor:
    """DeBERTa-v2 log bucket of ``relative_position = query - key`` (int64, same shape).

    With ``mid = bucket_size // 2``: ``|r| <= mid`` keeps ``r``; otherwise
    ``sign(r)·(mid + ceil(ln(|r|/mid) / ln((max_position-1)/mid) · (mid-1)))``, evaluated in
    float32 in exactly this order (dividing before multiplying by ``mid - 1``), as HF does.

    Example: ``bucket_size=8, max_position=32`` maps ``5..7 → 5``, ``8..15 → 6``, ``16..31 → 7``.

    Raises:
        ValueError: if ``bucket_size < 2`` or ``max_position <= bucket_size // 2 + 1`` (the log
            scale would divide by zero or run backwards).
    """
    mid = bucket_size // 2
    if mid < 1:
        raise ValueError(f"deberta_log_bucket: bucket_size must be >= 2, got {bucket_size}")
    if max_position - 1 <= mid:
        raise ValueError(
            f"deberta_log_bucket: max_position ({max_position}) must exceed bucket_size // 2 + 1 = {mid + 1}"
        )
    relative_position = relative_position.long()
    magnitude = relative_position.abs()
    # Distances inside the linear zone get a harmless placeholder so the log below stays finite.
    safe = torch.where(magnitude <= mid, torch.full_like(magnitude, mid), magnitude).to(torch.float32)
    log_range = torch.tensor((max_position - 1) / mid, dtype=torch.float32, device=safe.device).log()
    log_bucket = torch.ceil(torch.log(safe / mid) / log_range * (mid - 1)) + mid
    far = log_bucket.long() * relative_position.sign()
    return torch.where(magnitude <= mid, relative_position, far)


def deberta_att_span(
    position_buckets: int, max_relative_positions: int, max_position_embeddings: int = 512
) -> int:
    """HF's table half-size: ``position_buckets`` if > 0, else ``max_relative_positions``
    (which itself becomes ``max_position_embeddings`` when < 1)."""
    max_relative = max_relative_positions if max_relative_positions >= 1 else max_position_embeddings
    return position_buckets if position_buckets > 0 else max_relative


def deberta_relative_index(
    q_pos: Tensor,
    k_pos: Tensor,
    position_buckets: int,
    max_relative_positions: int,
    max_position_embeddings: int = 512,
) -> Tensor:
    """Row of the relative table for every (query, key) pair: ``[B or 1, Tq, Tk]`` int64.

    ``clamp(bucket(q_pos - k_pos) + att_span, 0, 2·att_span - 1)`` where ``bucket`` is
    :func:`deberta_log_bucket` when ``position_buckets > 0`` and the identity otherwise. The same
    row serves c2p and p2c.

    Example (``position_buckets=-1, max_relative_positions=3``, L = 5):
    ``[[3,2,1,0,0],[4,3,2,1,0],[5,4,3,2,1],[5,5,4,3,2],[5,5,5,4,3]]``.
    """
    max_relative = max_relative_positions if max_relative_positions >= 1 else max_position_embeddings
    span = deberta_att_span(position_buckets, max_relative_positions, max_position_embeddings)
    relative = q_pos.long()[..., :, None] - k_pos.long()[..., None, :]
    if position_buckets > 0:
        relative = deberta_log_bucket(relative, position_buckets, max_relative)
    return (relative + span).clamp(0, 2 * span - 1)


@register("deberta")
class DebertaDisentangled(ContentEncoding):
    """DeBERTa-v2 disentangled attention: content-to-position and position-to-content terms on log buckets."""

    integer_positions_reason = "DeBERTa log-buckets whole relative distances into learned rows"

    layer_sizes = ("dim", "num_heads", "head_dim")
    option_ranges = {
        "dim": at_least(1),
        "num_heads": at_least(1),
        "head_dim": at_least(1),
        "layer_norm_eps": greater_than(0),
        "pos_dropout": Range(0, 1, high_inclusive=False),
    }
    shift_invariant = True
    shared_across_layers = True
    #: A small table (16 rows) so the contract tests' float64 gradcheck stays quick; log buckets
    #: are still exercised (distances past 4 are bucketed).
    example_options = {"position_buckets": 8, "max_relative_positions": 32}

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        position_buckets: int = 256,
        max_relative_positions: int = 512,
        pos_att_type: Literal["c2p|p2c", "c2p", "p2c"] = "c2p|p2c",
        share_att_key: bool = True,
        norm_rel_ebd: bool = True,
        layer_norm_eps: float = 1e-7,
        max_position_embeddings: int = 512,
        pos_dropout: float = 0.0,
    ) -> None:
        """
        Args:
            dim: model width (the table's width; filled in by the layer).
            num_heads: heads ``H`` (filled in by the layer).
            head_dim: per-head size ``D`` (filled in by the layer).
            position_buckets: log buckets per direction (HF ``position_buckets``); <= 0: no buckets.
            max_relative_positions: HF ``max_relative_positions``; < 1 means ``max_position_embeddings``.
            pos_att_type: which position terms: ``"c2p|p2c"`` (DeBERTa-v2/v3), ``"c2p"`` or ``"p2c"``.
            share_att_key: project the table with the layer's own q/k projections (v2/v3); False
                gives each layer ``pos_key_proj``/``pos_query_proj``.
            norm_rel_ebd: LayerNorm the table (HF ``norm_rel_ebd="layer_norm"``).
            layer_norm_eps: that LayerNorm's epsilon (HF ``layer_norm_eps`` default 1e-7).
            max_position_embeddings: used only when ``max_relative_positions < 1``.
            pos_dropout: dropout on the table during training (HF uses ``hidden_dropout_prob``).
        """
        super().__init__()
        if max_relative_positions < 1 and max_position_embeddings < 1:
            raise ValueError(
                f"deberta: max_position_embeddings must be positive when max_relative_positions < 1, "
                f"got {max_position_embeddings}"
            )
        self.dim, self.num_heads, self.head_dim = dim, num_heads, head_dim
        self.position_buckets = position_buckets
        self.max_relative_positions = (
            max_relative_positions if max_relative_positions >= 1 else max_position_embeddings
        )
        if position_buckets > 0:
            deberta_log_bucket(
                torch.zeros(1, dtype=torch.long), position_buckets, self.max_relative_positions
            )
        self.att_span = deberta_att_span(position_buckets, max_relative_positions, max_position_embeddings)
        self.terms = tuple(pos_att_type.split("|"))
        self.share_att_key, self.pos_dropout = share_att_key, pos_dropout
        self.rel_embeddings = nn.Embedding(2 * self.att_span, dim)
        self.layer_norm = nn.LayerNorm(dim, eps=layer_norm_eps) if norm_rel_ebd else None
        nn.init.normal_(self.rel_embeddings.weight, std=0.02)  # HF initializer_range

    # ------------------------------------------------------------------ per-layer parameters
    def init_layer(self, layer: nn.Module) -> None:
        """With ``share_att_key=False``, give ``layer`` its own ``pos_key_proj`` (c2p) and
        ``pos_query_proj`` (p2c), ``Linear(dim, num_heads·head_dim)`` with bias, as HF does."""
        if self.share_att_key:
            return
        reference = layer.q_proj.weight
        factory = {"device": reference.device, "dtype": reference.dtype}
        width = self.num_heads * self.head_dim
        if "c2p" in self.terms:
            layer.pos_key_proj = nn.Linear(self.dim, width, bias=True, **factory)
        if "p2c" in self.terms:
            layer.pos_query_proj = nn.Linear(self.dim, width, bias=True, **factory)

    def logit_scale(self, head_dim: int) -> float:
        """``1/sqrt(head_dim · s)`` with ``s = 1 + number of position terms`` (1/sqrt(3D) for c2p|p2c)."""
        return (head_dim * (1 + len(self.terms))) ** -0.5

    # ------------------------------------------------------------------ the table
    def relative_embeddings(self) -> Tensor:
        """The (LayerNorm-ed, dropped-out) table ``[2·att_span, dim]``."""
        table = self.rel_embeddings.weight
        if self.layer_norm is not None:
            table = self.layer_norm(table)
        return F.dropout(table, self.pos_dropout, training=self.training and self.pos_dropout > 0)

    def relative_index(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Table rows ``[B or 1, Tq, Tk]`` for positions ``[B or 1, Tq]`` and ``[B or 1, Tk]``."""
        device = self.rel_embeddings.weight.device
        return deberta_relative_index(
            q_pos.to(device), k_pos.to(device), self.position_buckets, self.max_relative_positions
        )

    def _projected(self, table: Tensor, projection: nn.Module, heads: int) -> Tensor:
        """``projection(table)`` split into heads and repeated to ``heads``: ``[heads, 2·span, D]``."""
        rows = projection(table)
        rows = rows.view(rows.shape[0], -1, self.head_dim).transpose(0, 1)
        return rows.repeat_interleave(heads // rows.shape[0], dim=0) if rows.shape[0] != heads else rows

    def _projection(self, layer: nn.Module | None, term: str) -> nn.Module:
        if layer is None:
            raise ValueError("deberta: logits() needs the attention layer (layer=...) for its projections")
        shared_name, own_name = ("k_proj", "pos_key_proj") if term == "c2p" else ("q_proj", "pos_query_proj")
        name = shared_name if self.share_att_key else own_name
        if not hasattr(layer, name):
            raise ValueError(f"deberta: layer has no {name!r}; call encoding.init_layer(layer) first")
        return getattr(layer, name)

    def _row_of(self, distance: Tensor) -> Tensor:
        """Table row of key-minus-query ``distance`` (any int64 shape)."""
        zero = torch.zeros((), dtype=torch.long, device=distance.device)
        return deberta_relative_index(
            zero[None], distance.reshape(1, -1), self.position_buckets, self.max_relative_positions
        )[0, 0].view(distance.shape)

    def _saturation(self, sign: int) -> int:
        """The distance ``D >= 1`` from which the row is constant on one side (``sign·d >= D``); the
        buckets are monotone in the distance, so the first distance with the saturated row is it."""
        reach = 2 * max(self.max_relative_positions, self.att_span, 1) + 2
        distances = torch.arange(1, reach + 1) * sign
        rows = self._row_of(distances)
        changed = (rows != rows[-1]).nonzero()
        return 1 if changed.numel() == 0 else int(changed[-1]) + 2

    def clipped_relative(self, layer: nn.Module | None, heads: int) -> ClippedRelative | None:
        """The projected tables ``[H, 2·span, D]`` (c2p as key rows, p2c as query rows) and the
        bucketed index, which saturates past the maximum relative distance on each side."""
        table = self.relative_embeddings()
        key_rows = query_rows = None
        if "c2p" in self.terms:
            key_rows = self._projected(table, self._projection(layer, "c2p"), heads)
        if "p2c" in self.terms:
            query_rows = self._projected(table, self._projection(layer, "p2c"), heads)
        return ClippedRelative(
            index=self._row_of,
            far_before=self._saturation(-1),
            far_after=self._saturation(1),
            key_rows=key_rows,
            query_rows=query_rows,
        )

    # ------------------------------------------------------------------ CONTENT hooks
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
        """``(c2c + c2p + p2c) · scale``: ``[B, H, Tq, Tk]`` from ``q [B, H, Tq, D]``, ``k [B, H, Tk, D]``."""
        batch, heads, q_len, _ = q.shape
        k_len = k.shape[2]
        scores = q @ k.transpose(-1, -2)
        index = self.relative_index(q_pos, k_pos)  # [B or 1, Tq, Tk]
        table = self.relative_embeddings()
        if "c2p" in self.terms:
            pos_key = self._projected(table, self._projection(layer, "c2p"), heads).to(q.dtype)
            per_row = q @ pos_key.transpose(-1, -2)  # [B, H, Tq, 2·span]
            scores = scores + per_row.gather(-1, index[:, None].expand(batch, heads, q_len, k_len))
        if "p2c" in self.terms:
            pos_query = self._projected(table, self._projection(layer, "p2c"), heads).to(k.dtype)
            per_row = k @ pos_query.transpose(-1, -2)  # [B, H, Tk, 2·span]
            index_t = index.transpose(-1, -2)[:, None].expand(batch, heads, k_len, q_len)
            scores = scores + per_row.gather(-1, index_t).transpose(-1, -2)
        return scores * scale

    def preview(self, length: int = 8) -> str:
        positions = torch.arange(length)[None]
        index = self.relative_index(positions, positions)[0]
        lines = [
            f"Table rows clamp(bucket(i - j) + {self.att_span}, 0, {2 * self.att_span - 1}) for L = {length} "
            f"(row i = query, column j = key; terms {'|'.join(self.terms)}, "
            f"scale 1/sqrt(D*{1 + len(self.terms)})):"
        ]
        lines += ["  " + " ".join(f"{int(v):4d}" for v in row) for row in index]
        if self.position_buckets > 0:
            distances = [
                0,
                1,
                self.position_buckets // 2,
                self.position_buckets // 2 + 1,
                self.position_buckets,
                self.max_relative_positions - 1,
                self.max_relative_positions,
                4 * self.max_relative_positions,
            ]
            buckets = deberta_log_bucket(
                torch.tensor(distances), self.position_buckets, self.max_relative_positions
            )
            pairs = ", ".join(f"{d}->{int(b)}" for d, b in zip(distances, buckets))
            lines.append(f"log buckets (i - j -> bucket): {pairs}")
        return "\n".join(lines)
