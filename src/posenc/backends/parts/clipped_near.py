"""The near band of the ``clipped`` split (:mod:`posenc.backends.clipped`): explicit logits on blocks of
``b`` queries against the ``2b`` (causal) or ``3b`` keys around them, forward and backward, in pieces
whose temporaries stay under the plan's ``piece_bytes``.

The position terms of a piece are projected per piece and read either through skewed strided views of
the tables (where the declared index is affine on the band) or gathered by the index; see
:class:`NearBand`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .exact import piece_ranges
from .flash import flash_forward

__all__ = ["NearBand", "Plan"]


@dataclass(frozen=True)
class Plan:
    """One call's split: logit scale, near block ``b``, causal or not, the declared index and its table
    rows, and ``back``: the key blocks before each query block (and after it without the causal mask),
    so the near band reaches ``back · b`` positions."""

    scale: float
    block: int
    causal: bool
    index: Callable[[Tensor], Tensor]
    rows: int  # R, the tables' rows
    #: 1 or −1 when ``index(d) = index(0) + slope · d`` at every near distance (the near band then reads
    #: the tables through skewed strided views); None: it gathers by the index.
    slope: int | None
    #: Bytes of the near band's largest temporaries in one piece
    #: (:data:`~posenc.backends.clipped.NEAR_PIECE_BYTES`, read per call).
    piece_bytes: int
    #: Key blocks before each query block: a block of ``b`` rows reads ``back · b + b`` keys for the
    #: ``back · b + 1`` its rows need (causal), so more, smaller blocks waste fewer.
    back: int = 1

    @property
    def chunks(self) -> int:
        """Key blocks around each query block: the ``back`` before, its own (and ``back`` after)."""
        return self.back + 1 if self.causal else 2 * self.back + 1

    @property
    def reach(self) -> int:
        """The near band's largest distance, ``back · b``."""
        return self.back * self.block

    @property
    def width(self) -> int:
        """Keys ``W`` around each query block."""
        return self.chunks * self.block

    @property
    def skip(self) -> int:
        return self.reach + 1

    def far_row(self, flip: bool) -> int:
        """The constant row of the far part before the diagonal (after it when ``flip``)."""
        return int(self.index(torch.tensor(self.skip if flip else -self.skip)))


