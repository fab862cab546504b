"""Fused rotary application: ``x·cos + rotate(x)·sin`` in one pass over ``x``, optionally in place.

The textbook form (HF ``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin``) makes four
full-size temporaries per tensor; on CPU each fresh large tensor also pays page faults. Here:

* ``cos``/``sin`` are the float32 tables ``[B|1, T, d_r/2]`` (half width, as :class:`RotaryTables`,
  the cache every rotary encoding keeps, returns them), cast once to ``x``'s dtype;
* the rotation is written with ``mul``/``addcmul`` into the output's two halves, a few heads at a
  time, so every intermediate stays in cache and ``x`` is read and written about once;
* ``inplace=True`` rotates ``x`` itself (inference, or tensors that do not require grad): no
  allocation at all, which is where the speed-up over allocating implementations comes from;
* under ``torch.compile`` (``torch.compiler.is_compiling()``) the plain expression is used, which
  inductor fuses into one loop without graph breaks.

``pairing="half"`` rotates channel ``k`` with ``k + d_r/2`` (GPT-NeoX/Llama) through one compiled
loop on CPU (:mod:`posenc.kernels.rope_native`, bit for bit the eager passes it falls back to),
``"interleaved"`` rotates ``(2k, 2k+1)`` (the paper, GPT-J) through a complex multiply. Channels past ``d_r``
(partial rotary) pass through.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from . import half_pairs, rope_native
from .position_ranges import known_start

__all__ = [
    "MAX_CACHED_ROWS",
    "RotaryTables",
    "apply_rotary",
    "rotary",
    "rotary_cos_sin",
    "rotary_reference",
]

Pairing = Literal["half", "interleaved"]

#: Bytes of ``x`` processed per step: small enough that the temporaries stay in L2/L3 cache.
CHUNK_BYTES = 1 << 20


#: Rows a :class:`RotaryTables` keeps at most (unless its ``cache_size`` is larger): positions past
#: them are computed directly, so one far position (say 10**7) never allocates a huge table.
MAX_CACHED_ROWS = 1 << 15


def rotary_cos_sin(
    positions: Tensor, inv_freq: Tensor, attention_scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` of the angles ``positions * inv_freq``, shape ``[*positions.shape, d_r/2]``.

    Computed in float32, or float64 when ``inv_freq`` is float64; never in a lower precision.
    ``attention_scale`` multiplies both (HF's ``attention_factor``).
    """
    dtype = torch.promote_types(inv_freq.dtype, torch.float32)
    angles = positions.to(dtype)[..., None] * inv_freq.to(device=positions.device, dtype=dtype)
    cos, sin = angles.cos(), angles.sin()
    if attention_scale != 1.0:
        cos, sin = cos * attention_scale, sin * attention_scale
    return cos, sin


