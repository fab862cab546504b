"""``piecewise`` backend: ReRoPE, Leaky ReRoPE, Self-Extend and Dual Chunk Attention at the cost of one attention.

The reference patches of these methods compute two or three full attentions (one per position map)
and merge them, with a ``[Tq, Tk]`` logit matrix per part; the eager and ``relative`` backends
follow that form exactly. For square causal self-attention at consecutive positions this backend
runs each part only where its pairs lie, as the family declares with its tiles
(:meth:`~posenc.encodings._rope_parts.PiecewiseRoPE.part_tiles`):

* the queries and keys are rotated once per distinct position map of a part
  (:meth:`~posenc.encodings._rope_parts.PiecewiseRoPE.position_maps`; ``[B, H, T, D]`` each);
* each tile is one call of PyTorch's fused CPU flash kernel on its rows of the part's rotated
  queries and its keys: a whole rectangle (DCA's chunk before, older chunks), a top-left causal
  square (the far triangle ``i - j >= w``, DCA's own chunk), or a band of distances (the near band
  ``i - j < w``) cut into blocks of :data:`BAND_BLOCK` queries, each with a float mask of its band;
* the tiles merge exactly through their row log-sum-exp (``lse = logaddexp``, outputs weighted by
  ``exp(lse_tile - lse)``), the one softmax of the method;
* the backward pass hands each tile the merged output and log-sum-exp
  (:mod:`posenc.backends.parts.exact`): the kernel's backward returns that tile's exact
  ``dq``, ``dk``, ``dv``, which add up per part; autograd carries them through the rotations.

No tensor of ``Tq x Tk`` elements is built: the largest extra memory is the rotated copies and a
band block's mask. Decoding (one query against a cache), padding, windows and other masks go to the
``relative`` backend (its reasons say so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..encodings._rope_parts import PartTile, PiecewiseRoPE
from . import AttentionRequest, register_backend
from .parts.exact import same_consecutive_positions
from .parts.flash import accumulation_dtype, cpu_flash_limit, flash_backward, flash_forward, kernel_layout
from .parts.query_blocks import query_block_reasons

__all__ = ["BAND_BLOCK", "PIECEWISE_MIN_LEN", "PiecewiseBackend", "piecewise_attention", "tile_calls"]

#: Query rows per kernel call of a band tile (the near band of ReRoPE and Self-Extend).
BAND_BLOCK = 256
#: Below this many queries the dense ``relative`` backend is as fast and ``auto`` keeps it.
PIECEWISE_MIN_LEN = 512


@dataclass(frozen=True)
class TileCall:
    """One kernel call: query rows ``rows`` of part operand ``q_index`` against keys ``keys`` of
    ``k_index``, top-left ``causal`` or under the float ``mask [1, 1, rows, keys]`` (None: every pair)."""

    q_index: int
    k_index: int
    rows: tuple[int, int]
    keys: tuple[int, int]
    causal: bool = False
    mask: Tensor | None = None


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


def _band_calls(tile: PartTile, q_index: int, k_index: int, dtype, block: int) -> list[TileCall]:
    """A band tile in blocks of ``block`` query rows, each against the keys its band reaches."""
    lo, hi = tile.distances  # type: ignore[misc]
    (q0, q1), (k0, k1) = tile.rows, tile.keys
    masks: dict[tuple[int, int, int], Tensor | None] = {}  # interior blocks share one pattern
    calls = []
    for i0 in range(q0, q1, block):
        i1 = min(q1, i0 + block)
        j0 = k0 if hi is None else max(k0, i0 - hi)
        j1 = min(k1, i1 - lo)
        if j1 <= j0:
            continue
        shape = (i1 - i0, j1 - j0, i0 - j0)
        if shape not in masks:
            masks[shape] = _band_mask((i0, i1), (j0, j1), lo, hi, dtype)
        calls.append(TileCall(q_index, k_index, (i0, i1), (j0, j1), mask=masks[shape]))
    return calls


def tile_calls(
    tiles: list[PartTile], operands: list[tuple[int, int]], dtype: torch.dtype, block: int = BAND_BLOCK
) -> list[TileCall]:
    """The kernel calls of ``tiles``; ``operands[part] = (q_index, k_index)`` names each part's rotated
    queries and keys. A causal tile whose rows start ``lo`` after its keys is one ``is_causal`` call;
    any other band is cut into blocks (:data:`BAND_BLOCK`) with float masks."""
    calls = []
    for tile in tiles:
        q_index, k_index = operands[tile.part]
        (q0, q1), (k0, k1) = tile.rows, tile.keys
        if q1 <= q0 or k1 <= k0:
            continue
        if tile.distances is None:
            calls.append(TileCall(q_index, k_index, tile.rows, tile.keys))
            continue
        lo, hi = tile.distances
        if hi is None and q0 - k0 == lo and q1 - q0 == k1 - k0:
            calls.append(TileCall(q_index, k_index, tile.rows, tile.keys, causal=True))
            continue
        calls.extend(_band_calls(tile, q_index, k_index, dtype, block))
    return calls


def _merge(
    out: Tensor, lse: Tensor, written: Tensor, rows: tuple[int, int], part_out: Tensor, part_lse: Tensor
) -> None:
    """One tile's output and log-sum-exp merged into rows ``rows`` of the running ``out`` and ``lse``;
    rows no tile has ``written`` yet take the tile's own (most rows of the near band)."""
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


