"""Exact parts that the split backends (``segments``, ``near_far``, ``clipped``) and ``blocked`` share.

A split runs attention as parts that each take a fast path of PyTorch's CPU flash kernel and merges
them exactly through their row log-sum-exp, as FlashAttention and ring attention do:

``lse = logaddexp(lse_a, lse_b)``, ``out = out_a·exp(lse_a − lse) + out_b·exp(lse_b − lse)``.

**Backward.** The flash backward kernel recomputes a part's probabilities as ``exp(s − lse)`` and uses
the output only through ``D_i = dO_i · O_i``. Given the *merged* output and log-sum-exp (minus a row
constant the part added to its logits) it returns that part's exact ``dq, dk, dv``; the parts'
gradients add up. A row constant ``c_i`` gets ``w_i · (dO_i · Ô_i − D_i)`` (:func:`row_constant_grad`),
with ``w_i = exp(lse_part_i − lse_i)`` the part's softmax mass and ``Ô_i`` its own normalised output.

**The far part** (:func:`far_forward`, :func:`far_backward`). Keys at distance ``skip`` or more before
each query are one ``is_causal`` call on shifted slices (:func:`far_rows`, :func:`far_keys`):
queries ``skip:`` against keys ``:L − skip``; the part after the diagonal is the same call on
reversed copies. A term that depends on the key only reaches the kernel as a float mask broadcast
over the rows (:func:`key_term_mask`), so the kernel's GEMMs keep SDPA's head dim. Where that term
is trained, the backward carries it in **one extra head dimension** instead (:func:`with_key_term`:
``q' = [q, 1]``, ``k' = [k, key_term]``, ``v' = [v, 0]``): its gradient is the extra column of the
kernel's ``dk``, which a mask has no counterpart for.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...masks.attention_mask import AttentionMask
from .flash import accumulation_dtype, flash_backward, flash_forward

__all__ = [
    "MASKED_KERNEL_COST",
    "add_runs",
    "aligned_rows",
    "at_least_float32",
    "consecutive",
    "distance_table",
    "far_backward",
    "far_forward",
    "far_keys",
    "far_rows",
    "key_term_mask",
    "masked_band",
    "merge_lse",
    "pad_column",
    "part_weight",
    "piece_ranges",
    "row_constant_grad",
    "runs",
    "same_consecutive_positions",
    "with_key_term",
]

#: The CPU flash kernel's cost per logit with a float mask, relative to its maskless path
#: (benchmarks/RESULTS.md, "Exact splits").
MASKED_KERNEL_COST = 1.15


# ---------------------------------------------------------------------------- positions and tables


def consecutive(pos: Tensor) -> bool:
    """True when every row of ``pos [Bp, T]`` is the same run of consecutive integers."""
    if pos.shape[1] == 0:
        return True
    expected = pos[:1, :1] + torch.arange(pos.shape[1], device=pos.device)[None]
    return bool((pos == expected).all())


def same_consecutive_positions(q_pos: Tensor, k_pos: Tensor) -> bool:
    """True when the queries sit at one run of consecutive positions in every row and the keys'
    first row is that run (square self-attention without gaps: what the near/far splits need)."""
    q_pos, k_pos = q_pos.long(), k_pos.long()
    return consecutive(q_pos) and torch.equal(q_pos[:1], k_pos[:1])


def at_least_float32(bias: Tensor) -> Tensor:
    """float32, or float64 when the encoding computes in float64 (float64 gradient checks)."""
    return bias if bias.dtype == torch.float64 else bias.float()


def distance_table(encoding, heads: int, d_min: int, d_max: int, device) -> Tensor:
    """``table[h, d - d_min] = bias_at(h, q, q + d)`` for every distance ``d`` in ``[d_min, d_max]``
    (a shift-invariant bias), evaluated at a non-negative reference query so both positions stay
    valid. float32 or wider."""
    q_ref = max(0, -d_min)
    dist = torch.arange(d_min, d_max + 1, device=device)
    head = torch.arange(heads, device=device)[:, None]
    table = encoding.bias_at(head, torch.full_like(dist, q_ref)[None], (q_ref + dist)[None])
    return at_least_float32(table).expand(heads, dist.numel()).contiguous()


# ---------------------------------------------------------------------------- costs and pieces


def masked_band(mask: AttentionMask, q_len: int, block: int) -> int:
    """Logits that blocks of ``block`` queries compute over their mask's key ranges (one batch row)."""
    band = 0
    for i0 in range(0, q_len, block):
        i1 = min(q_len, i0 + block)
        lo, hi = mask.key_range(i0, i1)
        band += (i1 - i0) * (hi - lo)
    return band