class RotaryTables(nn.Module):
    """The cos/sin cache of every rotary encoding: float32 ``[rows, d_r/2]`` for positions ``0..rows-1``.

    ``tables(positions)`` returns ``cos``/``sin`` ``[*positions.shape, d_r/2]`` (float32) for integer
    positions of any shape. The table starts at ``cache_size`` rows and doubles on demand up to
    ``max(cache_size, MAX_CACHED_ROWS)`` rows; calls with positions past that are computed directly
    from ``inv_freq`` with the same float32 arithmetic. The buffers are non-persistent; the
    encoding that owns the tables recomputes them (:meth:`reset`) after a move or cast.
    """

    def __init__(self, inv_freq: Tensor | None = None, attention_scale: float = 1.0, cache_size: int = 2048):
        super().__init__()
        if cache_size <= 0:
            raise ValueError(f"cache_size must be positive, got {cache_size}")
        self.cache_size = cache_size
        self.max_rows = max(cache_size, MAX_CACHED_ROWS)
        self.attention_scale = 1.0
        self.inv_freq: Tensor
        self.cos: Tensor
        self.sin: Tensor
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("cos", torch.empty(0, 0), persistent=False)
        self.register_buffer("sin", torch.empty(0, 0), persistent=False)
        if inv_freq is not None:
            self.reset(inv_freq, attention_scale)

    def reset(self, inv_freq: Tensor | None, attention_scale: float = 1.0) -> None:
        """Recompute the tables for ``inv_freq [d_r/2]`` (float32, on its device); None empties them."""
        if inv_freq is None:
            device = self.inv_freq.device
            self.inv_freq = torch.empty(0, device=device)
            self.cos = self.sin = torch.empty(0, 0, device=device)
            return
        if inv_freq.dim() != 1:
            raise ValueError(f"inv_freq must be 1-D [d_r/2], got shape {tuple(inv_freq.shape)}")
        self.inv_freq = inv_freq.detach().float()
        self.attention_scale = float(attention_scale)
        rows = min(self.max_rows, max(self.cache_size, self.cos.shape[0]))
        self._build(rows, self.inv_freq.device)

    def _build(self, rows: int, device: torch.device) -> None:
        self.inv_freq = self.inv_freq.to(device=device, dtype=torch.float32)
        positions = torch.arange(rows, device=device)
        self.cos, self.sin = rotary_cos_sin(positions, self.inv_freq, self.attention_scale)

    def tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """float32 ``cos``/``sin`` ``[*positions.shape, d_r/2]`` for non-negative ``positions``.

        Integer positions are read from the cache; real-valued ones (fractional positions) are
        computed directly with the same float32 arithmetic (``positions.float() · inv_freq``).
        """
        start = known_start(positions)  # posenc's own arange: rows start.. of the table, no gather
        if start is not None:  # (the buffers read once: nn.Module.__getattr__ cost a decode step 5%)
            buffers = self._buffers
            cos, sin = buffers["cos"], buffers["sin"]
            length = positions.shape[1]
            if (
                start + length <= cos.shape[0]
                and cos.dtype == torch.float32
                and cos.device == positions.device
            ):
                return cos.narrow(0, start, length)[None], sin.narrow(0, start, length)[None]
        if self.inv_freq.numel() == 0:
            raise RuntimeError("RotaryTables: no frequencies yet; call reset(inv_freq) first")
        if positions.is_floating_point():
            return rotary_cos_sin(positions, self.inv_freq.to(positions.device), self.attention_scale)
        if torch.compiler.is_compiling():
            # The cache's size depends on the positions' values, which a compiled graph cannot
            # branch on: compute the rows on the fly (the same function the cache is built with).
            return rotary_cos_sin(positions, self.inv_freq.to(positions.device), self.attention_scale)
        rows = self.cos.shape[0]
        if self.cos.device != positions.device or self.cos.dtype != torch.float32:
            self._build(rows, positions.device)
        if start is not None:
            top = start + positions.shape[1]
        else:
            top = int(positions.max()) + 1 if positions.numel() else 1
        if rows < top <= self.max_rows:
            self._build(min(self.max_rows, max(top, 2 * rows)), positions.device)
        if top <= self.cos.shape[0]:
            if start is not None:
                return self.cos[None, start:top], self.sin[None, start:top]
            return self.cos[positions], self.sin[positions]
        return rotary_cos_sin(positions, self.inv_freq, self.attention_scale)


