"""``segments`` backend: kinds without a bias (ABSOLUTE, ROTARY) under windows, documents and chunks.

Each query block's keys come from the mask as at most three :class:`~posenc.masks.attention_mask.KeySegment` (an
anticausal square, a middle run, a causal square; :meth:`AttentionMask.segments`): a sliding window
away from the sequence start is (anticausal, full, causal), a block inside one packed document is
(full, causal). Segments of the same shape from every block (and batch row) run as **one batched
call** of PyTorch's CPU flash kernel, blocks stacked along the batch dimension: the kernel pays a
fixed cost per call, so one call per shape beats a loop over blocks. With :data:`SEGMENT_MODE`
``"bands"`` (the default) each block's segments run as one masked band over its key range, all
blocks of one shape sharing one mask; ``"segments"`` runs full runs without a mask and the two
triangles as masked calls with one shared triangular mask. The parts merge exactly through their
log-sum-exp, and the backward hands each part the merged output and log-sum-exp
(:mod:`posenc.backends.parts.exact`). Rows with exactly one part (a window's bands) skip the merge.

``auto`` takes it where the blocked backend would run (the same costs) and the segments cost less
than masked query blocks; forcing it serves any mask.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..encodings.base import Kind
from ..masks.attention_mask import AttentionMask, KeySegment
from . import AttentionRequest, register_backend
from .parts.exact import MASKED_KERNEL_COST, add_runs, masked_band, merge_lse, part_weight, piece_ranges, runs
from .parts.flash import (
    accumulation_dtype,
    cpu_flash_limit,
    flash_backward,
    flash_forward,
    kernel_layout,
)
from .parts.query_blocks import DEFAULT_BLOCK, query_block_declines, query_block_reasons
from .parts.sinks import merge_sinks, sink_grad

__all__ = ["SEGMENT_BLOCK", "SegmentsBackend", "segment_attention", "segment_groups"]

#: Query rows per block (128 and 256 run about as fast; 128 wastes less at window edges).
SEGMENT_BLOCK = 128
#: Bytes of one batched backward call's key operands (the ``dk``/``dv`` it allocates) at most; a
#: group of more blocks runs as several calls (:func:`~posenc.backends.parts.exact.piece_ranges`). The
#: forward keeps one call: it allocates only outputs of the queries' size.
MAX_CALL_BYTES = 8 << 20


# ---------------------------------------------------------------------------- mask segments


@dataclass
class _Group:
    """``n`` segments of one shape and pattern whose first query and first key advance by a fixed
    step (``q_step``, ``k_step``) in batch row ``batch``: the operands are strided views, no copies.

    Causal and anticausal squares run as masked calls with one shared triangular mask: on squares
    of a block ``is_causal`` saves no time (its backward is slower than the masked kernel's), and the
    anticausal square would need reversed copies of every operand."""

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
        return runs(x, self.batch, self.q0, self.q_step, self.n, self.rows)

    def keys_of(self, x: Tensor) -> Tensor:
        return runs(x, self.batch, self.k0, self.k_step, self.n, self.keys)

    def add_to_keys(self, target: Tensor, grad: Tensor) -> None:
        """``target[batch, :, keys of entry e] += grad[e]`` for every entry (key runs may overlap)."""
        add_runs(target, self.batch, self.k0, self.k_step, self.keys, grad)

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
            for e0, n in piece_ranges(self.n, key_row_bytes * self.keys, MAX_CALL_BYTES)
        ]


def _triangle(pattern: str, rows: int, keys: int, device) -> Tensor:
    """Bool ``[1, rows, keys]``: row ``t`` sees key ``u`` for ``u <= t`` (causal, aligned at the first
    key) or ``u − (keys − rows) >= t`` (anticausal, aligned at the last key; padding can trim a square
    to a rectangle)."""
    t = torch.arange(rows, device=device)[:, None]
    u = torch.arange(keys, device=device)[None]
    return ((u <= t) if pattern == "causal" else (u - (keys - rows) >= t))[None]


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
#: block. Bands run faster on windows and documents: the masked kernel's penalty is small, and one
#: call over more keys runs at a better rate than three small ones (benchmarks/RESULTS.md).
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
        merge_lse(lse_view, lse)
    for out_view, lse_view, out, lse in parts:
        out_view.addcmul_(out, part_weight(lse, lse_view).unsqueeze(-1).to(out.dtype))


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


def _segment_cost(groups: list[_Group]) -> float:
    """The kernel's work over every group, a masked logit at :data:`MASKED_KERNEL_COST`."""
    return sum((1.0 if g.allowed is None else MASKED_KERNEL_COST) * g.n * g.rows * g.keys for g in groups)


class SegmentsBackend:
    name = "segments"
    kinds = frozenset({Kind.ABSOLUTE, Kind.ROTARY})
    # what reasons and declines read (posenc.backends.memo.READS): the memo's key
    reads = frozenset({"tensors", "kind", "mask", "nonfinite"})

    def reasons(self, request: AttentionRequest) -> list[str]:
        if request.kind in (Kind.BIAS, Kind.CONTENT):
            return [
                f"serves kinds without a bias (absolute, rotary); {request.encoding.name} is {request.kind.value}"
            ]
        flash = cpu_flash_limit(request.q)
        return [flash] if flash is not None else query_block_reasons(request)

    def declines(self, request: AttentionRequest) -> list[str]:
        if request.kind in (Kind.BIAS, Kind.CONTENT) or cpu_flash_limit(request.q) is not None:
            return []  # its reasons say why
        declined = query_block_declines(request)
        if declined:
            return declined
        mask = request.mask
        if mask.is_trivial or mask.is_plain_causal:
            return ["no mask to split: sdpa runs it in one call"]
        batch = request.q.shape[0]
        blocks = MASKED_KERNEL_COST * masked_band(mask, request.q_len, DEFAULT_BLOCK) * batch
        if _segment_cost(segment_groups(mask, batch)) > blocks:
            return ["the mask's segments cost more than the blocked backend's masked query blocks"]
        return []

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        return segment_attention(request), None


register_backend(SegmentsBackend())
