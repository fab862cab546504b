"""``clipped`` backend: CONTENT encodings with clipped relative tables (Shaw, DeBERTa) at kernel speed.

An encoding that declares :class:`~posenc.encodings.base.ClippedRelative` adds, for the pair at distance
``d = j − i`` with row ``r = index(d)``, ``scale · (q_i · key_rows[r] + k_j · query_rows[r])`` to the
logit and ``value_rows[r]`` to the value. Beyond its far distances ``r`` is constant on each side, so
there the key term (Shaw's ``a^K``, DeBERTa's c2p) is a **row constant** ``scale · q_i · key_rows[r]``,
the query term (DeBERTa's p2c) a **key constant** ``scale · k_j · query_rows[r]``, and the value term
a constant vector. So, for square self-attention at consecutive positions (plain causal mask or
none), with a near band of reach ``n`` (``n + 1`` at least the far distance) cut into blocks of
``b`` query rows with ``back`` key blocks before each (``n = back · b``, :func:`_blocks_for`):

* **far before** (``j <= i − n − 1``) and, without a causal mask, **far after** (reversed copies):
  :func:`~posenc.backends.parts.exact.far_forward`; the row constant shifts the part's log-sum-exp, a key
  constant ``k_j · query_rows[r]`` joins the queries (``(q_i + query_rows[r]) · k_j``);
* **near** (``|j − i| <= n``): explicit logits on blocks of ``b`` queries against the ``n + b``
  (causal) or ``2n + b`` keys around them (never ``L × L``), in pieces of a few blocks and heads whose
  temporaries stay under :data:`NEAR_PIECE_BYTES`, with the position terms projected per piece
  (``q @ key_rowsᵀ`` for its queries, ``k @ query_rowsᵀ`` for its keys). Where the declared
  index is ``index(0) ± d`` on the whole band (Shaw when the block is ``k``, DeBERTa without
  buckets: tested on the band's distances, :func:`_slope_over_band`), the pair ``(i, j)`` reads
  those tables through a skewed strided view (a relative shift; the tables flipped so the strides
  are positive, and only the rows the band reads projected) and the backward adds into the same
  views; otherwise (DeBERTa's log buckets) they are gathered by ``r``.

The parts merge exactly through their log-sum-exp (:mod:`posenc.backends.parts.exact`); a far part's value
term is its softmax mass times the constant row. **Backward** (no ``L × L`` tensor either): the flash
backward kernel gets the merged log-sum-exp minus the part's row constant, and the merged output
minus the constant value row (the kernel uses the output only through ``D_i = dO_i · O_i``, and the
constant value row must leave it: ``dS_ij = p_ij (dO_i · (v_j + a) − D_i)``). A row constant's
gradient is ``w_i (dO_i · Ô_i − D_i + dO_i · a)``; a key constant's table row gets the sum of the
kernel's ``dq`` over the part's rows; the near blocks differentiate explicitly.

``auto`` takes it from :data:`CLIPPED_MIN_LEN` queries and :data:`CLIPPED_MIN_BLOCKS` near blocks on
(the ``relative`` backend's query blocks are as fast below); forcing it serves any length the near
blocks leave a far part in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..encodings.base import ClippedRelative, Kind
from . import AttentionRequest, register_backend
from .parts.clipped_near import NearBand, Plan
from .parts.exact import (
    far_backward,
    far_forward,
    far_keys,
    far_rows,
    merge_lse,
    part_weight,
    row_constant_grad,
    same_consecutive_positions,
)
from .parts.flash import NONFINITE_REASON, accumulation_dtype, cpu_flash_limit, kernel_layout

__all__ = ["CLIPPED_BLOCK", "CLIPPED_MIN_BLOCKS", "CLIPPED_MIN_LEN", "ClippedBackend", "clipped_attention"]

#: Query rows per near block (raised to the clipping distance when that is larger): the near work
#: per row is ``2b`` or ``3b`` keys, so small blocks keep it small.
CLIPPED_BLOCK = 16
#: At most this many key blocks before each near block (:func:`_blocks_for`): the band of ``back``
#: blocks of ``b = reach / back`` rows reads ``(back + 1) · b`` keys per row for the ``reach + 1`` it
#: needs under the causal mask (DeBERTa span 256: 340 keys in blocks of 85 rows, 508 in one block of
#: 254), with blocks of ``CLIPPED_BLOCK`` rows at least.
CLIPPED_BACK = 3
#: Below this many queries the relative backend's query blocks are about as fast.
CLIPPED_MIN_LEN = 512
#: ``auto`` takes the split from this many near blocks on (``L >= CLIPPED_MIN_BLOCKS · b``): a near
#: block of ``b`` rows reads ``2b`` or ``3b`` keys, which pays off once the far part is most of the
#: work (benchmarks/RESULTS.md, "Exact splits").
CLIPPED_MIN_BLOCKS = 8
#: The dtypes the split runs in (its near blocks are explicit; bfloat16 would lose the exactness).
CLIPPED_DTYPES = (torch.float32, torch.float64)
#: Bytes of the near band's largest temporaries in one piece (logits and position tables of a few
#: query blocks over a few heads): larger ones come from the allocator on fresh pages every call
#: (glibc returns blocks over 32 MiB to the system when freed), and a piece this small stays in cache.
NEAR_PIECE_BYTES = 4 << 20


def _block_for(terms: ClippedRelative, causal: bool) -> int:
    """The near band's reach ``n``: the far parts start at distance ``n + 1``, which must reach the far
    distance of each side they cover. The reasons and declines count in near blocks of ``n`` rows
    (one key block before each); the split itself may cut the band finer (:func:`_blocks_for`)."""
    return max(CLIPPED_BLOCK, max(terms.far_before, 1 if causal else terms.far_after) - 1)


def _limits(req: AttentionRequest) -> str | None:
    """The first limit that needs no declaration (None when there is none)."""
    if req.kind is not Kind.CONTENT:
        return "the clipped split serves CONTENT encodings"
    flash = cpu_flash_limit(req.q)
    if flash is not None:
        return flash
    if req.q.dtype not in CLIPPED_DTYPES:
        return f"the clipped split runs in float32 or float64, not {req.q.dtype}"
    mask = req.mask
    if not (mask.is_plain_causal or mask.is_trivial) or req.q_len != req.k_len:
        return f"the clipped split needs square self-attention with a plain causal mask or none ({mask.describe()})"
    if req.sinks is not None:
        return "the clipped split has no attention sinks"
    if req.q_len < 2 * CLIPPED_BLOCK + 2:  # near blocks have CLIPPED_BLOCK rows at least
        return f"below {2 * CLIPPED_BLOCK + 2} queries the near blocks leave no far part"
    return None


def _terms(req: AttentionRequest) -> ClippedRelative | None:
    """The encoding's declaration, read once per request (DeBERTa projects its table to declare it)."""
    return req.derived("clipped_relative", lambda: req.encoding.clipped_relative(req.layer, req.num_heads))


