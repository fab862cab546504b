"""The clipped split: CONTENT encodings with clipped relative tables (Shaw, DeBERTa) at kernel speed.

An encoding that declares :class:`~posenc.base.ClippedRelative` adds, for the pair at distance
``d = j − i`` with row ``r = index(d)``, ``scale · (q_i · key_rows[r] + k_j · query_rows[r])`` to the
logit and ``value_rows[r]`` to the value. Beyond its far distances ``r`` is constant on each side, so
there the key term (Shaw's ``a^K``, DeBERTa's c2p) is a **row constant** ``scale · q_i · key_rows[r]``,
the query term (DeBERTa's p2c) a **key constant** ``scale · k_j · query_rows[r]``, and the value term
a constant vector. So, for square self-attention at consecutive positions (plain causal mask or
none), with near blocks of ``b`` query rows (``b + 1`` at least the far distance):

* **far before** (``j <= i − b − 1``): PyTorch's fused CPU flash kernel, ``is_causal`` on shifted
  slices ``q[b+1:]`` against ``k[:L−b−1]``; the row constant shifts the part's log-sum-exp, and a key
  constant rides in one extra head dimension (``q' = [q, 1]``, ``k' = [k, k_j · query_rows[r]]``,
  ``v' = [v, 0]``);
* **far after** (``j >= i + b + 1``, bidirectional only): the same on reversed copies;
* **near** (``|j − i| <= b``): explicit logits on blocks of ``b`` queries against the ``2b`` (causal)
  or ``3b`` keys around them, with the tables gathered by ``r`` (``[B, H, L/b, b, 3b]``, never
  ``L × L``).

The parts merge exactly through their log-sum-exp; a far part's value term is its softmax mass times
the constant row. **Backward** (no ``L × L`` tensor either): the flash backward kernel gets the
merged log-sum-exp minus the part's row constant, and the merged output minus the constant value row
(the kernel uses the output only through ``D_i = dO_i · O_i``, and the constant value row must leave
it: ``dS_ij = p_ij (dO_i · (v_j + a) − D_i)``). A row constant's gradient is
``w_i (dO_i · Ô_i − D_i + dO_i · a)``, with ``w_i`` the part's softmax mass and ``Ô_i`` its own
normalised output; a key constant's is the extra column of the kernel's ``dk``; the near blocks
differentiate explicitly.

The ``relative`` backend takes this split when :func:`clipped_reason` is None, and its query blocks
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..base import ClippedRelative, Kind
from . import AttentionRequest
from ._flash import NONFINITE_REASON, accumulation_dtype, cpu_flash_available, flash_backward, flash_forward
from .blocked import same_consecutive_positions

__all__ = [
    "CLIPPED_BLOCK",
    "CLIPPED_MAX_BLOCK",
    "CLIPPED_MIN_LEN",
    "clipped_attention",
    "clipped_reason",
    "clipped_terms",
]

#: Query rows per near block (raised to the clipping distance when that is larger): the near work
#: per row is ``2b`` or ``3b`` keys, so small blocks keep it small (measured with Shaw k=16 at
#: L=4096 on one thread: blocks of 16 run the forward at 1.35x plain SDPA, blocks of 64 at 1.7x).
CLIPPED_BLOCK = 16
#: Below this many queries the relative backend's query blocks are about as fast.
CLIPPED_MIN_LEN = 512
#: Above this many rows per near block the explicit near band costs more than the query blocks'
#: forward (measured at L=4096 with DeBERTa: far distance 256 runs the split's forward 1.2x and its
#: forward+backward 1.8x faster than the query blocks; far distance 512, its log buckets' default,
#: the forward 1.25x slower).
CLIPPED_MAX_BLOCK = 256
#: The dtypes the split runs in (its near blocks are explicit; bfloat16 would lose the exactness).
CLIPPED_DTYPES = (torch.float32, torch.float64)


def _block_for(terms: ClippedRelative, causal: bool) -> int:
    """Near rows per block: the far parts start at distance ``b + 1``, which must reach the far
    distance of each side they cover."""
    return max(CLIPPED_BLOCK, max(terms.far_before, 1 if causal else terms.far_after) - 1)


def clipped_terms(
    req: AttentionRequest, min_len: int | None = None
) -> tuple[ClippedRelative | None, str | None]:
    """The encoding's declared tables when the clipped split serves ``req`` (and None), or None and
    why not (one sentence). ``min_len``: the fewest queries worth the split (:data:`CLIPPED_MIN_LEN`
    when None). The declaration is read once: the relative backend hands it to
    :func:`clipped_attention` (DeBERTa projects its table to declare it)."""
    min_len = CLIPPED_MIN_LEN if min_len is None else min_len
    if req.kind is not Kind.CONTENT:
        return None, "the clipped split serves CONTENT encodings"
    if req.q.device.type != "cpu" or not cpu_flash_available():
        return None, "the clipped split runs PyTorch's CPU flash kernel (CPU only)"
    if req.q.dtype not in CLIPPED_DTYPES:
        return None, f"the clipped split runs in float32 or float64, not {req.q.dtype}"
    mask = req.mask
    if not (mask.is_plain_causal or mask.is_trivial) or req.q_len != req.k_len:
        return None, (
            f"the clipped split needs square self-attention with a plain causal mask or none ({mask.describe()})"
        )
    if req.sinks is not None:
        return None, "the clipped split has no attention sinks"
    if req.q_len < min_len:  # before the declaration, which may project the encoding's tables
        return None, f"below {min_len} queries the query blocks are as fast"
    terms = req.encoding.clipped_relative(req.layer, req.num_heads)
    if terms is None:
        return None, f"{req.encoding.name} declares no clipped relative tables"
    block = _block_for(terms, mask.is_plain_causal)
    if block > CLIPPED_MAX_BLOCK:
        return None, (
            f"{req.encoding.name}'s rows are constant only from distance {block + 1} on: near blocks of "
            f"{block} rows cost more than the query blocks (the split takes at most {CLIPPED_MAX_BLOCK})"
        )
    if req.q_len < 2 * block + 2:
        return None, f"below {2 * block + 2} queries the near blocks of {block} rows leave no far part"
    if not same_consecutive_positions(req.q_pos, req.k_pos):
        return None, "the clipped split needs queries and keys at the same consecutive positions"
    if req.has_nonfinite:
        return None, NONFINITE_REASON
    return terms, None


def clipped_reason(req: AttentionRequest, min_len: int | None = None) -> str | None:
    """None when the clipped split serves ``req``; otherwise why not (see :func:`clipped_terms`)."""
    return clipped_terms(req, min_len)[1]


@dataclass(frozen=True)
class _Plan:
    scale: float
    block: int
    causal: bool
    index: Callable[[Tensor], Tensor]
    rows: int  # R, the tables' rows

    @property
    def chunks(self) -> int:
        """Key blocks around each query block: the one before, its own (and the one after)."""
        return 2 if self.causal else 3

    @property
    def skip(self) -> int:
        return self.block + 1

    def far_row(self, flip: bool) -> int:
        """The constant row of the far part before the diagonal (after it when ``flip``)."""
        return int(self.index(torch.tensor(self.skip if flip else -self.skip)))


def _near_layout(plan: _Plan, length: int, device) -> tuple[Tensor, Tensor]:
    """``index [b, W]`` (table row of near key ``u`` for row ``t``) and ``valid [n, b, W]`` (bool)."""
    b = plan.block
    blocks = -(-length // b)
    t = torch.arange(b, device=device)[:, None]
    u = torch.arange(plan.chunks * b, device=device)[None]
    distance = u - b - t  # key minus query
    index = plan.index(distance).to(device)
    near = (distance >= -b) & ((distance <= 0) if plan.causal else (distance <= b))
    n = torch.arange(blocks, device=device)[:, None, None]
    key = n * b - b + u
    query = n * b + t
    valid = near & (key >= 0) & (key < length) & (query < length)
    return index, valid


def _query_blocks(x: Tensor, b: int) -> Tensor:
    """``[B, H, L, *]`` to ``[B, H, n, b, *]``, zero padded at the end."""
    batch, heads, length, dim = x.shape
    blocks = -(-length // b)
    return F.pad(x, (0, 0, 0, blocks * b - length)).view(batch, heads, blocks, b, dim)


def _key_bands(x: Tensor, plan: _Plan) -> Tensor:
    """``[B, H, n, W, *]``: the ``chunks`` key blocks around each query block (zeros off the ends)."""
    b = plan.block
    batch, heads, length, dim = x.shape
    blocks = -(-length // b)
    total = (blocks + plan.chunks - 1) * b
    padded = F.pad(x, (0, 0, b, total - b - length)).view(batch, heads, -1, b, dim)
    return torch.cat([padded[:, :, c : c + blocks] for c in range(plan.chunks)], dim=3)


def _fold_bands(grad: Tensor, plan: _Plan, length: int) -> Tensor:
    """The adjoint of :func:`_key_bands`: ``[B, H, n, W, *]`` summed back to ``[B, H, L, *]``."""
    b = plan.block
    batch, heads, blocks, _, dim = grad.shape
    padded = grad.new_zeros(batch, heads, blocks + plan.chunks - 1, b, dim)
    for c in range(plan.chunks):
        padded[:, :, c : c + blocks] += grad[:, :, :, c * b : (c + 1) * b]
    return padded.view(batch, heads, -1, dim)[:, :, b : b + length]


def _gather_rows(terms: Tensor, index: Tensor) -> Tensor:
    """Row terms ``[B, H, n, b, R]`` at ``index [b, W]``: ``[B, H, n, b, W]``."""
    return terms.gather(-1, index.expand(*terms.shape[:3], *index.shape))


def _gather_keys(bands: Tensor, index: Tensor) -> Tensor:
    """Key terms ``[B, H, n, W, R]`` at ``index [b, W]`` (transposed): ``[B, H, n, b, W]``."""
    index_t = index.transpose(0, 1)
    return bands.gather(-1, index_t.expand(*bands.shape[:3], *index_t.shape)).transpose(-1, -2)


def _per_row(values: Tensor, index: Tensor, rows: int) -> Tensor:
    """Sum ``values [..., b, W]`` into table rows by ``index [b, W]``: ``[..., b, rows]``."""
    out = values.new_zeros(*values.shape[:-1], rows)
    return out.scatter_add_(-1, index.expand(values.shape), values)


def _reduce_heads(grad: Tensor, heads: int) -> Tensor:
    """``[B, H, R, D]`` summed to the tables' ``[H|1, R, D]``."""
    grad = grad.sum(0)
    return grad if heads > 1 else grad.sum(0, keepdim=True)