def _check(x: Tensor, cos: Tensor, sin: Tensor, pairing: str) -> tuple[Tensor, Tensor, int]:
    if pairing not in ("half", "interleaved"):
        raise ValueError(f"pairing must be 'half' or 'interleaved', got {pairing!r}")
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, T, D], got shape {tuple(x.shape)}")
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if (
        cos.shape != sin.shape
        or cos.dim() != 3
        or cos.shape[1] != x.shape[2]
        or cos.shape[0] not in (1, x.shape[0])
    ):
        raise ValueError(
            f"cos/sin must be [T, d_r/2] or [B|1, T, d_r/2] with T={x.shape[2]}, B={x.shape[0]}; "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    half = cos.shape[-1]
    if 2 * half > x.shape[-1]:
        raise ValueError(f"cos/sin rotate {2 * half} channels but x has only {x.shape[-1]}")
    if cos.dtype == x.dtype and sin.dtype == x.dtype:  # (a no-op .to still costs a dispatch)
        return cos, sin, half
    return cos.to(x.dtype), sin.to(x.dtype), half


def rotary_reference(x: Tensor, cos: Tensor, sin: Tensor, pairing: Pairing = "half") -> Tensor:
    """The rotation as one expression (what ``torch.compile`` fuses); same contract as :func:`apply_rotary`."""
    cos, sin, half = _check(x, cos, sin, pairing)
    cos, sin = cos[:, None], sin[:, None]
    width = 2 * half
    rot = x[..., :width]
    if pairing == "half":
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return out if width == x.shape[-1] else torch.cat((out, x[..., width:]), dim=-1)


def apply_rotary(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    pairing: Pairing = "half",
    inplace: bool = False,
    out: Tensor | None = None,
) -> Tensor:
    """Rotate ``x [B, H, T, D]`` by ``cos``/``sin`` ``[T, d_r/2]`` or ``[B|1, T, d_r/2]`` (float32 tables).

    Args:
        x: queries or keys.
        cos, sin: tables for each position of ``x`` (from :class:`RotaryTables`).
        pairing: ``"half"`` (NeoX/Llama ``rotate_half``) or ``"interleaved"`` (GPT-J, the paper).
        inplace: rotate ``x`` itself and return it (``x`` must not require grad).
        out: optional preallocated output (same shape and dtype as ``x``).

    Returns:
        The rotated tensor (``x`` itself when ``inplace``), equal to :func:`rotary_reference`.
    """
    if torch.compiler.is_compiling():
        if inplace:
            return x.copy_(rotary_reference(x, cos, sin, pairing))
        return rotary_reference(x, cos, sin, pairing)
    cos, sin, half = _check(x, cos, sin, pairing)
    target = _target(x, out, inplace)
    if x.requires_grad and torch.is_grad_enabled():  # (not inplace: _target refused it; target is out)
        return target.copy_(rotary_reference(x, cos, sin, pairing))  # autograd-friendly expression
    width = 2 * half
    if pairing == "interleaved" and _complex_ready(x) and _complex_ready(target):
        return _rotate_complex(x, target, cos, sin, width, inplace)
    if pairing == "half" and rope_native.rotate_half(x, target, cos, sin):
        # one compiled pass, bit for bit the eager passes below (posenc.kernels.rope_native)
        if not inplace and width < x.shape[-1]:
            target[..., width:] = x[..., width:]
        return target
    return _rotate_eager(x, target, cos, sin, half, pairing, inplace)


def _target(x: Tensor, out: Tensor | None, inplace: bool) -> Tensor:
    """Where :func:`apply_rotary` writes: ``x`` itself (``inplace``), ``out``, or a fresh tensor like ``x``;
    ``ValueError`` for an ``x`` that requires grad in place, both ``inplace`` and ``out``, or an ``out``
    of another shape or dtype."""
    if inplace:
        if x.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "apply_rotary(inplace=True) needs an x that does not require grad (use inplace=False)"
            )
        if out is not None:
            raise ValueError("give either inplace=True or out, not both")
        return x
    if out is None:
        return torch.empty_like(x)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must have x's shape {tuple(x.shape)} and dtype {x.dtype}")
    return out


def _rotate_eager(
    x: Tensor, target: Tensor, cos: Tensor, sin: Tensor, half: int, pairing: str, inplace: bool
) -> Tensor:
    """The eager passes of :func:`apply_rotary` into ``target``: one over everything when ``x`` is one
    small chunk, else chunk by chunk, channels past ``2 * half`` copied when not ``inplace``."""
    width = 2 * half
    if width == x.shape[-1] and cos.shape[0] == 1 and x.numel() * x.element_size() <= CHUNK_BYTES:
        # one chunk of every channel (a decode step's q and k): no slicing, which costs more than the math
        if pairing == "half":
            half_pairs.rotate_half_pairs(x, target, cos[0], sin[0], half, inplace)
        else:
            _rotate_interleaved(x, target, cos[0], sin[0], inplace)
        return target
    if not inplace and width < x.shape[-1]:
        target[..., width:] = x[..., width:]
    for b0, b1, h0, h1 in _chunks(x, cos.shape[0]):
        c, s = cos[b0 if cos.shape[0] > 1 else 0], sin[b0 if cos.shape[0] > 1 else 0]
        src, dst = x[b0:b1, h0:h1, :, :width], target[b0:b1, h0:h1, :, :width]
        if pairing == "half":
            half_pairs.rotate_half_pairs(src, dst, c, s, half, inplace)
        else:
            _rotate_interleaved(src, dst, c, s, inplace)
    return target