class ClippedBackend:
    name = "clipped"
    kinds = frozenset({Kind.CONTENT})
    # what reasons and declines read (posenc.backends.memo.READS): the memo's key
    reads = frozenset(
        {"tensors", "kind", "encoding", "positions", "layer", "mask", "nonfinite", "sinks", "derived"}
    )

    def reasons(self, request: AttentionRequest) -> list[str]:
        why = _limits(request)
        if why is not None:
            return [why]
        terms = _terms(request)
        if terms is None:
            return [f"{request.encoding.name} declares no clipped relative tables"]
        block = _block_for(terms, request.mask.is_plain_causal)
        if request.q_len < 2 * block + 2:
            return [f"below {2 * block + 2} queries the near blocks of {block} rows leave no far part"]
        if not same_consecutive_positions(request.q_pos, request.k_pos):
            return ["the clipped split needs queries and keys at the same consecutive positions"]
        if request.has_nonfinite:
            return [NONFINITE_REASON]
        return []

    def declines(self, request: AttentionRequest) -> list[str]:
        if _limits(request) is not None:
            return []  # its reasons say why
        if request.q_len < CLIPPED_MIN_LEN:  # before the declaration, which may project tables
            return [f"below {CLIPPED_MIN_LEN} queries the query blocks are as fast"]
        terms = _terms(request)
        if terms is None:
            return []
        block = _block_for(terms, request.mask.is_plain_causal)
        if request.q_len < CLIPPED_MIN_BLOCKS * block:
            return [
                f"{request.encoding.name}'s rows are constant only from distance {block + 1} on: below "
                f"{CLIPPED_MIN_BLOCKS * block} queries ({CLIPPED_MIN_BLOCKS} near blocks of {block} rows) the "
                "query blocks are as fast"
            ]
        return []

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        return clipped_attention(request), None


def _slope_over_band(index: Callable[[Tensor], Tensor], block: int, causal: bool) -> int | None:
    """1 or −1 when the declared ``index`` is ``index(0) + slope · d`` at every near distance ``d``
    (``−block ..  0``, or ``.. block`` without the causal mask), else None. Read from the declaration
    itself: Shaw's ``clip(d, −k, k) + k`` is ``d + k`` on its near band when the block is ``k``,
    DeBERTa's rows without buckets ``span − d``; log buckets are not affine."""
    distance = torch.arange(-block, (0 if causal else block) + 1)
    rows = index(distance).cpu().long()
    for slope in (1, -1):
        if torch.equal(rows, rows[block] + slope * distance):
            return slope
    return None


