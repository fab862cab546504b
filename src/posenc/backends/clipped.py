"""``clipped`` backend: CONTENT encodings with clipped relative tables (Shaw, DeBERTa) at kernel speed.

An encoding that declares :class:`~posenc.base.ClippedRelative` adds, for the pair at distance
``d = j − i`` with row ``r = index(d)``, ``scale · (q_i · key_rows[r] + k_j · query_rows[r])`` to the
logit and ``value_rows[r]`` to the value. Beyond its far distances ``r`` is constant on each side, so
there the key term (Shaw's ``a^K``, DeBERTa's c2p) is a **row constant** ``scale · q_i · key_rows[r]``,
the query term (DeBERTa's p2c) a **key constant** ``scale · k_j · query_rows[r]``, and the value term
a constant vector. So, for square self-attention at consecutive positions (plain causal mask or
none), with near blocks of ``b`` query rows (``b + 1`` at least the far distance):

* **far before** (``j <= i − b − 1``) and, without a causal mask, **far after** (reversed copies):
  :func:`~posenc.backends._exact.far_forward`; the row constant shifts the part's log-sum-exp, a key
  constant rides in one extra head dimension;
* **near** (``|j − i| <= b``): explicit logits on blocks of ``b`` queries against the ``2b`` (causal)
  or ``3b`` keys around them (never ``L × L``), in pieces of a few blocks and heads whose
  temporaries stay under :data:`NEAR_PIECE_BYTES`, with the position terms projected per piece
  (``q @ key_rowsᵀ`` for its queries, ``k @ query_rowsᵀ`` for its keys). Where the declared
  index is ``index(0) ± d`` on the whole band (Shaw when the block is ``k``, DeBERTa without
  buckets: tested on the band's distances, :func:`_slope_over_band`), the pair ``(i, j)`` reads
  those tables through a skewed strided view (a relative shift; the tables flipped so the strides
  are positive, and only the rows the band reads projected) and the backward adds into the same
  views; otherwise (DeBERTa's log buckets) they are gathered by ``r``.

The parts merge exactly through their log-sum-exp (:mod:`posenc.backends._exact`); a far part's value
term is its softmax mass times the constant row. **Backward** (no ``L × L`` tensor either): the flash
backward kernel gets the merged log-sum-exp minus the part's row constant, and the merged output
minus the constant value row (the kernel uses the output only through ``D_i = dO_i · O_i``, and the
constant value row must leave it: ``dS_ij = p_ij (dO_i · (v_j + a) − D_i)``). A row constant's
gradient is ``w_i (dO_i · Ô_i − D_i + dO_i · a)``; a key constant's is the extra column of the
kernel's ``dk``; the near blocks differentiate explicitly.

``auto`` takes it from :data:`CLIPPED_MIN_LEN` queries and :data:`CLIPPED_MIN_BLOCKS` near blocks on
(the ``relative`` backend's query blocks are as fast below); forcing it serves any length the near
blocks leave a far part in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..base import ClippedRelative, Kind
from . import AttentionRequest, register_backend
from ._exact import (
    far_backward,
    far_forward,
    far_keys,
    far_rows,
    merge_lse,
    part_weight,
    piece_ranges,
    row_constant_grad,
    same_consecutive_positions,
)
from ._flash import NONFINITE_REASON, accumulation_dtype, cpu_flash_available, flash_forward, kernel_layout

__all__ = ["CLIPPED_BLOCK", "CLIPPED_MIN_BLOCKS", "CLIPPED_MIN_LEN", "ClippedBackend", "clipped_attention"]

#: Query rows per near block (raised to the clipping distance when that is larger): the near work
#: per row is ``2b`` or ``3b`` keys, so small blocks keep it small.
CLIPPED_BLOCK = 16
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
    """Near rows per block: the far parts start at distance ``b + 1``, which must reach the far
    distance of each side they cover."""
    return max(CLIPPED_BLOCK, max(terms.far_before, 1 if causal else terms.far_after) - 1)


def _limits(req: AttentionRequest) -> str | None:
    """The first limit that needs no declaration (None when there is none)."""
    if req.kind is not Kind.CONTENT:
        return "the clipped split serves CONTENT encodings"
    if req.q.device.type != "cpu" or not cpu_flash_available():
        return "the clipped split runs PyTorch's CPU flash kernel (CPU only)"
    if req.q.dtype not in CLIPPED_DTYPES:
        return f"the clipped split runs in float32 or float64, not {req.q.dtype}"
    mask = req.mask
    if not (mask.is_plain_causal or mask.is_trivial) or req.q_len != req.k_len:
        return f"the clipped split needs square self-attention with a plain causal mask or none ({mask.describe()})"
    if req.sinks is not None:
        return "the clipped split has no attention sinks"
    if req.dropout_p > 0:
        return "attention dropout is not implemented in the clipped split"
    if req.q_len < 2 * CLIPPED_BLOCK + 2:  # near blocks have CLIPPED_BLOCK rows at least
        return f"below {2 * CLIPPED_BLOCK + 2} queries the near blocks leave no far part"
    return None


def _terms(req: AttentionRequest) -> ClippedRelative | None:
    """The encoding's declaration, read once per request (DeBERTa projects its table to declare it)."""
    return req.derived("clipped_relative", lambda: req.encoding.clipped_relative(req.layer, req.num_heads))


