"""``piecewise`` backend: ReRoPE, Leaky ReRoPE, Self-Extend and Dual Chunk Attention at the cost of one attention.

The reference patches of these methods compute two or three full attentions (one per position map)
and merge them, with a ``[Tq, Tk]`` logit matrix per part; the eager and ``relative`` backends
follow that form exactly. For square causal self-attention at consecutive positions this backend
runs each part only where its pairs lie, as the family declares with its tiles
(:meth:`~posenc.encodings._rope_parts.PiecewiseRoPE.part_tiles`):

* each tile is cut into calls of PyTorch's fused CPU flash kernel of at most :data:`CALL_SIZE` rows
  and keys: whole rectangles (DCA's chunk before, older chunks, the keys left of a causal square),
  top-left causal squares (the far triangle ``i - j >= w``, DCA's own chunk), and a band of distances
  (the near band ``i - j < w``) in blocks of :data:`BAND_BLOCK` queries, with a float mask only
  where the band cuts the block;
* a call rotates its own slices of the queries and keys by its part's position maps
  (:meth:`~posenc.encodings._rope_parts.PiecewiseRoPE.position_maps`, the float32 tables of the
  inner RoPE): ``O(T·D)`` work beside the call's ``O(rows·keys·D)``, and no rotated copy of the
  sequence is kept;
* the calls merge exactly through their row log-sum-exp (``lse = logaddexp``, outputs weighted by
  ``exp(lse_call - lse)``), the one softmax of the method;
* the backward pass hands each call the merged output and log-sum-exp
  (:mod:`posenc.backends.parts.exact`): the kernel's backward returns that call's exact ``dq``,
  ``dk``, ``dv`` of the rotated slices, which the transposed rotation (the same tables with
  ``-sin``) turns back into the gradients of ``q`` and ``k``.

No tensor of ``Tq x Tk`` elements is built: beside the output and its gradients, the extra memory
is one call's temporaries (1.34x plain causal SDPA's peak for ReRoPE's forward and backward at 16k,
``benchmarks/RESULTS.md``). Decoding (one query against a cache), padding, windows and other masks go to the
``relative`` backend (its reasons say so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..encodings._rope_parts import PartTile, PiecewiseRoPE
from ..encodings.base import Kind
from ..kernels.rope import rotary
from . import AttentionRequest, register_backend
from .parts.exact import same_consecutive_positions
from .parts.flash import accumulation_dtype, cpu_flash_limit, flash_backward, flash_forward, kernel_layout
from .parts.query_blocks import query_block_reasons

__all__ = [
    "BAND_BLOCK",
    "CALL_SIZE",
    "PIECEWISE_MIN_LEN",
    "PiecewiseBackend",
    "piecewise_attention",
    "tile_calls",
]

#: Query rows per kernel call of a band tile (the near band of ReRoPE and Self-Extend).
BAND_BLOCK = 256
#: Rows and keys of one kernel call at most: its temporaries (the rotated slices, the backward's
#: ``dq``, ``dk``, ``dv``) stay a small fraction of the sequence's.
CALL_SIZE = 1024
#: Below this many queries the dense ``relative`` backend is as fast and ``auto`` keeps it.
PIECEWISE_MIN_LEN = 512


@dataclass(frozen=True)
class TileCall:
    """One kernel call: query rows ``rows`` rotated by query map ``q_index`` against keys ``keys``
    rotated by key map ``k_index``, top-left ``causal`` or under the float ``mask [1, 1, rows, keys]``
    (None: every pair)."""

    q_index: int
    k_index: int
    rows: tuple[int, int]
    keys: tuple[int, int]
    causal: bool = False
    mask: Tensor | None = None


def _spans(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(end, a + size)) for a in range(start, end, size)]


def _band_mask(rows: tuple[int, int], keys: tuple[int, int], lo: int, hi: int | None, dtype) -> Tensor | None:
    """``[1, 1, rows, keys]``: 0 where ``lo <= i - j <= hi``, ``finfo.min`` elsewhere; None when every
    pair of the rectangle is in the band."""
    i = torch.arange(*rows)[:, None]
    j = torch.arange(*keys)[None]
    allowed = i - j >= lo
    if hi is not None:
        allowed &= i - j <= hi
    if bool(allowed.all()):
        return None
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _band_calls(tile: PartTile, index: tuple[int, int], dtype, block: int, size: int) -> list[TileCall]:
    """A band tile in blocks of ``block`` query rows, each against the keys its band reaches in
    pieces of at most ``size`` keys; a piece wholly inside the band runs without a mask."""
    lo, hi = tile.distances  # type: ignore[misc]
    (q0, q1), (k0, k1) = tile.rows, tile.keys
    masks: dict[tuple[int, int, int], Tensor | None] = {}  # interior blocks share their patterns
    calls = []
    for i0, i1 in _spans(q0, q1, block):
        j0 = k0 if hi is None else max(k0, i0 - hi)
        for c0, c1 in _spans(j0, min(k1, i1 - lo), size):
            shape = (i1 - i0, c1 - c0, i0 - c0)
            if shape not in masks:
                masks[shape] = _band_mask((i0, i1), (c0, c1), lo, hi, dtype)
            calls.append(TileCall(*index, (i0, i1), (c0, c1), mask=masks[shape]))
    return calls


def _causal_calls(tile: PartTile, index: tuple[int, int], size: int) -> list[TileCall]:
    """A top-left causal square in row pieces of ``size``: each piece's own causal square, and the
    keys before it as whole rectangles of at most ``size`` keys."""
    (q0, q1), (k0, _) = tile.rows, tile.keys
    calls = []
    for a, b in _spans(q0, q1, size):
        diagonal = k0 + (a - q0)
        calls += [TileCall(*index, (a, b), keys) for keys in _spans(k0, diagonal, size)]
        calls.append(TileCall(*index, (a, b), (diagonal, diagonal + (b - a)), causal=True))
    return calls


def tile_calls(
    tiles: list[PartTile],
    operands: list[tuple[int, int]],
    dtype: torch.dtype,
    block: int = BAND_BLOCK,
    size: int = CALL_SIZE,
) -> list[TileCall]:
    """The kernel calls of ``tiles``, none over ``size`` rows or keys (their temporaries stay small);
    ``operands[part] = (q_index, k_index)`` names each part's position maps. A causal tile whose rows
    start ``lo`` after its keys runs as ``is_causal`` squares and whole rectangles; any other band in
    blocks of ``block`` rows (:data:`BAND_BLOCK`) with float masks where the band cuts them."""
    calls = []
    for tile in tiles:
        index = operands[tile.part]
        (q0, q1), (k0, k1) = tile.rows, tile.keys
        if q1 <= q0 or k1 <= k0:
            continue
        if tile.distances is None:
            calls += [TileCall(*index, r, c) for r in _spans(q0, q1, size) for c in _spans(k0, k1, size)]
            continue
        lo, hi = tile.distances
        if hi is None and q0 - k0 == lo and q1 - q0 == k1 - k0:
            calls += _causal_calls(tile, index, size)
            continue
        calls += _band_calls(tile, index, dtype, block, size)
    return calls


def _merge(
    out: Tensor, lse: Tensor, written: Tensor, rows: tuple[int, int], part_out: Tensor, part_lse: Tensor
) -> None:
    """One call's output and log-sum-exp merged into rows ``rows`` of the running ``out`` and ``lse``;
    rows no call has ``written`` yet take the call's own."""
    r = slice(*rows)
    part_lse = part_lse.to(lse.dtype)
    if not bool(written[r].any()):
        out[:, :, r] = part_out
        lse[:, :, r] = part_lse
        written[r] = True
        return
    before = lse[:, :, r]
    total = torch.logaddexp(before, part_lse)
    rows_out = out[:, :, r]
    rows_out.mul_(torch.exp(before - total)[..., None])
    rows_out.add_(part_out.to(out.dtype) * torch.exp(part_lse - total)[..., None])
    lse[:, :, r] = total
    written[r] = True


