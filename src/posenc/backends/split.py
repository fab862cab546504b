"""Exact splits of attention into pieces that each take the CPU flash kernel's fast path.

PyTorch's fused CPU flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``) costs more
per logit as soon as it is given a float mask (1.6x measured on torch 2.13, about 1.15x on 2.14),
skips the masked-out future only under ``is_causal``, pays a fixed cost per call (a Python loop of one
call per query block costs about 2x the same work batched), and returns the row log-sum-exp as well
as the output. So split each row's keys into parts that the kernel runs *without* a mask (whole key
runs, ``is_causal`` on shifted slices and squares), run each kind of part for every query block in
**one batched call** (blocks stacked along the batch dimension), and merge the parts exactly
through their log-sum-exp, as FlashAttention and ring attention do:

``lse = logaddexp(lse_a, lse_b)``, ``out = out_a·exp(lse_a − lse) + out_b·exp(lse_b − lse)``.

**Backward.** The flash backward kernel recomputes a part's probabilities as ``exp(s − lse)`` and uses
the output only through ``D_i = dO_i · O_i``. Given the *merged* output and log-sum-exp (shifted by a
part's own additive row constant, see below) it returns that part's exact ``dq, dk, dv``; the parts'
gradients add up. A constant ``c`` added to a part's logits of row ``i`` gets the gradient
``w_i · (dO_i · Ô_i − D_i)``, where ``w_i = exp(lse_part_i − lse_i)`` is the part's softmax mass and
``Ô_i`` its own normalised output. Nowhere is there an ``L × L`` tensor.

Two engines share this:

* **Mask segments** (kinds without a bias: ABSOLUTE, ROTARY). Each query block's keys come from the
  mask as at most three :class:`~posenc.masks.KeySegment` (an anticausal square, a middle run, a
  causal square; :meth:`AttentionMask.segments`). A sliding window away from the sequence start is
  (anticausal, full, causal); a block inside one packed document is (full, causal). Full runs take
  the maskless kernel; the two triangles take the masked kernel with one shared triangular mask (on
  128-row squares ``is_causal`` saves nothing: its backward is slower than the masked kernel's, and
  an anticausal square would need reversed copies of every operand), as do irregular runs (a block
  across a document boundary, padding inside a run, a user mask). Segments of the same shape from
  every block (and batch row) run as one call.
* **Near/far** (BIAS encodings that declare a far constant or separable terms, square self-attention
  with a plain causal mask or none). Far from the diagonal the bias is simple: a per-head constant
  (:meth:`~posenc.base.BiasEncoding.far_constant_beyond`, T5) or a row term plus a key term
  (:meth:`~posenc.base.BiasEncoding.separable`, ALiBi). The *far* part (``j <= i − block − 1``) is one
  ``is_causal`` call on shifted slices, ``q[block+1:]`` against ``k[:L−block−1]`` (and, without a causal
  mask, the mirror image for ``j >= i + block + 1`` on reversed copies); a separable key term rides
  in one extra head dimension (``q' = [q·scale, 1]``, ``k' = [k, col_j − col_c]``, ``v' = [v, 0]``)
  and the row term shifts the part's log-sum-exp. The *near* band (distances up to ``block``) runs
  as one batched masked call over all query blocks with one shared bias pattern: the distance table's
  Toeplitz rows (T5), or the key term re-centred on each block's first query (ALiBi; float32 keeps
  its precision because near keys sit within a block of the centre).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..base import Kind, SeparableBias
from ..masks import AttentionMask, KeySegment
from . import AttentionRequest
from ._flash import (
    FLASH_DTYPES,
    accumulation_dtype,
    cpu_flash_available,
    flash_backward,
    flash_forward,
    kernel_layout,
)
from ._sinks import merge_sinks, sink_grad
from .blocked import MASKED_KERNEL_COST, _distance_table, same_consecutive_positions

__all__ = [
    "NEAR_BLOCK",
    "SEGMENT_BLOCK",
    "near_far_attention",
    "near_far_plan",
    "segment_attention",
    "split_attention",
    "split_reason",
]

#: Query rows per block for mask segments (measured on 2 cores: 128 and 256 are close; 128 wastes
#: less at window edges).
SEGMENT_BLOCK = 128
#: Bytes of one batched backward call's key operands (mask segments: the ``dk``/``dv`` it allocates)
#: or float32 logits (the near band: the explicit backward's temporaries) at most; a call of more
#: blocks runs as several. glibc hands blocks over 32 MiB back to the system when freed, so larger
#: ones are fresh pages on every call. For a window of 512 at L=8192 (one call of 60 blocks, 78 MiB
#: each for ``dk`` and ``dv``) first-touching them was 40% of the backward (profiled, torch 2.14,
#: 2 threads); pieces of 8 MiB fault about 5x less. T5's near band (31 blocks, 31 MiB temporaries)
#: went from 1.35x to about 1.25x plain SDPA forward+backward at L=4096 (one thread, CPU time). The
#: forward keeps one call: it allocates only outputs of the queries' size.
MAX_CALL_BYTES = 8 << 20
#: Query rows per block of the near band (the near band spans ``block`` keys back, and forward
#: without a causal mask; an encoding's far constant must start within it).
NEAR_BLOCK = 128


# ---------------------------------------------------------------------------- mask segments


@dataclass
class _Group:
    """``n`` segments of one shape and pattern whose first query and first key advance by a fixed
    step (``q_step``, ``k_step``) in batch row ``batch``: the operands are strided views, no copies.

    Causal and anticausal squares run as masked calls with one shared triangular mask: on 128-row
    squares ``is_causal`` saves no time (its backward is slower than the masked kernel's, measured on
    torch 2.14), and the anticausal square would need reversed copies of every operand."""

    pattern: str
    rows: int
    keys: int
    batch: int
    n: int
    q0: int
    q_step: int
    k0: int
    k_step: int
    allowed: Tensor | None  # full: None; otherwise [n, H|1, rows, keys] bool (a view when shared)

    def queries(self, x: Tensor) -> Tensor:
        """``x [B, H, Tq, *]`` at this group's query rows: ``[n, H, rows, *]`` (a view, writable)."""
        return _runs(x, self.batch, self.q0, self.q_step, self.n, self.rows)

    def keys_of(self, x: Tensor) -> Tensor:
        return _runs(x, self.batch, self.k0, self.k_step, self.n, self.keys)

    def add_to_keys(self, target: Tensor, grad: Tensor) -> None:
        """``target[batch, :, keys of entry e] += grad[e]`` for every entry (key runs may overlap)."""
        _add_runs(target, self.batch, self.k0, self.k_step, self.keys, grad)

    def pieces(self, key_row_bytes: int) -> list[_Group]:
        """This group as consecutive groups whose key operands take at most :data:`MAX_CALL_BYTES`
        (``key_row_bytes``: bytes of one key row over all heads), views of the same runs."""
        return [
            replace(
                self,
                n=n,
                q0=self.q0 + e0 * self.q_step,
                k0=self.k0 + e0 * self.k_step,
                allowed=None if self.allowed is None else self.allowed[e0 : e0 + n],
            )
            for e0, n in _piece_ranges(self.n, key_row_bytes * self.keys)
        ]