class _TiledAttention(torch.autograd.Function):
    """One softmax over the tile calls; ``operands`` are the parts' rotated queries then keys."""

    @staticmethod
    def forward(ctx, calls: list[TileCall], scale: float, q_count: int, v: Tensor, *operands: Tensor):
        qs, ks = operands[:q_count], operands[q_count:]
        batch, heads, length, dim = qs[0].shape
        acc = accumulation_dtype(v.dtype)
        out = torch.zeros(batch, heads, length, dim, dtype=acc, device=v.device)
        lse = torch.full((batch, heads, length), -torch.inf, dtype=acc, device=v.device)
        written = torch.zeros(length, dtype=torch.bool)
        for call in calls:
            r, c = slice(*call.rows), slice(*call.keys)
            mask = None if call.mask is None else call.mask.to(v.device).expand(batch, -1, -1, -1)
            part_out, part_lse = flash_forward(
                qs[call.q_index][:, :, r],
                ks[call.k_index][:, :, c],
                v[:, :, c],
                0.0,
                call.causal,
                attn_mask=mask,
                scale=scale,
            )
            _merge(out, lse, written, call.rows, part_out, part_lse)
        out = out.to(v.dtype)
        ctx.calls, ctx.scale, ctx.q_count = calls, scale, q_count
        ctx.save_for_backward(v, out, lse, *operands)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        v, out, lse, *operands = ctx.saved_tensors
        qs, ks = operands[: ctx.q_count], operands[ctx.q_count :]
        acc = accumulation_dtype(v.dtype)
        grad_out = grad_out.to(v.dtype).contiguous()  # the kernel reads it with out's strides
        d_qs = [torch.zeros(q.shape, dtype=acc, device=q.device) for q in qs]
        d_ks = [torch.zeros(k.shape, dtype=acc, device=k.device) for k in ks]
        d_v = torch.zeros(v.shape, dtype=acc, device=v.device)
        lse_kernel = lse.float() if v.dtype != torch.float64 else lse
        for call in ctx.calls:
            r, c = slice(*call.rows), slice(*call.keys)
            mask = None if call.mask is None else call.mask.to(v.device).expand(v.shape[0], -1, -1, -1)
            d_q, d_k, d_vc = flash_backward(
                grad_out[:, :, r],
                qs[call.q_index][:, :, r],
                ks[call.k_index][:, :, c],
                v[:, :, c],
                out[:, :, r],
                lse_kernel[:, :, r].contiguous(),
                0.0,
                call.causal,
                attn_mask=mask,
                scale=ctx.scale,
            )
            d_qs[call.q_index][:, :, r] += d_q
            d_ks[call.k_index][:, :, c] += d_k
            d_v[:, :, c] += d_vc
        grads = [g.to(t.dtype) for g, t in zip(d_qs + d_ks, operands)]
        return (None, None, None, d_v.to(v.dtype), *grads)


def _distinct(maps: list[Tensor]) -> tuple[list[Tensor], list[int]]:
    """The distinct position maps among ``maps`` and the index of each map among them (parts that
    share a map rotate once)."""
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


def piecewise_attention(req: AttentionRequest, block: int = BAND_BLOCK) -> Tensor:
    """Attention ``[B, H, L, D]`` of a piecewise-RoPE request by its tiles (see the module doc)."""
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
    groups = req.num_heads // req.k.shape[1]
    rotated_q = [kernel_layout(enc.rotated(q, at)) for at in q_maps]
    rotated_k = [kernel_layout(_per_query_head(enc.rotated(req.k, at), groups)) for at in k_maps]
    v = kernel_layout(_per_query_head(req.v, groups))
    tiles = enc.part_tiles(int(q_pos[0, 0]), req.q_len)
    calls = tile_calls(tiles, list(zip(q_index, k_index)), q.dtype, block)
    return _TiledAttention.apply(calls, req.scale, len(rotated_q), v, *rotated_q, *rotated_k)


def _per_query_head(x: Tensor, groups: int) -> Tensor:
    """``x [B, Hkv, T, D]`` repeated to the query heads (grouped-query attention); itself when they match."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _plan_reasons(req: AttentionRequest) -> list[str]:
    """Why the tiles cannot serve ``req`` (empty when they can)."""
    enc = req.encoding
    if not isinstance(enc, PiecewiseRoPE):
        return [
            f"serves the piecewise-RoPE families (rerope, leaky_rerope, self_extend, dca) only, not {enc.name}"
        ]
    causal = req.mask.is_plain_causal or (req.mask.is_trivial and req.q_len == 1)  # one token: both
    if not causal or req.q_len != req.k_len:
        return [f"tiles cover square self-attention under a plain causal mask (mask: {req.mask.describe()})"]
    if not same_consecutive_positions(req.q_pos, req.k_pos):
        return ["tiles need queries and keys at the same consecutive positions in every row"]
    if req.q_pos.is_floating_point() and not bool((req.q_pos == req.q_pos.round()).all()):
        return ["positions must be whole numbers"]
    return []


class PiecewiseBackend:
    name = "piecewise"

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