@dataclass
class _Terms:
    """The position terms of one call, in the accumulation dtype: row terms ``scale · q @ key_rowsᵀ``
    and key terms ``k @ query_rowsᵀ`` (``[B, H, L, R]``, None when absent)."""

    row: Tensor | None
    key: Tensor | None

    @classmethod
    def of(cls, plan: _Plan, q: Tensor, k: Tensor, key_rows, query_rows) -> _Terms:
        row = None if key_rows is None else (q @ key_rows.transpose(-1, -2)) * plan.scale
        key = None if query_rows is None else k @ query_rows.transpose(-1, -2)
        return cls(row, key)


def _near_logits(plan: _Plan, q: Tensor, k: Tensor, terms: _Terms, index: Tensor, valid: Tensor):
    """Near logits ``[B, H, n, b, W]`` (``finfo.min`` off the band) and the key bands."""
    k_band = _key_bands(k, plan)
    logits = (_query_blocks(q, plan.block) @ k_band.transpose(-1, -2)) * plan.scale
    if terms.row is not None:
        logits = logits + _gather_rows(_query_blocks(terms.row, plan.block), index)
    if terms.key is not None:
        logits = logits + _gather_keys(_key_bands(terms.key, plan), index) * plan.scale
    return logits.masked_fill(~valid, torch.finfo(logits.dtype).min), k_band