def _piece_ranges(count: int, entry_bytes: int) -> list[tuple[int, int]]:
    """``(first, n)`` runs of consecutive entries, ``entry_bytes`` each, of at most
    :data:`MAX_CALL_BYTES` (one entry at least)."""
    size = max(1, MAX_CALL_BYTES // max(1, entry_bytes))
    return [(e0, min(size, count - e0)) for e0 in range(0, count, size)]


def _triangle(pattern: str, rows: int, keys: int, device) -> Tensor:
    """Bool ``[1, rows, keys]``: row ``t`` sees key ``u`` for ``u <= t`` (causal, aligned at the first
    key) or ``u − (keys − rows) >= t`` (anticausal, aligned at the last key; padding can trim a square
    to a rectangle)."""
    t = torch.arange(rows, device=device)[:, None]
    u = torch.arange(keys, device=device)[None]
    return ((u <= t) if pattern == "causal" else (u - (keys - rows) >= t))[None]


def _add_runs(target: Tensor, batch: int, start: int, step: int, length: int, grad: Tensor) -> None:
    """``target[batch, :, start + e·step : ... + length] += grad[e]`` for every ``e``; runs may overlap,
    so they are added in interleaved sets that do not."""
    count = grad.shape[0]
    if count > 1 and step == 0:
        _runs(target, batch, start, 0, 1, length).add_(grad.sum(0, keepdim=True))
        return
    stride = max(1, -(-length // step)) if count > 1 else 1
    for first in range(min(stride, count)):
        n = len(range(first, count, stride))
        _runs(target, batch, start + first * step, step * stride, n, length).add_(grad[first::stride])


def _runs(x: Tensor, batch: int, start: int, step: int, count: int, length: int) -> Tensor:
    """``[count, H, length, *]``: entry ``e`` is ``x[batch, :, start + e·step : ... + length]`` (a view)."""
    s_batch, s_head, s_row = x.stride()[:3]
    shape = (count, x.shape[1], length, *x.shape[3:])
    strides = (step * s_row, s_head, s_row, *x.stride()[3:])
    return x.as_strided(shape, strides, x.storage_offset() + batch * s_batch + start * s_row)


def segment_groups(mask: AttentionMask, batch: int, block: int = SEGMENT_BLOCK) -> list[_Group]:
    """Every query block's :meth:`~AttentionMask.segments`, grouped into strided runs (memoised on the
    mask, and across calls by the mask's content: its components and the bytes of their tensors)."""
    key = ("split_groups", batch, block, SEGMENT_MODE)
    if key in mask._memo:
        return mask._memo[key]
    shared = _content_key(mask)
    if shared is not None:
        shared = (*shared, mask.q_len, mask.k_len, batch, block, SEGMENT_MODE)
        if shared in _GROUP_CACHE:
            mask._memo[key] = _GROUP_CACHE[shared]
            return mask._memo[key]
    # A block has at most one segment of each pattern, so (batch row, pattern, shape) keeps every
    # query row at most once per group.
    buckets: dict[tuple, list] = {}
    for i0 in range(0, mask.q_len, block):
        i1 = min(mask.q_len, i0 + block)
        segments = _block_segments(mask, i0, i1)
        if SEGMENT_MODE == "bands":
            segments = _as_bands(mask, segments)
        for seg in segments:
            for b in range(batch) if seg.batch is None else (seg.batch,):
                bucket = buckets.setdefault((b, seg.pattern, i1 - i0, seg.k1 - seg.k0), [])
                bucket.append((i0, seg.k0, seg.allowed))
    groups = []
    for (b, pattern, rows, keys), entries in buckets.items():
        for run in _arithmetic_runs(entries):
            allowed = None
            if pattern in ("causal", "anticausal"):
                allowed = _triangle(pattern, rows, keys, mask.device)[None].expand(len(run), 1, rows, keys)
            elif pattern == "masked":
                first = run[0][2]
                same = all(e[2] is first or torch.equal(e[2], first) for e in run[1:])
                allowed = (
                    first[None].expand(len(run), *first.shape) if same else torch.stack([e[2] for e in run])
                )
            q_step = run[1][0] - run[0][0] if len(run) > 1 else 0
            k_step = run[1][1] - run[0][1] if len(run) > 1 else 0
            groups.append(
                _Group(pattern, rows, keys, b, len(run), run[0][0], q_step, run[0][1], k_step, allowed)
            )
    mask._memo[key] = groups
    if shared is not None:
        if len(_GROUP_CACHE) >= 16:
            _GROUP_CACHE.pop(next(iter(_GROUP_CACHE)))
        _GROUP_CACHE[shared] = groups
    return groups


_GROUP_CACHE: dict[tuple, list[_Group]] = {}
#: Tensors up to this many bytes (document ids, padding, prefix lengths) are hashed into the cache
#: key, so every layer of a model that sees the same ids reuses one analysis; larger ones (a user's
#: dense mask) are analysed per call.
_MAX_HASHED_BYTES = 1 << 20


def _content_key(mask: AttentionMask) -> tuple | None:
    """What the segments depend on: each component's description and the bytes of its tensors
    (None when a tensor is too large to hash, or with a float mask)."""
    if mask.additive is not None:
        return None
    key: list = []
    for component in mask.components:
        key.append(component.describe())
        for value in vars(component).values():
            if isinstance(value, Tensor):
                if value.numel() * value.element_size() > _MAX_HASHED_BYTES:
                    return None
                data = value.detach().cpu().contiguous()
                digest = hashlib.blake2b(data.numpy().tobytes()).digest()
                key.append((str(data.dtype), tuple(data.shape), digest))
    return tuple(key)


#: ``"bands"``: one masked call per block shape over its whole key range (blocks with the same rows
#: share one mask), full runs without a mask; ``"segments"``: anticausal / full / causal parts per
#: block. Bands measured 4-5% faster on windows and documents (torch 2.14, the masked kernel's
#: penalty is small and a call over more keys runs at a better rate than three small ones).
SEGMENT_MODE = "bands"


def _as_bands(mask: AttentionMask, segments: tuple[KeySegment, ...]) -> tuple[KeySegment, ...]:
    """Each batch row's segments of one block as a single run: full, or masked with its bool rows."""
    by_batch: dict[int | None, list[KeySegment]] = {}
    for seg in segments:
        by_batch.setdefault(seg.batch, []).append(seg)
    bands = []
    for b, segs in by_batch.items():
        i0, i1, lo, hi = segs[0].i0, segs[0].i1, segs[0].k0, segs[-1].k1
        if len(segs) == 1 and segs[0].pattern in ("full", "masked"):
            bands.append(segs[0])
            continue
        allowed = mask.rows(i0, i1, lo, hi)
        allowed = allowed[0 if b is None else b]
        bands.append(KeySegment(b, i0, i1, lo, hi, "masked", allowed))
    return tuple(bands)


def _block_segments(mask: AttentionMask, i0: int, i1: int) -> tuple[KeySegment, ...]:
    """The mask's segments of rows ``i0:i1``; with a user float mask, one masked run per batch row whose
    ``allowed`` is the additive rows (``finfo.min`` where hidden, float64)."""
    if mask.additive is None:
        return mask.segments(i0, i1)
    lo, hi = mask.key_range(i0, i1)
    if hi <= lo:
        return ()
    rows = mask.additive_rows(i0, i1, lo, hi).to(torch.float64)
    allowed = mask.rows(i0, i1, lo, hi)
    if allowed is not None:
        rows = rows.masked_fill(~allowed, torch.finfo(torch.float64).min)
    rows = rows.expand(max(rows.shape[0], 1), -1, i1 - i0, hi - lo)
    if rows.shape[0] == 1:
        return (KeySegment(None, i0, i1, lo, hi, "masked", rows[0]),)
    return tuple(KeySegment(b, i0, i1, lo, hi, "masked", rows[b]) for b in range(rows.shape[0]))


def _arithmetic_runs(entries: list) -> list[list]:
    """Split ``(q_start, k_start, ...)`` entries (increasing ``q_start``) into runs whose starts advance
    by a fixed step each."""
    runs: list[list] = []
    for entry in entries:
        run = runs[-1] if runs else None
        if (
            run
            and (
                len(run) == 1
                or (
                    entry[0] - run[-1][0] == run[1][0] - run[0][0]
                    and entry[1] - run[-1][1] == run[1][1] - run[0][1]
                )
            )
            and entry[1] >= run[-1][1]
        ):
            run.append(entry)
        else:
            runs.append([entry])
    return runs


def _float_mask(allowed: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The kernel's additive mask for bool ``allowed`` (or float rows with ``finfo.min`` where hidden).

    A mask shared by every entry of a group (expanded along its first dimension) stays expanded: the
    kernel reads one ``rows × keys`` tile from cache instead of a materialised copy per entry."""
    if allowed is None:
        return None
    if allowed.shape[0] > 1 and allowed.stride(0) == 0:
        return _float_mask(allowed[:1], dtype).expand(allowed.shape)
    if allowed.is_floating_point():
        return allowed.clamp(min=torch.finfo(dtype).min).to(dtype)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )


def _merge_parts(acc_out: Tensor, acc_lse: Tensor, parts: list) -> None:
    """Merge ``(out_view, lse_view, out [n, H, r, D], lse [n, H, r])`` parts into zeroed ``acc_out``
    and ``acc_lse`` (``-inf``): first every row's total log-sum-exp, then one weighted add per part."""
    for _, lse_view, _, lse in parts:
        torch.logaddexp(lse_view, lse, out=lse_view)
    for out_view, lse_view, out, lse in parts:
        out_view.addcmul_(out, torch.exp(lse - lse_view).unsqueeze(-1).to(out.dtype))


class _SegmentAttention(torch.autograd.Function):
    """``softmax(q kᵀ·scale + mask) v`` from the mask's segments; inputs ``groups, scale, q, k, v, sinks``."""

    @staticmethod
    def forward(ctx, groups: list[_Group], scale: float, q: Tensor, k: Tensor, v: Tensor, sinks):
        batch, heads, q_len, dim = q.shape
        acc = accumulation_dtype(q.dtype)
        # One part per row (a window's bands, documents): the kernel's results are the answer, and
        # every row is written (no zero fill first).
        single = _each_row_once(groups, batch, q_len)
        shape = (batch, heads, q_len)
        if single:
            acc_out = torch.empty(*shape, dim, dtype=acc, device=q.device)
            acc_lse = torch.empty(*shape, 1, dtype=acc, device=q.device)
        else:
            acc_out = torch.zeros(*shape, dim, dtype=acc, device=q.device)
            acc_lse = torch.full((*shape, 1), float("-inf"), dtype=acc, device=q.device)
        parts = []
        for g in groups:
            out, lse = flash_forward(
                g.queries(q),
                g.keys_of(k),
                g.keys_of(v),
                0.0,
                False,
                attn_mask=_float_mask(g.allowed, q.dtype),
                scale=scale,
            )
            lse_view = g.queries(acc_lse)[..., 0]
            if single:
                g.queries(acc_out).copy_(out)
                lse_view.copy_(lse)
            else:
                parts.append((g.queries(acc_out), lse_view, out, lse.to(acc)))
        _merge_parts(acc_out, acc_lse, parts)
        del parts
        out = acc_out.to(q.dtype)
        lse = acc_lse[..., 0]
        if sinks is not None:
            out, lse = merge_sinks(out, lse, sinks)
        ctx.groups, ctx.scale, ctx.single = groups, scale, single
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        acc = accumulation_dtype(q.dtype)
        grad_out = grad_out.contiguous()
        dq = (torch.empty if ctx.single else torch.zeros)(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros_like(dk)
        lse_kernel = (lse.to(torch.float32) if q.dtype != torch.float64 else lse).unsqueeze(-1)
        for g in (p for group in ctx.groups for p in group.pieces(_key_row_bytes(k))):
            d_q, d_k, d_v = flash_backward(
                g.queries(grad_out),
                g.queries(q),
                g.keys_of(k),
                g.keys_of(v),
                g.queries(out),
                g.queries(lse_kernel)[..., 0].contiguous(),
                0.0,
                False,
                attn_mask=_float_mask(g.allowed, q.dtype),
                scale=ctx.scale,
            )
            g.queries(dq).copy_(d_q) if ctx.single else g.queries(dq).add_(d_q)
            g.add_to_keys(dk, d_k)
            g.add_to_keys(dv, d_v)
        d_sinks = (
            sink_grad(grad_out, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[5] else None
        )
        return None, None, dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), d_sinks


def _key_row_bytes(k: Tensor) -> int:
    """Bytes of one key row over all heads of ``k [B, H, T, D]``."""
    return k.shape[1] * k.shape[3] * k.element_size()


def _each_row_once(groups: list[_Group], batch: int, q_len: int) -> bool:
    """Whether every query row is in exactly one group entry (then nothing needs merging)."""
    if sum(g.n * g.rows for g in groups) != batch * q_len:
        return False
    if any(g.n > 1 and g.q_step < g.rows for g in groups):
        return False  # entries that share rows
    seen = torch.zeros(batch, 1, q_len, 1, dtype=torch.int32)
    for g in groups:
        g.queries(seen).add_(1)
    return bool((seen == 1).all())


def segment_attention(req: AttentionRequest, block: int = SEGMENT_BLOCK) -> Tensor:
    """Attention ``[B, H, Tq, D]`` of a request without a bias, from its mask's key segments."""
    if req.q_len == 0 or req.k_len == 0:
        return req.q * 0
    q, k, v = (kernel_layout(t) for t in (req.q, *req.kv_per_query_head()))
    groups = segment_groups(req.mask, req.q.shape[0], block)
    out = _SegmentAttention.apply(groups, req.scale, q, k, v, req.sinks)
    return req.mask.zero_empty_rows(out)


# ---------------------------------------------------------------------------- near/far (bias)


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
            for e0, n in _piece_ranges(self.count, 4 * heads * self.rows * self.keys)
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
    """The far part of ``side`` as one ``is_causal`` call: ``(q', k', v', scale, shift [B|1, H, rows])``.

    ``before``: queries ``far:`` against keys ``:L−far``. ``after``: queries ``:L−far`` against keys
    ``far:``, both reversed. A separable bias adds one head dimension (``q' = [q·scale, 1]``,
    ``k' = [k, col − col_c]``, ``v' = [v, 0]``, kernel scale 1); its row term and ``col_c`` (``c`` the
    middle key) shift the log-sum-exp. A far constant shifts the log-sum-exp by itself.

    Precision of the one centre: a far logit carries the rounding of ``col_j − col_c``, about
    ``eps·|col_j − col_c|``. For ALiBi that error is weighted by ``exp(−m·(i − j))`` with
    ``i − j > block``, so it stays below ``eps·L / (e·block)`` (tested at L=2048 in float32). A key term
    that is not linear in the position (FoX's cumulative log forget gates) has no such bound where
    the gates are near 1 on both sides of a steep drop: there the error is ``eps`` times the drop
    between the key and the middle of the sequence.
    """
    far, length = plan.far, plan.q_len
    rows = slice(far, length) if side == "before" else slice(0, length - far)
    keys = slice(0, length - far) if side == "before" else slice(far, length)
    if constant is not None:
        qf, kf, vf, scale = q[:, :, rows], k[:, :, keys], v[:, :, keys], plan.scale
        shift = constant.view(1, -1, 1).to(accumulation_dtype(q.dtype))
    else:
        terms = plan.separable[side]
        centre = length // 2
        col = terms.col - terms.col[..., centre : centre + 1]
        shift = (terms.row + terms.col[..., centre : centre + 1])[..., rows]
        shift = shift.to(accumulation_dtype(q.dtype))
        batch = q.shape[0]
        one = q.new_ones(batch, q.shape[1], length - far, 1)
        qf = torch.cat((q[:, :, rows] * plan.scale, one), dim=-1)
        kf = torch.cat((k[:, :, keys], col[..., keys, None].to(q.dtype).expand(batch, -1, -1, -1)), dim=-1)
        vf = torch.cat((v[:, :, keys], torch.zeros_like(one)), dim=-1)
        scale = 1.0
    if side == "after":
        qf, kf, vf, shift = qf.flip(2), kf.flip(2), vf.flip(2), shift.flip(-1)
    return qf, kf, vf, scale, shift


def _far_rows(plan: _NearFar, side: str) -> slice:
    return slice(plan.far, plan.q_len) if side == "before" else slice(0, plan.q_len - plan.far)


def _near_operands(plan: _NearFar, c: _NearCall, q: Tensor, k: Tensor, v: Tensor, terms: tuple | None):
    """One near call's ``(q', k', v', scale, shift [count, H, rows] or None)``: views of q, k, v, or
    with a separable key term (``terms = (row, col)``) one more head dimension, re-centred on each
    block's first query so float32 keeps its precision."""
    block = plan.block
    qn = _runs(q, c.b, c.q0, block, c.count, c.rows)
    kn, vn = (_runs(x, c.b, c.k0, block, c.count, c.keys) for x in (k, v))
    if not plan.near_separable:
        return qn, kn, vn, plan.scale, None
    row, col = terms
    b_col, b_row = (c.b if t.shape[0] > 1 else 0 for t in (col, row))
    centres = torch.arange(c.count, device=q.device) * block + c.q0
    centre = col[b_col][:, centres].t()[:, :, None, None]  # [count, H, 1, 1]
    relative = (_runs(col[..., None], b_col, c.k0, block, c.count, c.keys) - centre).to(q.dtype)
    ones = q.new_ones(c.count, q.shape[1], c.rows, 1)
    q_aug = torch.cat((qn * plan.scale, ones), dim=-1)
    k_aug = torch.cat((kn, relative), dim=-1)
    v_aug = torch.cat((vn, torch.zeros_like(relative)), dim=-1)
    shift = _runs(row[..., None], b_row, c.q0, block, c.count, c.rows)[..., 0] + centre[..., 0]
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
            _runs(lse_total, c.b, c.q0, block, c.count, c.rows)[..., 0].copy_(lse)
            near.append((c, out, lse))
        lse_total = lse_total[..., 0]
        far_parts = {}
        for side, constant in (("before", far_before), ("after", far_after)):
            if (side == "after" and not plan.bidirectional) or plan.far >= length:
                continue
            qf, kf, vf, scale, shift = _far_operands(plan, side, q, k, v, constant)
            out, lse = flash_forward(qf, kf, vf, 0.0, True, scale=scale)
            out, lse = out[..., :dim], lse.to(acc) + shift
            if side == "after":
                out, lse = out.flip(2), lse.flip(-1)
            rows = _far_rows(plan, side)
            torch.logaddexp(lse_total[:, :, rows], lse, out=lse_total[:, :, rows])
            far_parts[side] = (out, lse)
        merged = torch.empty(batch, heads, length, dim, dtype=acc, device=q.device)
        for c, out, lse in near:
            weight = torch.exp(
                lse - _runs(lse_total.unsqueeze(-1), c.b, c.q0, block, c.count, c.rows)[..., 0]
            )
            torch.mul(
                out, weight.unsqueeze(-1).to(out.dtype), out=_runs(merged, c.b, c.q0, block, c.count, c.rows)
            )
        del near
        for side, (out, lse) in far_parts.items():
            rows = _far_rows(plan, side)
            merged[:, :, rows].addcmul_(out.to(acc), torch.exp(lse - lse_total[:, :, rows]).unsqueeze(-1))
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
        batch, heads, length, dim = q.shape
        acc = accumulation_dtype(q.dtype)
        block = plan.block
        grad_out = grad_out.contiguous()
        lse_kernel = lse.to(acc)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros_like(dk)
        want_table = table is not None and needs[4]
        d_table = torch.zeros(table.shape, dtype=acc, device=q.device) if want_table else None
        d_bias = torch.zeros(heads, block, plan.width, dtype=acc, device=q.device) if want_table else None
        # The key term's gradient is the column sum of dS, which the extra head dimension of k'
        # collects (q' is 1 there); the row term's is the row sum of dS: zero but for the sinks' share.
        d_col = torch.zeros(batch, heads, length, 1, dtype=acc, device=q.device) if want_terms else None
        bias = plan.near_bias(table, q.dtype, q.device)
        lse_rows = lse_kernel.unsqueeze(-1)
        pieces = (p for call in _near_calls(plan, bias, batch) for p in call.pieces(heads, block))
        for c in pieces:
            g_b, o_b = (_runs(x, c.b, c.q0, block, c.count, c.rows) for x in (grad_out, out))
            q_b, k_b, v_b, scale, shift = _near_operands(plan, c, q, k, v, terms)
            l_b = _runs(lse_rows, c.b, c.q0, block, c.count, c.rows)[..., 0]
            if shift is not None:
                extra = q_b.shape[-1] - dim
                g_b, o_b = _pad_last(g_b, extra), _pad_last(o_b, extra)
                l_b = l_b - shift
                d_q, d_k, d_v = flash_backward(
                    g_b, q_b, k_b, v_b, o_b, l_b.contiguous(), 0.0, False, attn_mask=c.mask, scale=scale
                )
                if d_col is not None:
                    _add_runs(d_col, c.b, c.k0, block, c.keys, d_k[..., dim:].to(acc))
                d_q, d_k, d_v = d_q[..., :dim] * plan.scale, d_k[..., :dim], d_v[..., :dim]
            elif want_table:
                d_q, d_k, d_v = _explicit_backward(g_b, q_b, k_b, v_b, o_b, l_b, c, plan, d_bias)
            else:
                d_q, d_k, d_v = flash_backward(
                    g_b, q_b, k_b, v_b, o_b, l_b.contiguous(), 0.0, False, attn_mask=c.mask, scale=plan.scale
                )
            _runs(dq, c.b, c.q0, block, c.count, c.rows).add_(d_q)
            _add_runs(dk, c.b, c.k0, block, c.keys, d_k.to(acc))
            _add_runs(dv, c.b, c.k0, block, c.keys, d_v.to(acc))
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)  # D_i = dO_i . O_i
        d_far = {}
        for side, constant in (("before", far_before), ("after", far_after)):
            if side not in ctx.far_parts:
                continue
            rows = _far_rows(plan, side)
            keys = slice(0, length - plan.far) if side == "before" else slice(plan.far, length)
            qf, kf, vf, scale, shift = _far_operands(plan, side, q, k, v, constant)
            extra = qf.shape[-1] - dim
            g_f, o_f = grad_out[:, :, rows], out[:, :, rows]
            if extra:
                g_f, o_f = _pad_last(g_f, extra), _pad_last(o_f, extra)
            l_f = lse_kernel[:, :, rows]
            if side == "after":
                g_f, o_f, l_f = g_f.flip(2), o_f.flip(2), l_f.flip(-1)
            l_f = (l_f - shift).to(accumulation_dtype(q.dtype)).contiguous()
            d_q, d_k, d_v = flash_backward(
                g_f.contiguous(), qf, kf, vf, o_f.contiguous(), l_f, 0.0, True, scale=scale
            )
            if side == "after":
                d_q, d_k, d_v = d_q.flip(2), d_k.flip(2), d_v.flip(2)
            dq[:, :, rows] += d_q[..., :dim].to(acc) * (plan.scale if extra else 1.0)
            dk[:, :, keys] += d_k[..., :dim].to(acc)
            dv[:, :, keys] += d_v[..., :dim].to(acc)
            if d_col is not None and extra:
                d_col[:, :, keys] += d_k[..., dim:].to(acc)
            if constant is not None and want_table:
                part_out, part_lse = ctx.far_parts[side]
                mass = torch.exp(part_lse - lse_kernel[:, :, rows])
                own = (grad_out[:, :, rows].to(acc) * part_out.to(acc)).sum(-1)
                d_far[side] = (mass * (own - delta[:, :, rows])).sum(dim=(0, 2))
        if want_table:
            t = torch.arange(block, device=q.device)[:, None]
            u = torch.arange(plan.width, device=q.device)[None]
            index = (u - t - block - plan.d_min).expand(block, -1).reshape(-1)
            d_table.index_add_(1, index, d_bias.reshape(heads, -1))
            for side, grad in d_far.items():
                d_table[:, plan.far_index[side]] += grad
            d_table = d_table.to(table.dtype)
        d_sinks = sink_grad(grad_out, out, lse, sinks) if sinks is not None and needs[5] else None
        d_row = d_col_out = None
        if want_terms:
            d_col_out = _sum_to_shape(d_col[..., 0], col.shape).to(col.dtype)
            d_row = torch.zeros_like(row)
            if sinks is not None:  # the sink's share of the row: sum_j dS_ij = p_sink_i * D_i
                mass = torch.exp(sinks.to(acc).view(1, -1, 1) - lse_kernel)
                d_row = _sum_to_shape(mass * delta, row.shape).to(row.dtype)
        return (
            None,
            dq.to(q.dtype),
            dk.to(q.dtype),
            dv.to(q.dtype),
            d_table,
            d_sinks,
            None,
            None,
            d_row,
            d_col_out,
        )


def _sum_to_shape(grad: Tensor, shape) -> Tensor:
    return grad.sum(0, keepdim=True) if shape[0] == 1 and grad.shape[0] != 1 else grad


def _pad_last(x: Tensor, extra: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, extra))


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
    beyond = enc.far_constant_beyond()
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
        terms = enc.separable(q_pos[:1], k_pos[:1])
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
        table = _distance_table(enc, req.num_heads, plan.d_min, d_max, req.q.device)
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


# ---------------------------------------------------------------------------- choosing a split

#: Below this many queries the near band is most of the work and the blocked path is as fast
#: (measured on 2 cores with T5 and ALiBi).
NEAR_FAR_MIN_LEN = 1024


def _kernel_ready(req: AttentionRequest) -> bool:
    return req.q.device.type == "cpu" and req.q.dtype in FLASH_DTYPES and cpu_flash_available()


def _segment_cost(groups: list[_Group]) -> float:
    cost = 0.0
    for g in groups:
        per = 1.0 if g.allowed is None else MASKED_KERNEL_COST
        cost += per * g.n * g.rows * g.keys
    return cost


def _masked_block_cost(req: AttentionRequest, block: int) -> float:
    """What the blocked path pays: the masked kernel over each block's key range, per batch row."""
    band = 0
    for i0 in range(0, req.q_len, block):
        i1 = min(req.q_len, i0 + block)
        lo, hi = req.mask.key_range(i0, i1)
        band += (i1 - i0) * (hi - lo)
    return MASKED_KERNEL_COST * band * req.q.shape[0]


def split_reason(req: AttentionRequest, block: int) -> str | None:
    """None when a split runs ``req`` faster than masked blocks of ``block`` queries; else why not.

    BIAS kinds: the near/far plan must fit and the sequence be long enough. Other kinds: the mask's
    segments must cost less than the masked blocks (windows, documents and chunks do; a plain causal
    or padding mask does not, and sdpa serves those).
    """
    if not _kernel_ready(req):
        return "the split runs PyTorch's CPU flash kernel (CPU, its dtypes)"
    if req.kind is Kind.BIAS:
        plan, why = near_far_plan(req)
        if plan is None:
            return why
        if req.q_len < NEAR_FAR_MIN_LEN:
            return f"below {NEAR_FAR_MIN_LEN} queries the near band is most of the work"
        return None
    if req.mask.is_trivial or req.mask.is_plain_causal or req.q_len == 0 or req.k_len == 0:
        return "no mask to split"
    groups = segment_groups(req.mask, req.q.shape[0])
    if _segment_cost(groups) > _masked_block_cost(req, block):
        return "the mask's segments cost more than masked blocks"
    return None


def split_attention(req: AttentionRequest) -> Tensor:
    """The split for ``req`` (near/far for BIAS kinds, mask segments otherwise)."""
    return near_far_attention(req) if req.kind is Kind.BIAS else segment_attention(req)