def _blocks_for(
    index: Callable[[Tensor], Tensor], reach: int, slope: int | None, causal: bool
) -> tuple[int, int]:
    """The near block ``b`` and the key blocks ``back`` before it (``back · b >= reach``, the distance
    the near band must cover): the most blocks up to :data:`CLIPPED_BACK` of at least
    :data:`CLIPPED_BLOCK` rows. A band reaching past ``reach`` reads rows that are already constant
    there, which the gathers take as they come; the strided views need the index to stay on its
    line (DeBERTa without buckets: row ``span − d`` holds to the far distance itself)."""
    for back in range(CLIPPED_BACK, 1, -1):
        block = -(-reach // back)
        if block >= CLIPPED_BLOCK and (slope is None or _on_line(index, slope, reach, back * block, causal)):
            return block, back
    return reach, 1


def _on_line(index: Callable[[Tensor], Tensor], slope: int, reach: int, beyond: int, causal: bool) -> bool:
    """Whether ``index(d) = index(0) + slope · d`` still holds for ``reach < |d| <= beyond`` (``d < 0``
    only under the causal mask)."""
    distance = -torch.arange(reach + 1, beyond + 1)
    if not causal:
        distance = torch.cat((distance, -distance))
    zero = int(index(torch.tensor(0)))
    return torch.equal(index(distance).cpu().long(), zero + slope * distance)


def _flip(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.flip(2)


def _row_constants(plan: Plan, q: Tensor, key_rows: Tensor | None, row: int) -> Tensor | None:
    """The far part's row constants ``scale · q_i · key_rows[row]`` (``[B, H, L]``, None when absent)."""
    return None if key_rows is None else (q @ key_rows[:, row, :, None])[..., 0] * plan.scale


def _far_queries(q: Tensor, query_rows: Tensor | None, row: int) -> Tensor:
    """The far part's queries with its key constants folded in: ``q_i + query_rows[row]``, since
    ``q_i · k_j + k_j · query_rows[row] = (q_i + query_rows[row]) · k_j`` (an extra head dimension
    for the key constant would cost the kernel about 1.14x and three concatenations)."""
    return q if query_rows is None else q + query_rows[:, row][:, None]


class _ClippedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: Plan, q: Tensor, k: Tensor, v: Tensor, key_rows, query_rows, value_rows):
        length, skip = q.shape[2], plan.skip
        acc = accumulation_dtype(q.dtype)
        near_out, near_lse = NearBand(plan, q, k, v, key_rows, query_rows, value_rows).forward(acc)
        lse = near_lse.clone()
        fars = []  # (flip, far row, out, lse with the row constant)
        for flip in (False,) if plan.causal else (False, True):
            row = plan.far_row(flip)
            row_const = _row_constants(plan, q, key_rows, row)
            q_far = _far_queries(far_rows(q, skip, flip), query_rows, row)
            out_far, lse_far = far_forward(
                q_far, far_keys(k, skip, flip), far_keys(v, skip, flip), plan.scale
            )
            lse_far = lse_far.to(acc)
            if row_const is not None:
                lse_far = lse_far + far_rows(row_const, skip, flip).to(acc)
            fars.append((flip, row, out_far.to(acc), lse_far))
        for flip, _, _, lse_far in fars:
            rows = slice(0, length - skip) if flip else slice(skip, None)
            merge_lse(lse[:, :, rows], lse_far.flip(2) if flip else lse_far)
        out = (part_weight(near_lse, lse)[..., None] * near_out).contiguous()
        del near_out
        for flip, row, out_far, lse_far in fars:
            weight = part_weight(lse_far, far_rows(lse, skip, flip))[..., None]
            part = weight * (out_far if value_rows is None else out_far + value_rows[:, row][:, None])
            if flip:
                out[:, :, : length - skip] += part.flip(2)
            else:
                out[:, :, skip:] += part
        ctx.plan = plan
        ctx.fars = [(flip, row) for flip, row, _, _ in fars]
        far_tensors = [t for _, _, out_far, lse_far in fars for t in (out_far, lse_far)]
        ctx.save_for_backward(q, k, v, key_rows, query_rows, value_rows, out, lse, *far_tensors)
        return out.to(q.dtype).contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        plan: Plan = ctx.plan
        q, k, v, key_rows, query_rows, value_rows, out, lse, *far_tensors = ctx.saved_tensors
        length = q.shape[2]
        acc = out.dtype
        grad = grad_out.contiguous().to(acc)
        delta = (grad * out).sum(-1)  # [B, H, L]
        q_acc, k_acc, v_acc = q.to(acc), k.to(acc), v.to(acc)
        key_rows, query_rows, value_rows = (_to(t, acc) for t in (key_rows, query_rows, value_rows))
        skip = plan.skip

        # Near blocks, explicitly, in pieces.
        near = NearBand(plan, q_acc, k_acc, v_acc, key_rows, query_rows, value_rows)
        (dq, dk, dv), (d_key_rows, d_query_rows, d_value) = near.backward(grad, lse, delta)

        # Far parts, each in its own orientation.
        for i, (flip, row) in enumerate(ctx.fars):
            far_out, far_lse = far_tensors[2 * i], far_tensors[2 * i + 1]
            value_row = None if value_rows is None else value_rows[:, row][:, None]
            row_const = _row_constants(plan, q_acc, key_rows, row)
            g, part_lse = far_rows(grad, skip, flip), far_rows(lse, skip, flip)
            merged_out = far_rows(out, skip, flip)
            if value_row is not None:
                merged_out = merged_out - value_row
            shift = 0.0 if row_const is None else far_rows(row_const, skip, flip)
            q_far = _far_queries(far_rows(q, skip, flip), _to(query_rows, q.dtype), row)
            d_q, d_k, d_v, _ = far_backward(
                g,
                merged_out,
                (part_lse - shift).to(far_lse.dtype),
                q_far,
                far_keys(k, skip, flip),
                far_keys(v, skip, flip),
                plan.scale,
            )
            del q_far
            if query_rows is not None:  # the key constants k_j · query_rows[row], folded into q
                d_query_rows[:, row] += _head_sum(d_q.to(acc), query_rows.shape[0])
            weight = part_weight(far_lse, part_lse)
            d_row = None
            if row_const is not None:
                d_row = row_constant_grad(weight, g, far_out, far_rows(delta, skip, flip), value_row)
            d_val = None if value_row is None else (weight[..., None] * g).sum(2)  # [B, H, D]
            rows, keys = slice(skip, None), slice(0, length - skip)
            if flip:
                rows, keys = slice(0, length - skip), slice(skip, None)
                d_q, d_k, d_v = d_q.flip(2), d_k.flip(2), d_v.flip(2)
                d_row = _flip(d_row)
            dq[:, :, rows] += d_q
            dk[:, :, keys] += d_k
            dv[:, :, keys] += d_v
            if d_row is not None:  # the row constants scale · q_i · key_rows[row]
                d_row = d_row[..., None] * plan.scale
                dq[:, :, rows] += d_row * key_rows[:, row][:, None]
                d_key_rows[:, row] += _head_sum(d_row * q_acc[:, :, rows], key_rows.shape[0])
            if d_val is not None:
                d_value[:, row] += d_val.sum(0) if value_rows.shape[0] > 1 else d_val.sum((0, 1))[None]
        return (
            None,
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            _to(d_key_rows, None if key_rows is None else ctx.saved_tensors[3].dtype),
            _to(d_query_rows, None if query_rows is None else ctx.saved_tensors[4].dtype),
            _to(d_value, None if value_rows is None else ctx.saved_tensors[5].dtype),
        )


def _head_sum(x: Tensor, heads: int) -> Tensor:
    """``[B, H, L, D]`` summed over batch and positions to ``[H, D]`` (``[1, D]`` for shared tables)."""
    x = x.sum((0, 2))
    return x if heads > 1 else x.sum(0, keepdim=True)


def _to(x: Tensor | None, dtype) -> Tensor | None:
    return None if x is None else x.to(dtype)


def clipped_attention(req: AttentionRequest) -> Tensor:
    """Attention ``[B, H, L, D]`` of a CONTENT request with clipped tables, by the clipped split (a
    ValueError names what stops it: :class:`ClippedBackend`'s reasons)."""
    reasons = ClippedBackend().reasons(req)
    if reasons:
        raise ValueError(f"clipped split: {reasons[0]}")
    terms = _terms(req)
    causal = req.mask.is_plain_causal
    tables = [t for t in (terms.key_rows, terms.query_rows, terms.value_rows) if t is not None]
    reach = _block_for(terms, causal)
    slope = _slope_over_band(terms.index, reach, causal)
    block, back = _blocks_for(terms.index, reach, slope, causal)
    plan = Plan(req.scale, block, causal, terms.index, tables[0].shape[-2], slope, NEAR_PIECE_BYTES, back)
    # One copy of an operand whose last stride is not 1 (the far parts' kernel would misread it).
    q, k, v = (kernel_layout(t) for t in (req.q, *req.kv_per_query_head()))
    key_rows, query_rows, value_rows = (
        _to(t, req.q.dtype) for t in (terms.key_rows, terms.query_rows, terms.value_rows)
    )
    return _ClippedAttention.apply(plan, q, k, v, key_rows, query_rows, value_rows)


register_backend(ClippedBackend())