def _near_kernel(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, terms: _Terms, index: Tensor, valid: Tensor):
    """Without a value term, the near blocks through the flash kernel, the position terms as its float
    mask: normalised ``out [B, H, L, D]`` and ``lse [B, H, L]``."""
    batch, heads, length, dim = q.shape
    bias = None
    if terms.row is not None:
        bias = _gather_rows(_query_blocks(terms.row, plan.block), index)
    if terms.key is not None:
        key_bias = _gather_keys(_key_bands(terms.key, plan), index) * plan.scale
        bias = key_bias if bias is None else bias + key_bias
    bias = bias.masked_fill(~valid, torch.finfo(bias.dtype).min)
    blocks = bias.shape[2]

    def stacked(x: Tensor) -> Tensor:  # [B, H, n, r, *] -> [B·n, H, r, *]
        return x.transpose(1, 2).reshape(batch * blocks, heads, *x.shape[3:])

    out, lse = flash_forward(
        stacked(_query_blocks(q, plan.block)),
        stacked(_key_bands(k, plan)),
        stacked(_key_bands(v, plan)),
        0.0,
        False,
        attn_mask=stacked(bias).to(q.dtype),
        scale=plan.scale,
    )
    out = out.reshape(batch, blocks, heads, plan.block, dim).transpose(1, 2).flatten(2, 3)[:, :, :length]
    lse = lse.reshape(batch, blocks, heads, plan.block).transpose(1, 2).flatten(2)[:, :, :length]
    return out, lse