def _chunks(x: Tensor, table_batch: int):
    """``(b0, b1, h0, h1)`` slices of about :data:`CHUNK_BYTES`; one batch row at a time when the
    tables differ per batch row."""
    batch, heads, length, dim = x.shape
    per_head = max(1, length * dim * x.element_size())
    heads_per_chunk = max(1, CHUNK_BYTES // per_head)
    if heads_per_chunk >= heads and table_batch == 1:
        yield 0, batch, 0, heads  # small tensor: one step
        return
    for b in range(batch):
        for h0 in range(0, heads, heads_per_chunk):
            yield b, b + 1, h0, min(heads, h0 + heads_per_chunk)


def _complex_ready(x: Tensor) -> bool:
    """Whether ``x``'s pairs can be viewed as complex numbers (float32/64, pairs adjacent in memory)."""
    return (
        x.dtype in (torch.float32, torch.float64)
        and x.stride(-1) == 1
        and x.storage_offset() % 2 == 0
        and all(s % 2 == 0 for s in x.stride()[:-1])
    )


def _rotate_complex(x: Tensor, target: Tensor, cos: Tensor, sin: Tensor, width: int, inplace: bool) -> Tensor:
    """Interleaved pairs as ``(x_{2k} + i x_{2k+1}) · (cos + i sin)``: in place, one pass over ``x`` and no
    temporary but the ``[B|1, 1, T, d_r/2]`` complex table (built once per call, not per chunk)."""
    rotation = torch.complex(cos, sin)[:, None]
    value = torch.view_as_complex(x[..., :width].unflatten(-1, (-1, 2)))
    if inplace:
        value.mul_(rotation)
        return x
    if width < x.shape[-1]:
        target[..., width:] = x[..., width:]
    for b0, b1, h0, h1 in _chunks(x, cos.shape[0]):  # the product's temporary stays in cache
        r = rotation[b0 if rotation.shape[0] > 1 else 0]
        dst = torch.view_as_complex(target[b0:b1, h0:h1, :, :width].unflatten(-1, (-1, 2)))
        torch.mul(value[b0:b1, h0:h1], r, out=dst)
    return target


def _rotate_interleaved(src: Tensor, dst: Tensor, cos: Tensor, sin: Tensor, inplace: bool) -> None:
    """Interleaved pairs of a tensor that cannot be viewed as complex (half precision, odd strides)."""
    x1, x2 = src[..., 0::2], src[..., 1::2]
    first = x1.clone()
    o1, o2 = dst[..., 0::2], dst[..., 1::2]
    torch.mul(x1, cos, out=o1) if not inplace else o1.mul_(cos)
    o1.addcmul_(x2, sin, value=-1.0)
    o2.copy_(x2) if not inplace else None
    o2.mul_(cos).addcmul_(first, sin)


class _Rotary(torch.autograd.Function):
    """The fused kernel under autograd: backward rotates the gradient by the opposite angle (a
    rotation's transpose), so training runs the kernel too, in place when the caller allows it."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, pairing: str, inplace: bool) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.pairing = pairing
        if inplace:
            apply_rotary(x.detach(), cos, sin, pairing=pairing, inplace=True)
            ctx.mark_dirty(x)
            return x
        return apply_rotary(x.detach(), cos, sin, pairing=pairing)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        return apply_rotary(grad.contiguous(), cos, -sin, pairing=ctx.pairing), None, None, None, None


def rotary(
    x: Tensor, cos: Tensor, sin: Tensor, *, pairing: Pairing = "half", inplace: bool = False
) -> Tensor:
    """:func:`apply_rotary` that autograd can differentiate through the fused kernel.

    ``inplace=True`` rotates ``x`` itself, also under autograd, when ``x`` is a fresh intermediate
    nobody saved for backward (a projection's output: the attention layer's q and k); autograd
    refuses it on a leaf that requires grad. Tables that require grad (learned frequencies, LeRoPE)
    take the plain expression, which differentiates them, into a fresh tensor whatever ``inplace``
    (``x`` is saved for their gradient).
    """
    differentiable = torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad)
    if not differentiable:
        return apply_rotary(x, cos, sin, pairing=pairing, inplace=inplace)
    if cos.requires_grad or sin.requires_grad:
        # x is saved for the tables' gradient: writing the result into x would void it (a fresh tensor)
        return rotary_reference(x, cos, sin, pairing)
    if torch.compiler.is_compiling():
        result = rotary_reference(x, cos, sin, pairing)
        return x.copy_(result) if inplace else result
    return _Rotary.apply(x, cos, sin, pairing, inplace)