def _near_layout(plan: Plan, length: int, device) -> tuple[Tensor, Tensor, list[tuple[int, Tensor]]]:
    """``index [b, W]`` (table row of near key ``u`` for row ``t``), ``off_band [b, W]`` (bool: the
    pairs every block leaves out) and the edge blocks' own ``(n, invalid [b, W])``: keys before
    position 0 (the first block) or past the end, queries past the end (the last blocks). Only
    those blocks differ from ``off_band``; a mask of every block would cost two full-size ``&``."""
    b, reach = plan.block, plan.reach
    blocks = -(-length // b)
    t = torch.arange(b, device=device)[:, None]
    u = torch.arange(plan.width, device=device)[None]
    distance = u - reach - t  # key minus query
    index = plan.index(distance).to(device)
    near = (distance >= -reach) & ((distance <= 0) if plan.causal else (distance <= reach))
    # Block n reads keys n·b − reach .. n·b − reach + W − 1 and queries n·b .. n·b + b − 1.
    last_inner = min((length + reach - plan.width) // b, length // b - 1)
    edges = []
    for n in sorted({*range(min(plan.back, blocks)), *range(max(0, last_inner + 1), blocks)}):
        key, query = n * b - reach + u, n * b + t
        edges.append((n, ~(near & (key >= 0) & (key < length) & (query < length))))
    return index, ~near, edges


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


class NearBand:
    """The near band of one call, computed in pieces of a few query blocks over a few heads (every
    temporary at most about ``plan.piece_bytes``: larger ones come back from the allocator on
    fresh pages each call). Operands are flattened to ``G = B·H`` rows and zero padded to whole
    blocks: queries ``[G, n·b, D]``, keys and values ``[G, (n + chunks − 1)·b, D]`` with ``back``
    blocks of zeros in front, so block ``n``'s keys are rows ``n·b ..`` of the padded keys.

    The position terms of a piece are per-row tables: row terms ``scale · q_i · key_rows[r]`` for
    its queries ``[g, P·b, R]`` and key terms ``k_j · query_rows[r]`` for its keys ``[g, (P +
    chunks − 1)·b, R]``. With an affine index (:func:`~posenc.backends.clipped._slope_over_band`) the tables are oriented
    (rows flipped where needed) so that the row term of pair ``(t, u)`` sits at column
    ``c_row + d`` and the key term at ``c_key − d``: both are then strided views of the table
    (a relative shift; off the band the views read other finite entries, which the mask
    replaces), and their adjoints add into the same views one key block at a time (within a key
    block the views do not overlap: ``b < R``). Otherwise they gather by the index. The pair ``(t,
    u)`` of a block is at distance ``d = u − reach − t`` (``reach = back · b``).
    """

    def __init__(self, plan: Plan, q: Tensor, k: Tensor, v: Tensor, key_rows, query_rows, value_rows):
        batch, heads, length, dim = q.shape
        b = plan.block
        self.plan, self.batch, self.heads, self.length = plan, batch, heads, length
        self.groups = batch * heads
        self.blocks = -(-length // b)
        self.key_len = (self.blocks + plan.chunks - 1) * b

        def keys(x: Tensor) -> Tensor:
            front = plan.reach
            return _padded_rows(x.reshape(self.groups, length, dim), front, self.key_len - front - length)

        self.q = _padded_rows(q.reshape(self.groups, length, dim), 0, self.blocks * b - length)
        self.k, self.v = keys(k), keys(v)
        self.index, self.off_band, self.edges = _near_layout(plan, length, q.device)
        # 0 on the band, finfo.min off it: added to logits below 1e31 in size it gives finfo.min,
        # as masked_fill would, at half the cost.
        self.floor = torch.zeros(self.off_band.shape, dtype=q.dtype, device=q.device).masked_fill_(
            self.off_band, torch.finfo(q.dtype).min
        )
        zero_row = int(plan.index(torch.tensor(0)))
        # Row-type tables (key rows, value rows) read column c_row + d, key-type ones c_key − d.
        self.flip_row = plan.slope == -1
        self.flip_key = plan.slope == 1
        self.c_row = plan.rows - 1 - zero_row if self.flip_row else zero_row
        self.c_key = plan.rows - 1 - zero_row if self.flip_key else zero_row
        # The strided path keeps only the oriented rows its band reads (d = −reach .. 0 under the
        # causal mask: half of DeBERTa's table, whose product with every query is a quarter of the work).
        self.rows = plan.rows
        self.row_window = self.key_window = slice(0, plan.rows)
        if plan.slope is not None:
            reach = plan.reach
            after = 0 if plan.causal else reach
            self.row_window = slice(self.c_row - reach, self.c_row + after + 1)
            self.key_window = slice(self.c_key - after, self.c_key + reach + 1)
            self.c_row, self.c_key, self.rows = reach, after, reach + after + 1
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
        ``plan.piece_bytes`` (one block of one head at least)."""
        plan = self.plan
        per_block = plan.block * max(plan.width, self.rows) * itemsize
        # Whole heads first: a piece projects the key rows of its blocks and of the chunks − 1
        # blocks before them, so runs of blocks project fewer of them twice.
        if per_block * self.blocks <= plan.piece_bytes:
            group_ranges = piece_ranges(self.groups, per_block * self.blocks, plan.piece_bytes)
            block_ranges = [(0, self.blocks)]
        else:
            group_ranges = piece_ranges(self.groups, per_block * self.blocks, 0)  # one head each
            block_ranges = piece_ranges(self.blocks, per_block, plan.piece_bytes)
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
        offset = self.c_row - self.plan.reach + (0 if chunk is None else chunk * b)
        size = (groups, length // b, b, self.plan.width if chunk is None else b)
        return table.as_strided(size, (length * rows, b * rows, rows - 1, 1), table.storage_offset() + offset)

    def _key_view(self, table: Tensor, chunk: int | None = None) -> Tensor:
        """Pair ``(t, u)`` of key-type ``table [g, (P + chunks − 1)·b, R]`` (contiguous) at column
        ``c_key − d``: ``[g, P, b, W]`` (or one key block)."""
        b, rows, chunks = self.plan.block, self.rows, self.plan.chunks
        groups, length, _ = table.shape
        offset = self.c_key + self.plan.reach + (0 if chunk is None else chunk * b * (rows - 1))
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
    def bias(self, groups: slice, blocks: slice, logits: Tensor | None = None, masked: bool = True) -> Tensor:
        """The piece's position terms added to ``logits [g, P, b, W]`` (zeros when None), ``finfo.min``
        off the band (unless not ``masked``: there the entries are finite but meaningless)."""
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
        if not masked:
            return logits
        return self.mask_edges(logits.add_(self.floor), blocks, torch.finfo(logits.dtype).min)

    def mask_edges(self, x: Tensor, blocks: slice, fill: float) -> Tensor:
        """``x [g, P, b, W]`` set to ``fill`` where the piece's edge blocks have no pair (keys before
        the first or past the last position, queries past the end)."""
        for n, invalid in self.edges:
            if blocks.start <= n < blocks.stop:
                x[:, n - blocks.start].masked_fill_(invalid, fill)
        return x

    @staticmethod
    def _table(rows: Tensor, groups: slice) -> Tensor:
        """Oriented rows ``[g|1, D, R]`` for a piece."""
        return (rows if rows.shape[0] == 1 else rows[groups]).transpose(-1, -2)

    def logits(
        self, groups: slice, blocks: slice, k_band: Tensor | None = None, masked: bool = True
    ) -> Tensor:
        """The piece's logits ``[g, P, b, W]``, masked as in :meth:`bias` (``k_band``: :meth:`band` of
        the keys, when at hand)."""
        b = self.plan.block
        q_blocks = self.query_rows_of(self.q, groups, blocks).unflatten(1, (-1, b))
        k_band = self.band(self.k, groups, blocks) if k_band is None else k_band
        content = (q_blocks @ k_band.transpose(-1, -2)).mul_(self.plan.scale)
        return self.bias(groups, blocks, content, masked)

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
        # The kernel reads its operands through their strides: the blocks of a piece are its "heads",
        # the overlapping key bands views (merging groups and blocks into one dimension would copy them).
        q_blocks = self.query_rows_of(self.q, groups, blocks).unflatten(1, (-1, b))
        return flash_forward(
            q_blocks,
            self.band(self.k, groups, blocks),
            self.band(self.v, groups, blocks),
            0.0,
            False,
            attn_mask=bias.to(self.q.dtype),
            scale=self.plan.scale,
        )

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
            # Unmasked, then zeroed off the band: exp of finfo.min takes PyTorch's slow path (about
            # 20x the time of exp on in-range values, measured on [8, 254, 508]).
            logits = self.logits(groups, blocks, k_band, masked=False)
            probs = logits.sub_(self.query_rows_of(lse, groups, blocks).unflatten(1, (-1, b))).exp_()
            self.mask_edges(probs.masked_fill_(self.off_band, 0), blocks, 0.0)
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
            x[:, start : start + self.length].view(shape)
            for x, start in ((d_q, 0), (d_k, plan.reach), (d_v, plan.reach))
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