def _augmented(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, key_const: Tensor | None):
    """With a key constant, ``[q, 1]``, ``[k, key_const]`` and ``[v, 0]`` (one extra head dim)."""
    if key_const is None:
        return q, k, v
    return (
        torch.cat([q, torch.ones_like(q[..., :1])], -1),
        torch.cat([k, key_const[..., None].to(k.dtype)], -1),
        torch.cat([v, torch.zeros_like(v[..., :1])], -1),
    )


def _far(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, key_const: Tensor | None) -> tuple[Tensor, Tensor]:
    """Rows ``b+1:`` against keys at distance ``b+1`` or more before them: ``out [.., D], lse``."""
    skip, length, dim = plan.skip, q.shape[2], q.shape[-1]
    qa, ka, va = _augmented(plan, q, k, v, key_const)
    out, lse = flash_forward(
        qa[:, :, skip:], ka[:, :, : length - skip], va[:, :, : length - skip], 0.0, True, scale=plan.scale
    )
    return out[..., :dim], lse


def _far_backward(plan: _Plan, grad, q, k, v, out, lse, delta, row_const, key_const, value_row, far):
    """One far part's ``dq, dk, dv`` (full length), and the gradients of its row constants, key
    constants and value row, in this part's orientation (see the module doc)."""
    far_out, far_lse = far
    skip, length, dim = plan.skip, q.shape[2], q.shape[-1]
    rows, keys = slice(skip, None), slice(0, length - skip)
    g = grad[:, :, rows]
    adjusted_out = out[:, :, rows] if value_row is None else out[:, :, rows] - value_row
    shift = 0.0 if row_const is None else row_const[:, :, rows]
    kernel_lse = (lse[:, :, rows] - shift).to(far_lse.dtype).contiguous()
    qa, ka, va = _augmented(plan, q, k, v, key_const)
    g_a, out_a = g, adjusted_out
    if key_const is not None:
        g_a = torch.cat([g, torch.zeros_like(g[..., :1])], -1)
        out_a = torch.cat([adjusted_out, torch.zeros_like(adjusted_out[..., :1])], -1)
    # The kernel reads the output gradient and the output with one set of strides: both contiguous.
    d_q, d_k, d_v = flash_backward(
        g_a.to(q.dtype).contiguous(),
        qa[:, :, rows],
        ka[:, :, keys],
        va[:, :, keys],
        out_a.to(q.dtype).contiguous(),
        kernel_lse,
        0.0,
        True,
        scale=plan.scale,
    )
    weight = torch.exp(far_lse - lse[:, :, rows])
    g_value = 0.0 if value_row is None else (g * value_row).sum(-1)
    d_row = None
    if row_const is not None:
        d_row = weight * ((g * far_out).sum(-1) - delta[:, :, rows] + g_value)
    d_key = None if key_const is None else d_k[..., dim]
    d_value = None if value_row is None else (weight[..., None] * g).sum(2)  # [B, H, D]
    return d_q[..., :dim], d_k[..., :dim], d_v[..., :dim], d_row, d_key, d_value