@dataclass
class _Rotations:
    """The position maps' float32 ``cos``/``sin`` tables ``[1, T, d_r/2]`` (queries, then keys), the
    pairing and the grouped-query factor: what a call needs to rotate its slices of ``q`` and ``k``."""

    q_tables: list[tuple[Tensor, Tensor]]
    k_tables: list[tuple[Tensor, Tensor]]
    pairing: str
    groups: int

    def query(self, q: Tensor, index: int, rows: tuple[int, int], sign: float = 1.0) -> Tensor:
        cos, sin = self.q_tables[index]
        r = slice(*rows)
        return rotary(q[:, :, r], cos[:, r], sin[:, r] * sign, pairing=self.pairing)

    def key(self, k: Tensor, index: int, keys: tuple[int, int], sign: float = 1.0) -> Tensor:
        cos, sin = self.k_tables[index]
        c = slice(*keys)
        return rotary(k[:, :, c], cos[:, c], sin[:, c] * sign, pairing=self.pairing)

    def per_query_head(self, x: Tensor) -> Tensor:
        """``x [B, Hkv, n, D]`` repeated to the query heads; itself when they match."""
        return x if self.groups == 1 else x.repeat_interleave(self.groups, dim=1)

    def per_kv_head(self, grad: Tensor) -> Tensor:
        """A gradient ``[B, H, n, D]`` summed over each key head's query heads."""
        if self.groups == 1:
            return grad
        batch, heads, n, dim = grad.shape
        return grad.view(batch, heads // self.groups, self.groups, n, dim).sum(2)


class _TiledAttention(torch.autograd.Function):
    """One softmax over the tile calls. Each call rotates its slices of ``q`` and ``k`` (``O(T·D)``
    against the call's ``O(rows·keys·D)``), so no rotated copy of the whole sequence is kept; the
    backward turns each call's ``dq``, ``dk`` back by the inverse rotation (the tables with ``-sin``)."""

    @staticmethod
    def forward(ctx, calls: list[TileCall], scale: float, turns: _Rotations, q: Tensor, k: Tensor, v: Tensor):
        batch, heads, length, dim = q.shape
        acc = accumulation_dtype(v.dtype)
        out = torch.zeros(batch, heads, length, dim, dtype=acc, device=v.device)
        lse = torch.full((batch, heads, length), -torch.inf, dtype=acc, device=v.device)
        written = torch.zeros(length, dtype=torch.bool)
        for call in calls:
            part_out, part_lse = flash_forward(
                turns.query(q, call.q_index, call.rows),
                turns.per_query_head(turns.key(k, call.k_index, call.keys)),
                turns.per_query_head(v[:, :, slice(*call.keys)]),
                0.0,
                call.causal,
                attn_mask=None if call.mask is None else call.mask.to(v.device).expand(batch, -1, -1, -1),
                scale=scale,
            )
            _merge(out, lse, written, call.rows, part_out, part_lse)
        out = out.to(v.dtype)
        ctx.calls, ctx.scale, ctx.turns = calls, scale, turns
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        turns: _Rotations = ctx.turns
        acc = accumulation_dtype(v.dtype)
        grad_out = grad_out.to(v.dtype).contiguous()  # the kernel reads it with out's strides
        d_q, d_k, d_v = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
        lse_kernel = lse.float() if v.dtype != torch.float64 else lse
        for call in ctx.calls:
            r, c = slice(*call.rows), slice(*call.keys)
            mask = None if call.mask is None else call.mask.to(v.device).expand(v.shape[0], -1, -1, -1)
            dq_call, dk_call, dv_call = flash_backward(
                grad_out[:, :, r],
                turns.query(q, call.q_index, call.rows),
                turns.per_query_head(turns.key(k, call.k_index, call.keys)),
                turns.per_query_head(v[:, :, c]),
                out[:, :, r],
                lse_kernel[:, :, r].contiguous(),
                0.0,
                call.causal,
                attn_mask=mask,
                scale=ctx.scale,
            )
            d_q[:, :, r] += _turned_back(turns.q_tables[call.q_index], call.rows, dq_call, turns.pairing)
            dk_call = turns.per_kv_head(dk_call)
            d_k[:, :, c] += _turned_back(turns.k_tables[call.k_index], call.keys, dk_call, turns.pairing)
            d_v[:, :, c] += turns.per_kv_head(dv_call)
        return (None, None, None, d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype))


