"""``near_far`` backend: long square self-attention with a BIAS encoding that is simple far away.

Far from the diagonal such a bias is a per-head constant
(``far_constant_beyond``, T5) or a row term plus a key term (``separable``, ALiBi), as the
encoding's :meth:`~posenc.encodings.base.BiasEncoding.near_far` declares (:class:`~posenc.encodings.base.NearFar`).
So, for square self-attention at consecutive positions with a plain causal mask or none, split each row's keys:

* the **far** part (``j <= i − block − 1``) is one ``is_causal`` call of PyTorch's CPU flash kernel on
  shifted slices (and, without a causal mask, the mirror image for ``j >= i + block + 1`` on reversed
  copies; :func:`~posenc.backends.parts.exact.far_forward`). A far constant shifts the part's
  log-sum-exp; a separable key term (re-centred on the middle key) reaches the kernel as a mask
  broadcast over the rows, so the far GEMMs keep SDPA's head dim (where the term is trained, the
  backward carries it in one extra head dimension, whose ``dk`` column is its gradient), and the row
  term shifts the log-sum-exp;
* the **near** band (distances up to ``block``) runs as one batched masked call over all query
  blocks with one shared bias pattern: the distance table's Toeplitz rows (T5), or the key term
  re-centred on each block's first query (ALiBi; float32 keeps its precision because near keys sit
  within a block of the centre).

The parts merge exactly through their log-sum-exp and the backward hands each the merged output
and log-sum-exp (:mod:`posenc.backends.parts.exact`); a far constant's gradient is its row-constant
gradient summed over rows, into the distance table. Backward calls of the near band stay under
:data:`MAX_CALL_BYTES` of float32 logits.

``auto`` takes it where the blocked backend would run and the sequence is long enough
(:data:`NEAR_FAR_MIN_LEN`); forcing it serves any length the plan fits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..encodings.base import Kind, NearFar, SeparableBias
from . import AttentionRequest, register_backend
from .parts.exact import (
    add_runs,
    distance_table,
    far_backward,
    far_forward,
    far_keys,
    far_rows,
    merge_lse,
    pad_column,
    part_weight,
    piece_ranges,
    row_constant_grad,
    runs,
    same_consecutive_positions,
    with_key_term,
)
from .parts.flash import (
    accumulation_dtype,
    cpu_flash_limit,
    flash_backward,
    flash_forward,
    kernel_layout,
)
from .parts.query_blocks import query_block_declines, query_block_reasons
from .parts.sinks import merge_sinks, sink_grad

__all__ = ["NEAR_BLOCK", "NEAR_FAR_MIN_LEN", "NearFarBackend", "near_far_attention", "near_far_plan"]

#: Query rows per block of the near band (the near band spans ``block`` keys back, and forward
#: without a causal mask; an encoding's far constant must start within it).
NEAR_BLOCK = 128
#: Bytes of one backward call's float32 logits in the near band at most (the explicit backward's
#: temporaries have that size); a call of more blocks runs as several.
MAX_CALL_BYTES = 8 << 20
#: Below this many queries the near band is most of the work and the blocked backend is as fast.
NEAR_FAR_MIN_LEN = 1024


@dataclass
class _NearFar:
    """What the near/far forward and backward share (everything but the differentiable tensors)."""

    scale: float
    block: int  # query rows per near block; the far part starts at distance block + 1
    bidirectional: bool
    q_len: int
    d_min: int  # the distance table covers k - q in [d_min, d_min + table width)
    separable: dict  # side ("before" / "after") -> SeparableBias, when the far part is separable
    far_index: dict  # side -> index into the distance table of the far constant
    near_separable: bool = False  # the near band also carries the key term (no distance table)

    @property
    def far(self) -> int:
        return self.block + 1

    @property
    def width(self) -> int:
        """Keys per near block: ``block`` back (and ``block`` forward without a causal mask)."""
        return (3 if self.bidirectional else 2) * self.block

    @property
    def blocks(self) -> int:
        return -(-self.q_len // self.block)

    def pattern(self, device) -> Tensor:
        """Bool ``[block, width]``: row ``t`` sees near key ``u`` (key ``i0 − block + u``)."""
        t = torch.arange(self.block, device=device)[:, None]
        u = torch.arange(self.width, device=device)[None]
        reach = 2 * self.block if self.bidirectional else self.block
        return (u >= t) & (u <= t + reach)

    def near_bias(self, table: Tensor | None, dtype: torch.dtype, device=None) -> Tensor:
        """``[H, block, width]``: the distance table's Toeplitz rows, ``finfo.min`` outside the band
        (without a table, ``[1, block, width]`` zeros: the key term rides in the operands)."""
        if table is None:
            bias = torch.zeros(1, self.block, self.width, dtype=dtype, device=device)
            return bias.masked_fill(~self.pattern(device), torch.finfo(dtype).min)
        t = torch.arange(self.block, device=table.device)[:, None]
        u = torch.arange(self.width, device=table.device)[None]
        bias = table[:, u - t - self.block - self.d_min].to(dtype)
        return bias.masked_fill(~self.pattern(table.device), torch.finfo(dtype).min)

    def edge_blocks(self) -> list[int]:
        """Near blocks whose keys reach before key 0 or past the last key (their own masks)."""
        last_inner = (self.q_len + self.block - self.width) // self.block
        return [n for n in range(self.blocks) if n < 1 or n > last_inner]


@dataclass
class _NearCall:
    """One near-band kernel call: ``count`` blocks of ``rows`` queries from ``q0`` (step ``block``) in
    batch row ``b``, each against ``keys`` keys from ``k0`` (same step), with ``mask [1, H, rows, keys]``."""

    b: int
    count: int
    rows: int
    q0: int
    k0: int
    keys: int
    mask: Tensor

    def pieces(self, heads: int, step: int) -> list[_NearCall]:
        """This call as consecutive calls whose float32 logits take at most :data:`MAX_CALL_BYTES`
        (the explicit backward's temporaries have that size; blocks ``step`` queries apart)."""
        return [
            replace(self, count=n, q0=self.q0 + e0 * step, k0=self.k0 + e0 * step)
            for e0, n in piece_ranges(self.count, 4 * heads * self.rows * self.keys, MAX_CALL_BYTES)
        ]


def _near_calls(plan: _NearFar, bias: Tensor, batch: int) -> list[_NearCall]:
    """The near band as kernel calls: the inner blocks together, each edge block clipped to the keys
    and queries that exist."""
    block, length = plan.block, plan.q_len
    edges = plan.edge_blocks()
    inner = [n for n in range(plan.blocks) if n not in edges]
    calls = []
    for b in range(batch):
        if inner:
            first = inner[0] * block
            calls.append(_NearCall(b, len(inner), block, first, first - block, plan.width, bias[None]))
        for n in edges:
            q0, start = n * block, n * block - block
            lo, hi = max(0, start), min(length, start + plan.width)
            rows = min(block, length - q0)
            calls.append(
                _NearCall(b, 1, rows, q0, lo, hi - lo, bias[None, :, :rows, lo - start : hi - start])
            )
    return calls


def _far_operands(plan: _NearFar, side: str, q: Tensor, k: Tensor, v: Tensor, constant: Tensor | None):
    """The far part of ``side`` in its orientation (:func:`~posenc.backends.parts.exact.far_rows`, reversed
    after the diagonal): ``(q rows, k keys, v keys, key term or None, shift [B|1, H, rows])``.

    A far constant shifts the log-sum-exp by itself. A separable bias's key term ``col − col_c``
    (``c`` the middle key) reaches the kernel as a broadcast mask (or the extra head dimension of a
    trained term's backward); its row term and ``col_c`` shift the log-sum-exp. Precision of the one
    centre: a far logit carries the rounding of ``col_j − col_c``, about ``eps·|col_j − col_c|``. For ALiBi that error is weighted by ``exp(−m·(i − j))`` with
    ``i − j > block``, so it stays below ``eps·L / (e·block)``. A key term that is not linear in the
    position (FoX's cumulative log forget gates) has no such bound where the gates are near 1 on both
    sides of a steep drop: there the error is ``eps`` times the drop between the key and the middle.
    """
    far, flip = plan.far, side == "after"
    operands = far_rows(q, far, flip), far_keys(k, far, flip), far_keys(v, far, flip)
    if constant is not None:
        return (*operands, None, constant.view(1, -1, 1).to(accumulation_dtype(q.dtype)))
    terms = plan.separable[side]
    centre = plan.q_len // 2
    col_c = terms.col[..., centre : centre + 1]
    shift = far_rows(terms.row + col_c, far, flip).to(accumulation_dtype(q.dtype))
    return (*operands, far_keys(terms.col - col_c, far, flip), shift)


def _far_rows(plan: _NearFar, side: str) -> slice:
    return slice(plan.far, plan.q_len) if side == "before" else slice(0, plan.q_len - plan.far)


def _near_operands(plan: _NearFar, c: _NearCall, q: Tensor, k: Tensor, v: Tensor, terms: tuple | None):
    """One near call's ``(q', k', v', scale, shift [count, H, rows] or None)``: views of q, k, v, or
    with a separable key term (``terms = (row, col)``) one more head dimension, re-centred on each
    block's first query so float32 keeps its precision."""
    block = plan.block
    qn = runs(q, c.b, c.q0, block, c.count, c.rows)
    kn, vn = (runs(x, c.b, c.k0, block, c.count, c.keys) for x in (k, v))
    if not plan.near_separable:
        return qn, kn, vn, plan.scale, None
    row, col = terms
    b_col, b_row = (c.b if t.shape[0] > 1 else 0 for t in (col, row))
    centres = torch.arange(c.count, device=q.device) * block + c.q0
    centre = col[b_col][:, centres].t()[:, :, None, None]  # [count, H, 1, 1]
    relative = (runs(col[..., None], b_col, c.k0, block, c.count, c.keys) - centre).to(q.dtype)
    q_aug, k_aug, v_aug = with_key_term(qn, kn, vn, relative[..., 0], plan.scale)
    shift = runs(row[..., None], b_row, c.q0, block, c.count, c.rows)[..., 0] + centre[..., 0]
    return q_aug, k_aug, v_aug, 1.0, shift.to(accumulation_dtype(q.dtype))


class _NearFarAttention(torch.autograd.Function):
    """Near band plus far parts; inputs ``plan, q, k, v, table, sinks, far_before, far_after, row,
    col``: the distance table (or None), far constants ``[H]`` (or None), and the separable terms of
    the side before the diagonal ``[B|1, H, L]`` (or None), whose gradients it returns."""

    @staticmethod
    def forward(ctx, plan: _NearFar, q, k, v, table, sinks, far_before, far_after, row, col):
        batch, heads, length, dim = q.shape
        acc = accumulation_dtype(q.dtype)
        block = plan.block
        terms = None if row is None else (row, col)
        if terms is not None:
            plan.separable["before"] = SeparableBias("before", row, col)
        bias = plan.near_bias(table, q.dtype, q.device)
        lse_total = torch.empty(batch, heads, length, 1, dtype=acc, device=q.device)
        near = []
        for c in _near_calls(plan, bias, batch):
            qn, kn, vn, scale, shift = _near_operands(plan, c, q, k, v, terms)
            out, lse = flash_forward(qn, kn, vn, 0.0, False, attn_mask=c.mask, scale=scale)
            out, lse = out[..., :dim], lse.to(acc)
            if shift is not None:
                lse = lse + shift
            runs(lse_total, c.b, c.q0, block, c.count, c.rows)[..., 0].copy_(lse)
            near.append((c, out, lse))
        lse_total = lse_total[..., 0]
        far_parts = {}
        for side, constant in (("before", far_before), ("after", far_after)):
            if (side == "after" and not plan.bidirectional) or plan.far >= length:
                continue
            qf, kf, vf, key_term, shift = _far_operands(plan, side, q, k, v, constant)
            out, lse = far_forward(qf, kf, vf, plan.scale, key_term)
            lse = lse.to(acc) + shift
            if side == "after":
                out, lse = out.flip(2), lse.flip(-1)
            rows = _far_rows(plan, side)
            merge_lse(lse_total[:, :, rows], lse)
            far_parts[side] = (out, lse)
        merged = torch.empty(batch, heads, length, dim, dtype=acc, device=q.device)
        for c, out, lse in near:
            weight = part_weight(
                lse, runs(lse_total.unsqueeze(-1), c.b, c.q0, block, c.count, c.rows)[..., 0]
            )
            torch.mul(
                out, weight.unsqueeze(-1).to(out.dtype), out=runs(merged, c.b, c.q0, block, c.count, c.rows)
            )
        del near
        for side, (out, lse) in far_parts.items():
            rows = _far_rows(plan, side)
            merged[:, :, rows].addcmul_(out.to(acc), part_weight(lse, lse_total[:, :, rows]).unsqueeze(-1))
        out, lse = merged.to(q.dtype), lse_total
        if sinks is not None:
            out, lse = merge_sinks(out, lse, sinks)
        ctx.plan = plan
        ctx.far_parts = {side: part for side, part in far_parts.items()}
        ctx.save_for_backward(q, k, v, out, lse, table, sinks, far_before, far_after, row, col)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        plan: _NearFar = ctx.plan
        q, k, v, out, lse, table, sinks, far_before, far_after, row, col = ctx.saved_tensors
        needs = ctx.needs_input_grad  # plan, q, k, v, table, sinks, far_before, far_after, row, col
        terms = None if row is None else (row, col)
        want_terms = terms is not None and (needs[8] or needs[9])
        want_table = table is not None and needs[4]
        grads = _Backward.start(plan, q, k, v, out, grad_out.contiguous(), lse, terms, want_table, want_terms)
        grads.near(plan.near_bias(table, q.dtype, q.device))
        delta = (grads.grad_out.to(grads.acc) * out.to(grads.acc)).sum(-1)  # D_i = dO_i . O_i
        d_far = {}
        for side, constant in (("before", far_before), ("after", far_after)):
            if side not in ctx.far_parts:
                continue
            own = grads.far(side, constant, ctx.far_parts[side], delta)
            if own is not None:
                d_far[side] = own
        d_table = grads.table_grad(table, d_far) if want_table else None
        d_sinks = sink_grad(grads.grad_out, out, lse, sinks) if sinks is not None and needs[5] else None
        d_row, d_col_out = grads.term_grads(row, col, sinks, delta) if want_terms else (None, None)
        return (
            None,
            grads.dq.to(q.dtype),
            grads.dk.to(q.dtype),
            grads.dv.to(q.dtype),
            d_table,
            d_sinks,
            None,
            None,
            d_row,
            d_col_out,
        )


@dataclass
class _Backward:
    """One backward pass of :class:`_NearFarAttention`: the forward's tensors, ``grad_out``, and the
    gradients' accumulators (in the accumulation dtype ``acc``). ``d_bias`` (the near band's bias,
    summed into the distance table at the end) exists when the table is trained; ``d_col`` (the key
    term's) when the separable terms are."""

    plan: _NearFar
    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    grad_out: Tensor
    lse: Tensor  # the merged log-sum-exp [B, H, L], in acc
    terms: tuple | None
    acc: torch.dtype
    dq: Tensor
    dk: Tensor
    dv: Tensor
    d_bias: Tensor | None
    d_col: Tensor | None

    @classmethod
    def start(cls, plan, q, k, v, out, grad_out, lse, terms, want_table: bool, want_terms: bool) -> _Backward:
        batch, heads, length, _ = q.shape
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        d_bias = (
            torch.zeros(heads, plan.block, plan.width, dtype=acc, device=q.device) if want_table else None
        )
        # The key term's gradient is the column sum of dS, which the extra head dimension of k'
        # collects (q' is 1 there); the row term's is the row sum of dS: zero but for the sinks' share.
        d_col = torch.zeros(batch, heads, length, 1, dtype=acc, device=q.device) if want_terms else None
        return cls(
            plan, q, k, v, out, grad_out, lse.to(acc), terms, acc, dq, dk, torch.zeros_like(dk), d_bias, d_col
        )

    def near(self, bias: Tensor) -> None:
        """The near band's share of dq, dk, dv (and of ``d_bias``, ``d_col``), call piece by call piece."""
        plan, block = self.plan, self.plan.block
        heads = self.q.shape[1]
        for c in (p for call in _near_calls(plan, bias, self.q.shape[0]) for p in call.pieces(heads, block)):
            d_q, d_k, d_v = self._near_piece(c)
            runs(self.dq, c.b, c.q0, block, c.count, c.rows).add_(d_q)
            add_runs(self.dk, c.b, c.k0, block, c.keys, d_k.to(self.acc))
            add_runs(self.dv, c.b, c.k0, block, c.keys, d_v.to(self.acc))

    def _near_piece(self, c: _NearCall) -> tuple[Tensor, Tensor, Tensor]:
        """One near call's dq, dk, dv: the flash kernel's backward, or the explicit one that also
        collects the bias gradient; with a separable key term, over the extra head dimension."""
        plan, block, dim = self.plan, self.plan.block, self.q.shape[-1]
        g_b, o_b = (runs(x, c.b, c.q0, block, c.count, c.rows) for x in (self.grad_out, self.out))
        q_b, k_b, v_b, scale, shift = _near_operands(plan, c, self.q, self.k, self.v, self.terms)
        l_b = runs(self.lse.unsqueeze(-1), c.b, c.q0, block, c.count, c.rows)[..., 0]
        if shift is not None:
            g_b, o_b = pad_column(g_b), pad_column(o_b)
            l_b = l_b - shift
            d_q, d_k, d_v = flash_backward(
                g_b, q_b, k_b, v_b, o_b, l_b.contiguous(), 0.0, False, attn_mask=c.mask, scale=scale
            )
            if self.d_col is not None:
                add_runs(self.d_col, c.b, c.k0, block, c.keys, d_k[..., dim:].to(self.acc))
            return d_q[..., :dim] * plan.scale, d_k[..., :dim], d_v[..., :dim]
        if self.d_bias is not None:
            return _explicit_backward(g_b, q_b, k_b, v_b, o_b, l_b, c, plan, self.d_bias)
        d_q, d_k, d_v = flash_backward(
            g_b, q_b, k_b, v_b, o_b, l_b.contiguous(), 0.0, False, attn_mask=c.mask, scale=plan.scale
        )
        return d_q, d_k, d_v

    def far(self, side: str, constant: Tensor | None, part: tuple, delta: Tensor) -> Tensor | None:
        """The far part of ``side``'s share of dq, dk, dv (and ``d_col``); returns its far constant's
        gradient ``[H]`` when the distance table is trained, else None."""
        plan, acc, length = self.plan, self.acc, self.q.shape[2]
        rows = _far_rows(plan, side)
        keys = slice(0, length - plan.far) if side == "before" else slice(plan.far, length)
        qf, kf, vf, key_term, shift = _far_operands(plan, side, self.q, self.k, self.v, constant)
        flip = side == "after"
        lse_f = (far_rows(self.lse, plan.far, flip) - shift).to(acc)
        g_f, o_f = far_rows(self.grad_out, plan.far, flip), far_rows(self.out, plan.far, flip)
        d_q, d_k, d_v, d_key = far_backward(
            g_f, o_f, lse_f, qf, kf, vf, plan.scale, key_term, key_grad=self.d_col is not None
        )
        if flip:
            d_q, d_k, d_v = d_q.flip(2), d_k.flip(2), d_v.flip(2)
            d_key = None if d_key is None else d_key.flip(2)
        self.dq[:, :, rows] += d_q.to(acc)
        self.dk[:, :, keys] += d_k.to(acc)
        self.dv[:, :, keys] += d_v.to(acc)
        if self.d_col is not None and d_key is not None:
            self.d_col[:, :, keys] += d_key[..., None].to(acc)
        if constant is None or self.d_bias is None:
            return None
        part_out, part_lse = part
        weight = part_weight(part_lse, self.lse[:, :, rows])
        own_grad = self.grad_out[:, :, rows].to(acc)
        return row_constant_grad(weight, own_grad, part_out.to(acc), delta[:, :, rows]).sum(dim=(0, 2))

    def table_grad(self, table: Tensor, d_far: dict[str, Tensor]) -> Tensor:
        """The distance table's gradient: the near band's bias gradient gathered by distance, plus
        each far constant's."""
        plan, block, heads = self.plan, self.plan.block, self.q.shape[1]
        d_table = torch.zeros(table.shape, dtype=self.acc, device=self.q.device)
        t = torch.arange(block, device=self.q.device)[:, None]
        u = torch.arange(plan.width, device=self.q.device)[None]
        index = (u - t - block - plan.d_min).expand(block, -1).reshape(-1)
        d_table.index_add_(1, index, self.d_bias.reshape(heads, -1))
        for side, grad in d_far.items():
            d_table[:, plan.far_index[side]] += grad
        return d_table.to(table.dtype)

    def term_grads(
        self, row: Tensor, col: Tensor, sinks: Tensor | None, delta: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The separable terms' gradients ``(d_row, d_col)`` in their own shapes."""
        d_col = _sum_to_shape(self.d_col[..., 0], col.shape).to(col.dtype)
        d_row = torch.zeros_like(row)
        if sinks is not None:  # the sink's share of the row: sum_j dS_ij = p_sink_i * D_i
            mass = torch.exp(sinks.to(self.acc).view(1, -1, 1) - self.lse)
            d_row = _sum_to_shape(mass * delta, row.shape).to(row.dtype)
        return d_row, d_col


def _sum_to_shape(grad: Tensor, shape) -> Tensor:
    return grad.sum(0, keepdim=True) if shape[0] == 1 and grad.shape[0] != 1 else grad


def _explicit_backward(g, q, k, v, out, lse, call: _NearCall, plan: _NearFar, d_bias: Tensor):
    """FlashAttention-2's backward written out for one near call (``[n, H, rows, keys]`` logits), so
    the logit gradient can be summed into ``d_bias [H, block, width]`` for the distance table."""
    acc = d_bias.dtype
    logits = torch.matmul(q, k.transpose(-1, -2)).mul_(plan.scale).add_(call.mask).to(acc)
    probs = torch.exp(logits - lse.to(acc).unsqueeze(-1))
    d_probs = torch.matmul(g, v.transpose(-1, -2)).to(acc)
    delta = (g.to(acc) * out.to(acc)).sum(-1, keepdim=True)
    d_logits = probs * (d_probs - delta)
    start = call.k0 - (call.q0 - plan.block)  # where the call's keys sit in the band
    d_bias[:, : call.rows, start : start + call.keys] += d_logits.sum(0)
    d_logits = d_logits.to(q.dtype)
    d_q = torch.matmul(d_logits, k) * plan.scale
    d_k = torch.matmul(d_logits.transpose(-1, -2), q) * plan.scale
    d_v = torch.matmul(probs.to(q.dtype).transpose(-1, -2), g)
    return d_q, d_k, d_v


def near_far_plan(req: AttentionRequest, block: int = NEAR_BLOCK) -> tuple[_NearFar | None, str]:
    """The near/far plan of a BIAS request, or None and the reason it does not fit."""
    enc, mask = req.encoding, req.mask
    if req.kind is not Kind.BIAS:
        return None, "serves BIAS encodings only (masks without a bias: see the segment engine)"
    bidirectional = mask.is_trivial
    if not (mask.is_plain_causal or bidirectional) or req.q_len != req.k_len:
        return (
            None,
            f"near/far needs square self-attention with a plain causal mask or none (mask: {mask.describe()})",
        )
    declared = req.derived("near_far", lambda: enc.near_far() or NearFar())
    beyond = declared.far_constant_beyond
    if not enc.shift_invariant and (beyond is not None or bidirectional):
        return None, (
            f"{enc.name} is not shift invariant: a far constant needs it, and so does a near band "
            "without a causal mask (one key term per key serves one side of the diagonal)"
        )
    if beyond is not None:
        block = max(block, -(-(beyond - 1) // 32) * 32)
    if req.q_len < 2 * block + 2:
        return None, f"sequence of {req.q_len} is too short for near blocks of {block}"
    if not same_consecutive_positions(req.q_pos, req.k_pos):
        return None, "near/far needs queries and keys at the same consecutive positions"
    q_pos, k_pos = req.q_pos.long(), req.k_pos.long()
    separable = {}
    if beyond is None:
        terms = declared.separable(q_pos[:1], k_pos[:1]) if declared.separable is not None else None
        if terms is None:
            return None, f"{enc.name} declares neither far_constant_beyond nor separable terms"
        by_side = {t.side: t for t in terms}
        for side in ("before", "after") if bidirectional else ("before",):
            found = by_side.get(side) or by_side.get("all")
            if found is None:
                return None, f"{enc.name}'s separable terms do not cover the side {side!r}"
            if bidirectional and (found.row.requires_grad or found.col.requires_grad):
                return (
                    None,
                    "separable terms that require grad: the near/far engine differentiates one side only",
                )
            separable[side] = found
    d_min = -2 * block + 1
    plan = _NearFar(req.scale, block, bidirectional, req.q_len, d_min, separable, {}, not enc.shift_invariant)
    plan.far_index = {"before": -plan.far - d_min, "after": plan.far - d_min}
    return plan, ""


def near_far_attention(req: AttentionRequest, block: int = NEAR_BLOCK) -> Tensor:
    """Attention ``[B, H, L, D]`` of a BIAS request by the exact near/far split (see the module doc)."""
    plan, reason = near_far_plan(req, block)
    if plan is None:
        raise ValueError(f"split: {reason}")
    enc = req.encoding
    d_max = plan.width - 1 - plan.block
    table = None
    if not plan.near_separable:
        table = distance_table(enc, req.num_heads, plan.d_min, d_max, req.q.device)
    far_before = far_after = None
    if not plan.separable:
        far_before = table[:, plan.far_index["before"]]
        far_after = table[:, plan.far_index["after"]] if plan.bidirectional else None
    # One copy of an operand whose last stride is not 1 (the kernel would misread it), not one per call.
    q, k, v = (kernel_layout(t) for t in (req.q, *req.kv_per_query_head()))
    row = col = None
    if "before" in plan.separable and not plan.bidirectional:
        row, col = plan.separable["before"].row, plan.separable["before"].col
    out = _NearFarAttention.apply(plan, q, k, v, table, req.sinks, far_before, far_after, row, col)
    return req.mask.zero_empty_rows(out)


class NearFarBackend:
    name = "near_far"
    kinds = frozenset({Kind.BIAS})
    # what reasons and declines read (posenc.backends.memo.READS): the memo's key
    reads = frozenset({"tensors", "kind", "encoding", "positions", "mask", "nonfinite", "scale", "derived"})

    def reasons(self, request: AttentionRequest) -> list[str]:
        if request.kind is not Kind.BIAS:
            return [f"serves BIAS encodings only; {request.encoding.name} is {request.kind.value}"]
        flash = cpu_flash_limit(request.q)
        if flash is not None:
            return [flash]
        plan, why = near_far_plan(request)
        return ([] if plan is not None else [why]) + query_block_reasons(request)

    def declines(self, request: AttentionRequest) -> list[str]:
        if request.q_len < NEAR_FAR_MIN_LEN:
            return [
                f"below {NEAR_FAR_MIN_LEN} queries the near band is most of the work: the blocked backend is as fast"
            ]
        return query_block_declines(request) if request.kind is Kind.BIAS else []

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        return near_far_attention(request), None


register_backend(NearFarBackend())