def piece_ranges(count: int, entry_bytes: int, limit: int) -> list[tuple[int, int]]:
    """``(first, n)`` runs of ``count`` consecutive entries of ``entry_bytes`` each, at most ``limit``
    bytes a run (one entry at least). Kernel calls are cut this way so their temporaries stay small:
    glibc returns freed blocks over 32 MiB to the system, so larger ones are fresh pages every call."""
    size = max(1, limit // max(1, entry_bytes))
    return [(e0, min(size, count - e0)) for e0 in range(0, count, size)]


def runs(x: Tensor, batch: int, start: int, step: int, count: int, length: int) -> Tensor:
    """``[count, H, length, *]``: entry ``e`` is ``x[batch, :, start + e·step : ... + length]`` (a view)."""
    s_batch, s_head, s_row = x.stride()[:3]
    shape = (count, x.shape[1], length, *x.shape[3:])
    strides = (step * s_row, s_head, s_row, *x.stride()[3:])
    return x.as_strided(shape, strides, x.storage_offset() + batch * s_batch + start * s_row)


def add_runs(target: Tensor, batch: int, start: int, step: int, length: int, grad: Tensor) -> None:
    """``target[batch, :, start + e·step : ... + length] += grad[e]`` for every ``e``; runs may overlap,
    so they are added in interleaved sets that do not."""
    count = grad.shape[0]
    if count > 1 and step == 0:
        runs(target, batch, start, 0, 1, length).add_(grad.sum(0, keepdim=True))
        return
    stride = max(1, -(-length // step)) if count > 1 else 1
    for first in range(min(stride, count)):
        n = len(range(first, count, stride))
        runs(target, batch, start + first * step, step * stride, n, length).add_(grad[first::stride])


# ---------------------------------------------------------------------------- merging parts


def merge_lse(total: Tensor, lse: Tensor) -> None:
    """``total = logaddexp(total, lse)`` in place: one more part in the rows' log-sum-exp."""
    torch.logaddexp(total, lse, out=total)


def part_weight(lse: Tensor, total: Tensor) -> Tensor:
    """A part's softmax mass in its rows, ``exp(lse_part − lse)``: its output's weight in the merge."""
    return torch.exp(lse - total)


def row_constant_grad(
    weight: Tensor, grad: Tensor, part_out: Tensor, delta: Tensor, value_row: Tensor | None = None
) -> Tensor:
    """The gradient of a constant added to a part's logits in each row: ``w · (dO · Ô − D)``
    (``[.., rows]``; ``part_out`` the part's own normalised output, ``delta = dO · O`` the merged one).
    A constant value row ``a`` the part adds to its output adds ``w · dO · a``."""
    own = (grad * part_out).sum(-1) - delta
    if value_row is not None:
        own = own + (grad * value_row).sum(-1)
    return weight * own


# ---------------------------------------------------------------------------- the key-term head dimension


#: Where each row of :func:`with_key_term`'s widened operands starts: on a 64-byte boundary (a cache
#: line and an AVX-512 register). Dense rows of ``D + 1`` elements start anywhere in a line, and the
#: CPU flash kernel's GEMMs then read every row split across two lines: at the far part's shapes
#: (``bench split --part kernel``) that costs as much as the extra column itself. The kernel reads
#: row strides as they are, so padded rows change where rows start, not the numbers.
ROW_ALIGN_BYTES = 64


def aligned_rows(shape: tuple[int, ...], width: int, like: Tensor) -> Tensor:
    """Zeros ``[*shape, width]`` (``like``'s dtype and device) whose rows start every
    :data:`ROW_ALIGN_BYTES`: a view of storage padded to the next multiple of that many bytes."""
    per_line = max(1, ROW_ALIGN_BYTES // like.element_size())
    padded = -(-width // per_line) * per_line
    return like.new_zeros(*shape, padded)[..., :width]


def with_key_term(q: Tensor, k: Tensor, v: Tensor, key_term: Tensor, q_scale: float | None = None):
    """``[q, 1]``, ``[k, key_term]``, ``[v, 0]``: a logit term ``key_term[.., j]`` per key rides in one
    extra head dimension (``key_term [B|1, H, Tk]``, in logit units over the kernel's scale). Each is
    a view with rows on :data:`ROW_ALIGN_BYTES` boundaries (:func:`aligned_rows`).

    ``q_scale``: fold the logit scale into ``q`` (``[q·scale, 1]``, run the kernel at scale 1), so
    the key term is in logit units itself."""
    dim = q.shape[-1]
    q_wide, k_wide, v_wide = (aligned_rows(x.shape[:-1], dim + 1, x) for x in (q, k, v))
    q_wide[..., :dim] = q if q_scale is None else q * q_scale
    q_wide[..., dim] = 1
    k_wide[..., :dim] = k
    k_wide[..., dim] = key_term.to(k.dtype)
    v_wide[..., :dim] = v
    return q_wide, k_wide, v_wide


def pad_column(x: Tensor) -> Tensor:
    """``x`` with one zero column: an output or its gradient beside :func:`with_key_term`'s operands
    (rows aligned alike)."""
    wide = aligned_rows(x.shape[:-1], x.shape[-1] + 1, x)
    wide[..., :-1] = x
    return wide


# ---------------------------------------------------------------------------- the far part


def far_rows(x: Tensor, skip: int, flip: bool = False) -> Tensor:
    """The far part's query rows of ``x [B, H, L, *]`` (or ``[B, H, L]``): ``skip:``; after the
    diagonal (``flip``) ``:L − skip`` reversed."""
    length = x.shape[2]
    return x[:, :, : length - skip].flip(2) if flip else x[:, :, skip:]


def far_keys(x: Tensor, skip: int, flip: bool = False) -> Tensor:
    """The far part's keys of ``x``: ``:L − skip``; after the diagonal (``flip``) ``skip:`` reversed."""
    length = x.shape[2]
    return x[:, :, skip:].flip(2) if flip else x[:, :, : length - skip]


def key_term_mask(key_term: Tensor, like: Tensor) -> Tensor:
    """``key_term [B|1, H, n]`` as the float mask ``[B|1, H, 1, n]`` the CPU flash kernel broadcasts over
    its query rows (a size-1 dimension gets stride 0 there): float32, float64 for float64 queries, so a
    half-precision call keeps the term at float32 precision."""
    return key_term.to(accumulation_dtype(like.dtype)).unsqueeze(2)


def far_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, key_term: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The far part: rows ``q`` (:func:`far_rows`) against keys ``k``, ``v`` (:func:`far_keys`) under
    ``is_causal``: row ``t`` sees keys ``:t + 1``. ``key_term [B|1, H, n]`` (the keys' logit term in
    logit units, or None) reaches the kernel as a mask broadcast over the rows (:func:`key_term_mask`),
    so its GEMMs have SDPA's head dim. Returns the part's own output ``[B, H, n, D]`` and log-sum-exp
    ``[B, H, n]`` (kernel dtype)."""
    mask = None if key_term is None else key_term_mask(key_term, q)
    return flash_forward(q, k, v, 0.0, True, attn_mask=mask, scale=scale)


def far_backward(
    grad: Tensor,
    out: Tensor,
    lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    key_term: Tensor | None = None,
    key_grad: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The far part's ``dq``, ``dk``, ``dv`` and, with ``key_grad``, the key term's gradient ``[B, H, n]``
    (else None).

    ``grad``, ``out`` ``[B, H, n, D]`` and ``lse [B, H, n]`` are the *merged* output gradient, output and
    log-sum-exp at the part's rows, minus the part's row constant in ``lse`` (and, for a constant
    value row, minus that row in ``out``); ``q``, ``k``, ``v``, ``key_term`` as in :func:`far_forward`.

    The key term's gradient is the column sum of ``dS``, which the kernel does not return for a mask:
    with ``key_grad`` the term rides in one extra head dimension instead (:func:`with_key_term`, the
    scale folded into ``q``), and the extra column of ``dk`` is that sum. Without it the term stays a
    mask and the GEMMs keep SDPA's head dim: on CPUs whose BLAS is slow at a ``D + 1`` edge that is
    most of the far part's cost (``bench split --part kernel``)."""
    dim = q.shape[-1]
    if key_term is None or not key_grad:
        # The kernel reads the output gradient and the output with one set of strides: both contiguous.
        grad, out = grad.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        mask = None if key_term is None else key_term_mask(key_term, q)
        d_q, d_k, d_v = flash_backward(
            grad, q, k, v, out, lse.contiguous(), 0.0, True, attn_mask=mask, scale=scale
        )
        return d_q, d_k, d_v, None
    q_wide, k_wide, v_wide = with_key_term(q, k, v, key_term, scale)
    # Both padded alike (pad_column), so they share one set of strides as they are.
    grad, out = pad_column(grad.to(q.dtype)), pad_column(out.to(q.dtype))
    d_q, d_k, d_v = flash_backward(grad, q_wide, k_wide, v_wide, out, lse.contiguous(), 0.0, True, scale=1.0)
    # q' = q·scale: the chain rule brings the scale back to q's own gradient.
    return d_q[..., :dim] * scale, d_k[..., :dim], d_v[..., :dim], d_k[..., dim]