def _turned_back(tables: tuple[Tensor, Tensor], span: tuple[int, int], grad: Tensor, pairing: str) -> Tensor:
    """``grad`` of a rotated slice carried back to the unrotated one: the transposed rotation,
    the same tables with ``-sin`` (an ``attention_scale`` in both stays, as it should)."""
    cos, sin = tables
    s = slice(*span)
    return rotary(grad, cos[:, s], -sin[:, s], pairing=pairing)


def _distinct(maps: list[Tensor]) -> tuple[list[Tensor], list[int]]:
    """The distinct position maps among ``maps`` and the index of each map among them (parts that
    share a map share its tables)."""
    distinct: list[Tensor] = []
    index = []
    for positions in maps:
        found = next(
            (
                n
                for n, seen in enumerate(distinct)
                if seen.dtype == positions.dtype and torch.equal(seen, positions)
            ),
            None,
        )
        if found is None:
            distinct.append(positions)
            found = len(distinct) - 1
        index.append(found)
    return distinct, index


def piecewise_attention(req: AttentionRequest, block: int = BAND_BLOCK, size: int = CALL_SIZE) -> Tensor:
    """Attention ``[B, H, L, D]`` of a piecewise-RoPE request by its tiles (see the module doc);
    ``block`` rows per band call, at most ``size`` rows and keys per call."""
    reasons = _plan_reasons(req)
    if reasons:
        raise ValueError("piecewise: " + "; ".join(reasons))
    enc: PiecewiseRoPE = req.encoding  # type: ignore[assignment]
    enc.rope.bind(req.q.shape[-1])
    q_pos, k_pos = req.q_pos[:1].to(req.q.device), req.k_pos[:1].to(req.q.device)
    q = req.q
    factor = enc.query_scale(q_pos)
    if factor is not None:
        q = q * factor[:, None, :, None].to(q.dtype)
    maps = enc.position_maps(q_pos, k_pos)
    q_maps, q_index = _distinct([q_at for q_at, _ in maps])
    k_maps, k_index = _distinct([k_at for _, k_at in maps])
    turns = _Rotations(
        [enc.cos_sin(at) for at in q_maps],
        [enc.cos_sin(at) for at in k_maps],
        enc.rope.pairing,
        req.num_heads // req.k.shape[1],
    )
    tiles = enc.part_tiles(int(q_pos[0, 0]), req.q_len)
    calls = tile_calls(tiles, list(zip(q_index, k_index)), q.dtype, block, size)
    q, k, v = (kernel_layout(t) for t in (q, req.k, req.v))
    return _TiledAttention.apply(calls, req.scale, turns, q, k, v)