class ClippedBackend:
    name = "clipped"

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


@dataclass(frozen=True)
class _Plan:
    scale: float
    block: int
    causal: bool
    index: Callable[[Tensor], Tensor]
    rows: int  # R, the tables' rows
    #: 1 or −1 when ``index(d) = index(0) + slope · d`` at every near distance (the near band then reads
    #: the tables through skewed strided views); None: it gathers by the index.
    slope: int | None = None

    @property
    def chunks(self) -> int:
        """Key blocks around each query block: the one before, its own (and the one after)."""
        return 2 if self.causal else 3

    @property
    def width(self) -> int:
        """Keys ``W`` around each query block."""
        return self.chunks * self.block

    @property
    def skip(self) -> int:
        return self.block + 1

    def far_row(self, flip: bool) -> int:
        """The constant row of the far part before the diagonal (after it when ``flip``)."""
        return int(self.index(torch.tensor(self.skip if flip else -self.skip)))


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


def _near_layout(plan: _Plan, length: int, device) -> tuple[Tensor, Tensor]:
    """``index [b, W]`` (table row of near key ``u`` for row ``t``) and ``valid [n, b, W]`` (bool)."""
    b = plan.block
    blocks = -(-length // b)
    t = torch.arange(b, device=device)[:, None]
    u = torch.arange(plan.width, device=device)[None]
    distance = u - b - t  # key minus query
    index = plan.index(distance).to(device)
    near = (distance >= -b) & ((distance <= 0) if plan.causal else (distance <= b))
    n = torch.arange(blocks, device=device)[:, None, None]
    key = n * b - b + u
    query = n * b + t
    valid = near & (key >= 0) & (key < length) & (query < length)
    return index, valid


def _per_group(rows: Tensor | None, batch: int) -> Tensor | None:
    """Tables ``[H|1, R, D]`` for the flattened ``G = B·H`` rows: ``[G|1, R, D]``."""
    if rows is None or rows.shape[0] == 1:
        return rows
    return rows.expand(batch, *rows.shape).reshape(-1, *rows.shape[1:])


def _to_heads(grad: Tensor, batch: int, heads: int) -> Tensor:
    """A table gradient ``[G|1, R, D]`` summed to the tables' ``[H|1, R, D]``."""
    if heads == 1 or grad.shape[0] == 1:
        return grad.sum(0, keepdim=True)
    return grad.view(batch, heads, *grad.shape[1:]).sum(0)


class _Near:
    """The near band of one call, computed in pieces of a few query blocks over a few heads (every
    temporary at most about :data:`NEAR_PIECE_BYTES`: larger ones come back from the allocator on
    fresh pages each call). Operands are flattened to ``G = B·H`` rows and zero padded to whole
    blocks: queries ``[G, n·b, D]``, keys and values ``[G, (n + chunks − 1)·b, D]`` with one block
    of zeros in front, so block ``n``'s keys are rows ``n·b ..`` of the padded keys.

    The position terms of a piece are per-row tables: row terms ``scale · q_i · key_rows[r]`` for
    its queries ``[g, P·b, R]`` and key terms ``k_j · query_rows[r]`` for its keys ``[g, (P +
    chunks − 1)·b, R]``. With an affine index (:func:`_slope_over_band`) the tables are oriented
    (rows flipped where needed) so that the row term of pair ``(t, u)`` sits at column
    ``c_row + d`` and the key term at ``c_key − d``: both are then strided views of the table
    (a relative shift; off the band the views read other finite entries, which the mask
    replaces), and their adjoints add into the same views one key block at a time (within a key
    block the views do not overlap: ``b < R``). Otherwise they gather by the index.
    """

    def __init__(self, plan: _Plan, q: Tensor, k: Tensor, v: Tensor, key_rows, query_rows, value_rows):
        batch, heads, length, dim = q.shape
        b = plan.block
        self.plan, self.batch, self.heads, self.length = plan, batch, heads, length
        self.groups = batch * heads
        self.blocks = -(-length // b)
        self.key_len = (self.blocks + plan.chunks - 1) * b

        def keys(x: Tensor) -> Tensor:
            return _padded_rows(x.reshape(self.groups, length, dim), b, self.key_len - b - length)

        self.q = _padded_rows(q.reshape(self.groups, length, dim), 0, self.blocks * b - length)
        self.k, self.v = keys(k), keys(v)
        self.index, self.valid = _near_layout(plan, length, q.device)
        zero_row = int(plan.index(torch.tensor(0)))
        # Row-type tables (key rows, value rows) read column c_row + d, key-type ones c_key − d.
        self.flip_row = plan.slope == -1
        self.flip_key = plan.slope == 1
        self.c_row = plan.rows - 1 - zero_row if self.flip_row else zero_row
        self.c_key = plan.rows - 1 - zero_row if self.flip_key else zero_row
        # The strided path keeps only the oriented rows its band reads (d = −b .. 0 under the causal
        # mask: half of DeBERTa's table, whose product with every query is a quarter of the work).
        self.rows = plan.rows
        self.row_window = self.key_window = slice(0, plan.rows)
        if plan.slope is not None:
            after = 0 if plan.causal else b
            self.row_window = slice(self.c_row - b, self.c_row + after + 1)
            self.key_window = slice(self.c_key - after, self.c_key + b + 1)
            self.c_row, self.c_key, self.rows = b, after, b + after + 1
        self.declared = (key_rows, query_rows, value_rows)
        # Tables as read: oriented, windowed, the logit scale folded into the key and query rows.
        self.key_rows = self._oriented(key_rows, self.flip_row, self.row_window, plan.scale)
        self.query_rows = self._oriented(query_rows, self.flip_key, self.key_window, plan.scale)
        self.value_rows = self._oriented(value_rows, self.flip_row, self.row_window, 1.0)

    def _oriented(self, rows: Tensor | None, flip: bool, window: slice, scale: float) -> Tensor | None:
        if rows is None:
            return None
        rows = _per_group(rows, self.batch)
        rows = (rows.flip(-2) if flip else rows)[:, window]
        return rows * scale if scale != 1.0 else rows

    def unoriented(self, grad: Tensor, declared: Tensor, flip: bool, window: slice) -> Tensor:
        """A gradient of read tables ``[G|1, r, D]`` as the declared tables' ``[H|1, R, D]``."""
        full = grad.new_zeros(grad.shape[0], self.plan.rows, grad.shape[-1])
        full[:, window] = grad
        full = _to_heads(full, self.batch, declared.shape[0])
        return full.flip(-2) if flip else full

    def pieces(self, itemsize: int) -> list[tuple[slice, slice]]:
        """``(groups, blocks)`` slices whose logits and tables take at most about
        :data:`NEAR_PIECE_BYTES` (one block of one head at least)."""
        plan = self.plan
        per_block = plan.block * max(plan.width, self.rows) * itemsize
        if per_block * self.groups <= NEAR_PIECE_BYTES:
            group_ranges = [(0, self.groups)]
            block_ranges = piece_ranges(self.blocks, per_block * self.groups, NEAR_PIECE_BYTES)
        else:
            group_ranges = piece_ranges(self.groups, per_block, NEAR_PIECE_BYTES)
            block_ranges = piece_ranges(self.blocks, per_block * self.groups, 0)  # one block each
        return [(slice(g0, g0 + g), slice(n0, n0 + n)) for g0, g in group_ranges for n0, n in block_ranges]

    # ------------------------------------------------------------------ operands of a piece
    def query_rows_of(self, x: Tensor, groups: slice, blocks: slice) -> Tensor:
        """Rows of the piece's query blocks of ``x [G, n·b, *]``: ``[g, P·b, *]``."""
        b = self.plan.block
        return x[groups, blocks.start * b : blocks.stop * b]

    def key_rows_of(self, x: Tensor, groups: slice, blocks: slice) -> Tensor:
        """Rows of the piece's key blocks of padded ``x [G, key_len, *]``: ``[g, (P + chunks − 1)·b, *]``."""
        b = self.plan.block
        return x[groups, blocks.start * b : (blocks.stop + self.plan.chunks - 1) * b]

    def band(self, x: Tensor, groups: slice, blocks: slice) -> Tensor:
        """The ``W`` keys around each query block of padded ``x [G, key_len, D]``: ``[g, P, W, D]``
        (an overlapping view)."""
        b, rows = self.plan.block, self.key_rows_of(x, groups, blocks)
        size = (rows.shape[0], blocks.stop - blocks.start, self.plan.width, rows.shape[-1])
        stride = (rows.stride(0), b * rows.stride(1), rows.stride(1), rows.stride(2))
        return rows.as_strided(size, stride, rows.storage_offset())

    def fold(self, target: Tensor, groups: slice, blocks: slice, band: Tensor) -> None:
        """The adjoint of :meth:`band`: add ``band [g, P, W, D]`` into padded ``target``."""
        b, chunks = self.plan.block, self.plan.chunks
        rows = self.key_rows_of(target, groups, blocks)
        rows = rows.view(rows.shape[0], -1, b, rows.shape[-1])
        count = band.shape[1]
        for c in range(chunks):
            rows[:, c : c + count] += band[:, :, c * b : (c + 1) * b]

    # ------------------------------------------------------------------ position tables
    def _row_view(self, table: Tensor, chunk: int | None = None) -> Tensor:
        """Pair ``(t, u)`` of row-type ``table [g, P·b, R]`` (contiguous) at column ``c_row + d``:
        ``[g, P, b, W]`` (one key block ``[g, P, b, b]`` when ``chunk`` is given)."""
        b, rows = self.plan.block, self.rows
        groups, length, _ = table.shape
        offset = self.c_row - b + (0 if chunk is None else chunk * b)
        size = (groups, length // b, b, self.plan.width if chunk is None else b)
        return table.as_strided(size, (length * rows, b * rows, rows - 1, 1), table.storage_offset() + offset)

    def _key_view(self, table: Tensor, chunk: int | None = None) -> Tensor:
        """Pair ``(t, u)`` of key-type ``table [g, (P + chunks − 1)·b, R]`` (contiguous) at column
        ``c_key − d``: ``[g, P, b, W]`` (or one key block)."""
        b, rows, chunks = self.plan.block, self.rows, self.plan.chunks
        groups, length, _ = table.shape
        offset = self.c_key + b + (0 if chunk is None else chunk * b * (rows - 1))
        size = (groups, length // b - chunks + 1, b, self.plan.width if chunk is None else b)
        return table.as_strided(size, (length * rows, b * rows, 1, rows - 1), table.storage_offset() + offset)

    def read_rows(self, table: Tensor) -> Tensor:
        """Row-type ``table [g, P·b, R]`` at each pair: ``[g, P, b, W]``."""
        if self.plan.slope is not None:
            return self._row_view(table)
        groups, _, rows = table.shape
        blocked = table.view(groups, -1, self.plan.block, rows)
        return blocked.gather(-1, self.index.expand(*blocked.shape[:2], *self.index.shape))

    def read_keys(self, table: Tensor) -> Tensor:
        """Key-type ``table [g, (P + chunks − 1)·b, R]`` at each pair: ``[g, P, b, W]``."""
        if self.plan.slope is not None:
            return self._key_view(table)
        bands = self.band(
            table, slice(None), slice(0, table.shape[1] // self.plan.block - self.plan.chunks + 1)
        )
        index_t = self.index.transpose(0, 1)
        return bands.gather(-1, index_t.expand(*bands.shape[:2], *index_t.shape)).transpose(-1, -2)

    def sum_rows(self, pairs: Tensor) -> Tensor:
        """The adjoint of :meth:`read_rows`: ``pairs [g, P, b, W]`` summed into ``[g, P·b, R]``."""
        groups, count, b, _ = pairs.shape
        out = pairs.new_zeros(groups, count * b, self.rows)
        if self.plan.slope is not None:
            for c in range(self.plan.chunks):
                self._row_view(out, c).add_(pairs[..., c * b : (c + 1) * b])
            return out
        out.view(groups, count, b, -1).scatter_add_(-1, self.index.expand(pairs.shape), pairs)
        return out

    def sum_keys(self, pairs: Tensor) -> Tensor:
        """The adjoint of :meth:`read_keys`: ``pairs [g, P, b, W]`` summed into ``[g, (P + chunks −
        1)·b, R]``."""
        groups, count, b, width = pairs.shape
        chunks = self.plan.chunks
        out = pairs.new_zeros(groups, (count + chunks - 1) * b, self.rows)
        if self.plan.slope is not None:
            for c in range(chunks):
                self._key_view(out, c).add_(pairs[..., c * b : (c + 1) * b])
            return out
        per_key = pairs.new_zeros(groups, count, width, self.rows)
        index_t = self.index.transpose(0, 1)
        per_key.scatter_add_(-1, index_t.expand(groups, count, *index_t.shape), pairs.transpose(-1, -2))
        folded = out.view(groups, -1, b, self.rows)
        for c in range(chunks):
            folded[:, c : c + count] += per_key[:, :, c * b : (c + 1) * b]
        return out

    # ------------------------------------------------------------------ logits
    def bias(self, groups: slice, blocks: slice, logits: Tensor | None = None) -> Tensor:
        """The piece's position terms added to ``logits [g, P, b, W]`` (zeros when None), ``finfo.min``
        off the band."""
        count = blocks.stop - blocks.start
        terms = []
        if self.key_rows is not None:
            terms.append(
                self.read_rows(
                    self.query_rows_of(self.q, groups, blocks) @ self._table(self.key_rows, groups)
                )
            )
        if self.query_rows is not None:
            terms.append(
                self.read_keys(
                    self.key_rows_of(self.k, groups, blocks) @ self._table(self.query_rows, groups)
                )
            )
        if logits is None:
            logits = (
                terms.pop().clone(memory_format=torch.contiguous_format)
                if len(terms) == 1
                else torch.add(*terms)
            )
            terms = []
        for term in terms:
            logits.add_(term)
        valid = self.valid[blocks.start : blocks.start + count]
        return logits.masked_fill_(~valid, torch.finfo(logits.dtype).min)

    @staticmethod
    def _table(rows: Tensor, groups: slice) -> Tensor:
        """Oriented rows ``[g|1, D, R]`` for a piece."""
        return (rows if rows.shape[0] == 1 else rows[groups]).transpose(-1, -2)

    def logits(self, groups: slice, blocks: slice, k_band: Tensor | None = None) -> Tensor:
        """The piece's masked logits ``[g, P, b, W]`` (``k_band``: :meth:`band` of the keys, when at hand)."""
        b = self.plan.block
        q_blocks = self.query_rows_of(self.q, groups, blocks).unflatten(1, (-1, b))
        k_band = self.band(self.k, groups, blocks) if k_band is None else k_band
        content = (q_blocks @ k_band.transpose(-1, -2)).mul_(self.plan.scale)
        return self.bias(groups, blocks, content)

    # ------------------------------------------------------------------ forward and backward
    def forward(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The near band's own normalised output ``[B, H, L, D]`` and log-sum-exp ``[B, H, L]``."""
        b, dim = self.plan.block, self.q.shape[-1]
        out = self.q.new_zeros(self.groups, self.blocks * b, dim, dtype=dtype)
        lse = self.q.new_zeros(self.groups, self.blocks * b, dtype=dtype)
        for groups, blocks in self.pieces(self.q.element_size()):
            part_out, part_lse = (self._kernel if self.value_rows is None else self._explicit)(groups, blocks)
            self.query_rows_of(out, groups, blocks).copy_(part_out.flatten(1, 2))
            self.query_rows_of(lse, groups, blocks).copy_(part_lse.flatten(1, 2))
        shape = (self.batch, self.heads, self.length)
        return out[:, : self.length].view(*shape, dim), lse[:, : self.length].view(shape)

    def _kernel(self, groups: slice, blocks: slice) -> tuple[Tensor, Tensor]:
        """Without a value term, through the flash kernel with the position terms as its float mask:
        ``[g, P, b, D]`` and ``[g, P, b]``."""
        b = self.plan.block
        bias = self.bias(groups, blocks)
        count = bias.shape[0] * bias.shape[1]

        def stacked(x: Tensor) -> Tensor:  # [g, P, r, *] -> [g·P, 1, r, *]
            return x.reshape(count, 1, *x.shape[2:])

        q_blocks = self.query_rows_of(self.q, groups, blocks).unflatten(1, (-1, b))
        out, lse = flash_forward(
            stacked(q_blocks),
            stacked(self.band(self.k, groups, blocks)),
            stacked(self.band(self.v, groups, blocks)),
            0.0,
            False,
            attn_mask=stacked(bias).to(self.q.dtype),
            scale=self.plan.scale,
        )
        return out.view(bias.shape[:3] + out.shape[-1:]), lse.view(bias.shape[:3])

    def _explicit(self, groups: slice, blocks: slice) -> tuple[Tensor, Tensor]:
        """With a value term, explicitly: ``[g, P, b, D]`` and ``[g, P, b]``."""
        logits = self.logits(groups, blocks)
        lse = logits.logsumexp(-1)
        probs = logits.sub_(lse[..., None]).exp_()
        padding = self.blocks * self.plan.block - self.length
        if blocks.stop == self.blocks and padding:
            # Rows past the end have no key on their band (uniform probabilities): the value rows'
            # strided adjoint would add them into real rows' entries.
            probs[:, -1, self.plan.block - padding :] = 0
        out = probs @ self.band(self.v, groups, blocks)
        per_row = self.sum_rows(probs) @ self._table(self.value_rows, groups).transpose(-1, -2)
        return out.add_(per_row.view(out.shape)), lse

    def backward(self, grad: Tensor, lse: Tensor, delta: Tensor):
        """The near band's ``dq, dk, dv`` (``[B, H, L, D]``, views of padded buffers the far parts add
        into) and the gradients of the key, query and value rows (``[H|1, R, D]`` as declared, None
        when absent).
        ``grad [B, H, L, D]``, ``lse`` and ``delta = dO · O`` ``[B, H, L]``: the whole call's."""
        plan, b = self.plan, self.plan.block
        groups_all, dim = self.groups, self.q.shape[-1]

        def rows_padded(x: Tensor) -> Tensor:  # [B, H, L, *] -> [G, n·b, *]
            return _padded_rows(x.reshape(groups_all, self.length, -1), 0, self.blocks * b - self.length)

        grad, lse, delta = rows_padded(grad), rows_padded(lse[..., None]), rows_padded(delta[..., None])
        d_q = torch.zeros_like(self.q)
        d_k, d_v = torch.zeros_like(self.k), torch.zeros_like(self.v)
        d_tables = {
            name: None if rows is None else torch.zeros_like(rows)
            for name, rows in (("key", self.key_rows), ("query", self.query_rows), ("value", self.value_rows))
        }

        def add_table(name: str, groups: slice, grad_rows: Tensor) -> None:  # grad_rows [g, R, D]
            target = d_tables[name]
            if target.shape[0] == 1:
                target += grad_rows.sum(0, keepdim=True)
            else:
                target[groups] += grad_rows

        for groups, blocks in self.pieces(self.q.element_size()):
            q_rows = self.query_rows_of(self.q, groups, blocks)
            g_rows = self.query_rows_of(grad, groups, blocks)
            g_blocks = g_rows.unflatten(1, (-1, b))
            k_band = self.band(self.k, groups, blocks).contiguous()  # read twice
            logits = self.logits(groups, blocks, k_band)
            probs = logits.sub_(self.query_rows_of(lse, groups, blocks).unflatten(1, (-1, b))).exp_()
            d_probs = g_blocks @ self.band(self.v, groups, blocks).transpose(-1, -2)
            if self.value_rows is not None:
                d_probs += self.read_rows(g_rows @ self._table(self.value_rows, groups))
                add_table("value", groups, self.sum_rows(probs).transpose(-1, -2) @ g_rows)
            self.fold(d_v, groups, blocks, probs.transpose(-1, -2) @ g_blocks)
            d_logits = probs.mul_(
                d_probs.sub_(self.query_rows_of(delta, groups, blocks).unflatten(1, (-1, b)))
            )
            del d_probs
            d_q_rows = (d_logits @ k_band).flatten(1, 2).mul_(plan.scale)
            self.fold(
                d_k, groups, blocks, (d_logits.transpose(-1, -2) @ q_rows.unflatten(1, (-1, b))) * plan.scale
            )
            if self.key_rows is not None:
                d_rows = self.sum_rows(d_logits)
                d_q_rows += d_rows @ self._table(self.key_rows, groups).transpose(-1, -2)
                add_table("key", groups, d_rows.transpose(-1, -2) @ q_rows)
            if self.query_rows is not None:
                d_keys = self.sum_keys(d_logits)
                k_rows = self.key_rows_of(self.k, groups, blocks)
                self.key_rows_of(d_k, groups, blocks).add_(
                    d_keys @ self._table(self.query_rows, groups).transpose(-1, -2)
                )
                add_table("query", groups, d_keys.transpose(-1, -2) @ k_rows)
            self.query_rows_of(d_q, groups, blocks).add_(d_q_rows)
        shape = (self.batch, self.heads, self.length, dim)
        dq, dk, dv = (
            x[:, start : start + self.length].view(shape) for x, start in ((d_q, 0), (d_k, b), (d_v, b))
        )
        # The key and query rows were read scaled: their gradients take the scale once here.
        layout = (
            ("key", self.flip_row, self.row_window, plan.scale),
            ("query", self.flip_key, self.key_window, plan.scale),
            ("value", self.flip_row, self.row_window, 1.0),
        )
        d_rows = tuple(
            None
            if d_tables[name] is None
            else self.unoriented(d_tables[name] * scale, declared, flip, window)
            for (name, flip, window, scale), declared in zip(layout, self.declared)
        )
        return (dq, dk, dv), d_rows


def _padded_rows(x: Tensor, before: int, after: int) -> Tensor:
    """``x [G, L, D]`` with ``before`` zero rows in front and ``after`` behind: the margins zeroed and
    ``x`` copied once (``F.pad`` fills the whole output first: two passes over fresh pages)."""
    groups, length, dim = x.shape
    out = x.new_empty(groups, before + length + after, dim)
    out[:, :before].zero_()
    out[:, before + length :].zero_()
    out[:, before : before + length].copy_(x)
    return out


def _flip(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.flip(2)


def _far_constants(plan: _Plan, q: Tensor, k: Tensor, key_rows, query_rows, row: int):
    """The far part's row constants ``scale · q_i · key_rows[row]`` and key constants
    ``k_j · query_rows[row]`` (``[B, H, L]``, None when absent)."""

    def column(x: Tensor, rows: Tensor | None) -> Tensor | None:
        return None if rows is None else (x @ rows[:, row, :, None])[..., 0]

    row_const = column(q, key_rows)
    return (None if row_const is None else row_const * plan.scale), column(k, query_rows)


class _ClippedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, q: Tensor, k: Tensor, v: Tensor, key_rows, query_rows, value_rows):
        length, skip = q.shape[2], plan.skip
        acc = accumulation_dtype(q.dtype)
        near_out, near_lse = _Near(plan, q, k, v, key_rows, query_rows, value_rows).forward(acc)
        lse = near_lse.clone()
        fars = []  # (flip, far row, out, lse with the row constant)
        for flip in (False,) if plan.causal else (False, True):
            row = plan.far_row(flip)
            row_const, key_const = _far_constants(plan, q, k, key_rows, query_rows, row)
            key_term = None if key_const is None else far_keys(key_const, skip, flip)
            operands = far_rows(q, skip, flip), far_keys(k, skip, flip), far_keys(v, skip, flip)
            out_far, lse_far = far_forward(*operands, plan.scale, key_term)
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
        plan: _Plan = ctx.plan
        q, k, v, key_rows, query_rows, value_rows, out, lse, *far_tensors = ctx.saved_tensors
        length = q.shape[2]
        acc = out.dtype
        grad = grad_out.contiguous().to(acc)
        delta = (grad * out).sum(-1)  # [B, H, L]
        q_acc, k_acc, v_acc = q.to(acc), k.to(acc), v.to(acc)
        key_rows, query_rows, value_rows = (_to(t, acc) for t in (key_rows, query_rows, value_rows))
        skip = plan.skip

        # Near blocks, explicitly, in pieces.
        near = _Near(plan, q_acc, k_acc, v_acc, key_rows, query_rows, value_rows)
        (dq, dk, dv), (d_key_rows, d_query_rows, d_value) = near.backward(grad, lse, delta)

        # Far parts, each in its own orientation.
        for i, (flip, row) in enumerate(ctx.fars):
            far_out, far_lse = far_tensors[2 * i], far_tensors[2 * i + 1]
            value_row = None if value_rows is None else value_rows[:, row][:, None]
            row_const, key_const = _far_constants(plan, q_acc, k_acc, key_rows, query_rows, row)
            g, part_lse = far_rows(grad, skip, flip), far_rows(lse, skip, flip)
            merged_out = far_rows(out, skip, flip)
            if value_row is not None:
                merged_out = merged_out - value_row
            shift = 0.0 if row_const is None else far_rows(row_const, skip, flip)
            d_q, d_k, d_v, d_key = far_backward(
                g,
                merged_out,
                (part_lse - shift).to(far_lse.dtype),
                far_rows(q, skip, flip),
                far_keys(k, skip, flip),
                far_keys(v, skip, flip),
                plan.scale,
                None if key_const is None else far_keys(key_const, skip, flip),
            )
            weight = part_weight(far_lse, part_lse)
            d_row = None
            if row_const is not None:
                d_row = row_constant_grad(weight, g, far_out, far_rows(delta, skip, flip), value_row)
            d_val = None if value_row is None else (weight[..., None] * g).sum(2)  # [B, H, D]
            rows, keys = slice(skip, None), slice(0, length - skip)
            if flip:
                rows, keys = slice(0, length - skip), slice(skip, None)
                d_q, d_k, d_v = d_q.flip(2), d_k.flip(2), d_v.flip(2)
                d_row, d_key = _flip(d_row), _flip(d_key)
            dq[:, :, rows] += d_q
            dk[:, :, keys] += d_k
            dv[:, :, keys] += d_v
            if d_row is not None:  # the row constants scale · q_i · key_rows[row]
                d_row = d_row[..., None] * plan.scale
                dq[:, :, rows] += d_row * key_rows[:, row][:, None]
                d_key_rows[:, row] += _head_sum(d_row * q_acc[:, :, rows], key_rows.shape[0])
            if d_key is not None:  # the key constants k_j · query_rows[row]
                d_key = d_key[..., None]
                dk[:, :, keys] += d_key * query_rows[:, row][:, None]
                d_query_rows[:, row] += _head_sum(d_key * k_acc[:, :, keys], query_rows.shape[0])
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
    block = _block_for(terms, causal)
    slope = _slope_over_band(terms.index, block, causal)
    plan = _Plan(req.scale, block, causal, terms.index, tables[0].shape[-2], slope)
    # One copy of an operand whose last stride is not 1 (the far parts' kernel would misread it).
    q, k, v = (kernel_layout(t) for t in (req.q, *req.kv_per_query_head()))
    key_rows, query_rows, value_rows = (
        _to(t, req.q.dtype) for t in (terms.key_rows, terms.query_rows, terms.value_rows)
    )
    return _ClippedAttention.apply(plan, q, k, v, key_rows, query_rows, value_rows)


register_backend(ClippedBackend())