def _flip(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.flip(2)


def _column(terms: Tensor | None, row: int, flip: bool) -> Tensor | None:
    """``terms[..., row]`` ``[B, H, L]`` in the part's orientation."""
    if terms is None:
        return None
    column = terms[..., row]
    return column.flip(2) if flip else column


class _ClippedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, q: Tensor, k: Tensor, v: Tensor, key_rows, query_rows, value_rows):
        length, skip = q.shape[2], plan.skip
        acc = accumulation_dtype(q.dtype)
        index, valid = _near_layout(plan, length, q.device)
        terms = _Terms.of(plan, q, k, key_rows, query_rows)
        if value_rows is None:
            near_out, lse = _near_kernel(plan, q, k, v, terms, index, valid)
            near_out, lse = near_out.to(acc), lse.to(acc)
        else:
            logits, k_band = _near_logits(plan, q, k, terms, index, valid)
            lse = logits.logsumexp(-1).flatten(2)[:, :, :length].to(acc)
        near_lse = lse.clone()
        fars = []  # (flip, far row, out, lse with the row constant)
        for flip in (False,) if plan.causal else (False, True):
            row = plan.far_row(flip)
            orient = _flip if flip else (lambda x: x)
            out_far, lse_far = _far(plan, orient(q), orient(k), orient(v), _column(terms.key, row, flip))
            lse_far = lse_far.to(acc)
            row_const = _column(terms.row, row, flip)
            if row_const is not None:
                lse_far = lse_far + row_const[:, :, skip:].to(acc)
            fars.append((flip, row, out_far.to(acc), lse_far))
        for flip, _, _, lse_far in fars:
            rows = slice(0, length - skip) if flip else slice(skip, None)
            lse[:, :, rows] = torch.logaddexp(lse[:, :, rows], lse_far.flip(2) if flip else lse_far)
        if value_rows is None:
            out = (torch.exp(near_lse - lse)[..., None] * near_out).contiguous()
        else:
            probs = torch.exp(logits - _query_blocks(lse[..., None], plan.block).to(logits.dtype))
            out = probs @ _key_bands(v, plan) + _per_row(probs, index, plan.rows) @ value_rows[:, None]
            out = out.flatten(2, 3)[:, :, :length].to(acc)
            del logits, probs, k_band
        for flip, row, out_far, lse_far in fars:
            weight = torch.exp(lse_far - (lse.flip(2) if flip else lse)[:, :, skip:])[..., None]
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
        terms = _Terms.of(plan, q.to(acc), k.to(acc), _to(key_rows, acc), _to(query_rows, acc))
        d_row_terms = None if terms.row is None else torch.zeros_like(terms.row)
        d_key_terms = None if terms.key is None else torch.zeros_like(terms.key)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
        d_value = None if value_rows is None else torch.zeros(value_rows.shape, dtype=acc, device=q.device)
        skip = plan.skip

        # Far parts, each in its own orientation.
        for i, (flip, row) in enumerate(ctx.fars):
            orient = _flip if flip else (lambda x: x)
            value_row = None if value_rows is None else value_rows[:, row][:, None].to(acc)
            d_q, d_k, d_v, d_row, d_key, d_val = _far_backward(
                plan,
                orient(grad),
                orient(q),
                orient(k),
                orient(v),
                orient(out),
                orient(lse[..., None])[..., 0],
                orient(delta[..., None])[..., 0],
                _column(terms.row, row, flip),
                _column(terms.key, row, flip),
                value_row,
                (far_tensors[2 * i], far_tensors[2 * i + 1]),
            )
            rows, keys = slice(skip, None), slice(0, length - skip)
            if flip:
                rows, keys = slice(0, length - skip), slice(skip, None)
                d_q, d_k, d_v = d_q.flip(2), d_k.flip(2), d_v.flip(2)
                d_row, d_key = _flip(d_row), _flip(d_key)
            dq[:, :, rows] += d_q
            dk[:, :, keys] += d_k
            dv[:, :, keys] += d_v
            if d_row is not None:
                d_row_terms[:, :, rows, row] += d_row
            if d_key is not None:
                d_key_terms[:, :, keys, row] += d_key
            if d_val is not None:
                d_value[:, row] += d_val.sum(0) if value_rows.shape[0] > 1 else d_val.sum((0, 1))[None]

        # Near blocks, explicitly.
        index, valid = _near_layout(plan, length, q.device)
        q_acc, k_acc = q.to(acc), k.to(acc)
        logits, k_band = _near_logits(plan, q_acc, k_acc, terms, index, valid)
        lse_blocks = _query_blocks(lse[..., None], plan.block)
        probs = torch.exp(logits - lse_blocks)
        del logits
        g_blocks = _query_blocks(grad, plan.block)
        d_probs = g_blocks @ _key_bands(v.to(acc), plan).transpose(-1, -2)
        if value_rows is not None:
            per_row_grad = g_blocks @ value_rows.to(acc).transpose(-1, -2)[:, None]  # [B, H, n, b, R]
            d_probs = d_probs + _gather_rows(per_row_grad, index)
            weights = _per_row(probs, index, plan.rows)  # [B, H, n, b, R]
            d_value += _reduce_heads((weights.transpose(-1, -2) @ g_blocks).sum(2), value_rows.shape[0])
        dv += _fold_bands(probs.transpose(-1, -2) @ g_blocks, plan, length)
        d_logits = probs * (d_probs - _query_blocks(delta[..., None], plan.block))
        del probs, d_probs
        dq += ((d_logits @ k_band) * plan.scale).flatten(2, 3)[:, :, :length]
        q_blocks = _query_blocks(q_acc, plan.block)
        dk += _fold_bands((d_logits.transpose(-1, -2) @ q_blocks) * plan.scale, plan, length)
        if d_row_terms is not None:
            d_row_terms += _per_row(d_logits, index, plan.rows).flatten(2, 3)[:, :, :length]
        if d_key_terms is not None:
            per_key = _per_row(d_logits.transpose(-1, -2), index.transpose(0, 1), plan.rows) * plan.scale
            d_key_terms += _fold_bands(per_key, plan, length)

        # The row terms scale · q @ key_rowsᵀ and the key terms k @ query_rowsᵀ.
        d_key_rows = d_query_rows = None
        if d_row_terms is not None:
            dq += (d_row_terms @ key_rows.to(acc)) * plan.scale
            d_key_rows = _reduce_heads(
                (d_row_terms.transpose(-1, -2) @ q_acc) * plan.scale, key_rows.shape[0]
            )
        if d_key_terms is not None:
            dk += d_key_terms @ query_rows.to(acc)
            d_query_rows = _reduce_heads(d_key_terms.transpose(-1, -2) @ k_acc, query_rows.shape[0])
        return (
            None,
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            _to(d_key_rows, None if key_rows is None else key_rows.dtype),
            _to(d_query_rows, None if query_rows is None else query_rows.dtype),
            _to(d_value, None if value_rows is None else value_rows.dtype),
        )


def _to(x: Tensor | None, dtype) -> Tensor | None:
    return None if x is None else x.to(dtype)


def clipped_attention(req: AttentionRequest, terms: ClippedRelative | None = None) -> Tensor:
    """Attention ``[B, H, L, D]`` of a CONTENT request with clipped tables, by the clipped split.

    ``terms``: the declaration :func:`clipped_terms` returned for ``req`` (checked and read here when
    None)."""
    if terms is None:
        terms, reason = clipped_terms(req, min_len=0)
        if reason is not None:
            raise ValueError(f"clipped split: {reason}")
    causal = req.mask.is_plain_causal
    tables = [t for t in (terms.key_rows, terms.query_rows, terms.value_rows) if t is not None]
    plan = _Plan(req.scale, _block_for(terms, causal), causal, terms.index, tables[0].shape[-2])
    k, v = req.kv_per_query_head()
    key_rows, query_rows, value_rows = (
        _to(t, req.q.dtype) for t in (terms.key_rows, terms.query_rows, terms.value_rows)
    )
    return _ClippedAttention.apply(plan, req.q, k, v, key_rows, query_rows, value_rows)