def _plan_reasons(req: AttentionRequest) -> list[str]:
    """Why the tiles cannot serve ``req`` (empty when they can)."""
    enc = req.encoding
    if not isinstance(enc, PiecewiseRoPE):
        return [
            f"serves the piecewise-RoPE families (rerope, leaky_rerope, self_extend, string_shift, dca, dpe) only, not {enc.name}"
        ]
    causal = req.mask.is_plain_causal or (req.mask.is_trivial and req.q_len == 1)  # one token: both
    if not causal or req.q_len != req.k_len:
        return [f"tiles cover square self-attention under a plain causal mask (mask: {req.mask.describe()})"]
    if not same_consecutive_positions(req.q_pos, req.k_pos):
        return ["tiles need queries and keys at the same consecutive positions in every row"]
    if req.q_pos.is_floating_point() and not bool((req.q_pos == req.q_pos.round()).all()):
        return ["positions must be whole numbers"]
    if torch.is_grad_enabled() and any(p.requires_grad for p in enc.parameters()):
        return [f"{enc.name} has parameters that require grad: the tiles differentiate q, k and v only"]
    return []


class PiecewiseBackend:
    name = "piecewise"
    kinds = frozenset({Kind.CONTENT})
    # what reasons and declines read (posenc.backends.memo.READS): the memo's key
    reads = frozenset({"tensors", "kind", "encoding", "positions", "mask", "nonfinite", "sinks", "grad"})

    def reasons(self, request: AttentionRequest) -> list[str]:
        flash = cpu_flash_limit(request.q)
        if flash is not None:
            return [flash]
        reasons = _plan_reasons(request)
        if request.sinks is not None:
            reasons.append("attention sinks are not merged into the tiles (the relative backend takes them)")
        return reasons + query_block_reasons(request)

    def declines(self, request: AttentionRequest) -> list[str]:
        if request.q_len < PIECEWISE_MIN_LEN:
            return [f"below {PIECEWISE_MIN_LEN} queries the dense relative backend is as fast"]
        return []

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        return piecewise_attention(request), None


register_backend(PiecewiseBackend())
