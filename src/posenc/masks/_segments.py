"""The key segments of a block of query rows (:meth:`posenc.masks.attention_mask.AttentionMask.segments`).

A block's boolean rows over the keys any of them sees are split into at most three runs per batch
row, each with a shape a kernel has a fast path for: an anticausal square, a middle run (full or
masked) and a causal square.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["KeySegment", "split_segments"]


@dataclass(frozen=True)
class KeySegment:
    """A run of keys ``k0:k1`` that query rows ``i0:i1`` see in one of four shapes.

    ``pattern``: ``"full"`` (every row sees every key: a kernel's maskless path), ``"causal"`` (a
    square, row ``t`` sees key ``k0 + u`` for ``u <= t``), ``"anticausal"`` (a square, ``u >= t``)
    or ``"masked"`` (anything else: :attr:`allowed` holds the bool rows ``[H|1, i1-i0, k1-k0]``).
    ``batch`` is the batch row the segment belongs to, or None when it holds for every row.
    """

    batch: int | None
    i0: int
    i1: int
    k0: int
    k1: int
    pattern: str
    allowed: Tensor | None = field(default=None, compare=False, repr=False)


def split_segments(allowed: Tensor | None, i0: int, i1: int, lo: int, hi: int) -> tuple[KeySegment, ...]:
    """The segments of rows ``i0:i1`` over keys ``lo:hi`` from their bool rows
    ``allowed [B|1, H|1, i1-i0, hi-lo]`` (None: every pair may attend)."""
    if allowed is None:
        return (KeySegment(None, i0, i1, lo, hi, "full"),)
    if allowed.shape[1] > 1:  # a per-head user mask: one masked run per batch row
        per_batch = [(b if allowed.shape[0] > 1 else None, allowed[b]) for b in range(allowed.shape[0])]
        return tuple(KeySegment(b, i0, i1, lo, hi, "masked", a) for b, a in per_batch)
    found: list[KeySegment] = []
    for b in range(allowed.shape[0]):
        found += _split_rows(allowed[b, 0], b if allowed.shape[0] > 1 else None, i0, lo)
    return tuple(found)


_TRIANGLES: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}


def _triangles(size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The bool lower and upper triangles (diagonal included) of a ``size`` square, cached."""
    key = (size, str(device))
    if key not in _TRIANGLES:
        ones = torch.ones(size, size, dtype=torch.bool, device=device)
        _TRIANGLES[key] = (ones.tril(), ones.triu())
    return _TRIANGLES[key]


def _split_rows(allowed: Tensor, batch: int | None, i0: int, k_first: int) -> list[KeySegment]:
    """:func:`split_segments` for one batch row: ``allowed [rows, keys]`` starts at key ``k_first``."""
    rows = allowed.shape[0]
    seen = allowed.any(dim=0).nonzero()
    if seen.numel() == 0:
        return []
    v0, v1 = int(seen[0]), int(seen[-1]) + 1
    i1 = i0 + rows
    lower, upper = _triangles(rows, allowed.device)
    left = v0 if v1 - v0 >= rows and torch.equal(allowed[:, v0 : v0 + rows], upper) else None
    right = v1 - rows if v1 - rows >= (v0 if left is None else v0 + rows) else None
    if right is not None and not torch.equal(allowed[:, right:v1], lower):
        right = None
    segments = []
    if left is not None:
        segments.append(KeySegment(batch, i0, i1, k_first + v0, k_first + v0 + rows, "anticausal"))
    m0 = v0 if left is None else v0 + rows
    m1 = v1 if right is None else right
    if m1 > m0:
        middle = allowed[:, m0:m1]
        full = bool(middle.all())
        pattern, kept = ("full", None) if full else ("masked", middle[None])
        segments.append(KeySegment(batch, i0, i1, k_first + m0, k_first + m1, pattern, kept))
    if right is not None:
        segments.append(KeySegment(batch, i0, i1, k_first + right, k_first + v1, "causal"))
    return segments
