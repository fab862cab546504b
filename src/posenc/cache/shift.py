"""Moving cached keys to new positions (llama.cpp's K-shift, SGLang RFC 30928, OpenVINO's cache
rotation): :func:`shift_keys`, which ``KVCache.shift_keys`` runs.

A rotary key at position ``p`` is ``R(p) k``. For an encoding whose rotations compose
(``shifts_by_rotation``: RoPE with fixed frequencies), ``R(p + Δ) k = R(Δ) R(p) k``, so the cached key
moves to ``p + Δ`` by one more rotation by ``Δ``, without the token's input: exact up to the rounding
of that rotation (a cache kept in bfloat16 rounds each shift again; ``tests/cache/test_shift.py``
measures the drift of repeated shifts). A position-only encoding (a bias such as ALiBi or T5's, or
none) keeps no position in its keys: only the key positions move. An absolute encoding (a learned or
sinusoidal table added to the input) has its positions inside every cached value, which no shift
can move; an encoding whose rotations do not compose (dynamic frequencies, several axes, learned
non-commuting maps) or that computes logits from the keys (content kinds) is refused too, naming it.

The default positions of later tokens move by ``Δ`` as well (``entry.shift``): a prefix computed at
0..n-1 and shifted by ``o`` is continued at ``o + n``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..encodings.base import Kind, PositionalEncoding
from .entry import CacheWriter, KVCacheEntry

__all__ = ["how_keys_shift", "shift_keys"]


def how_keys_shift(encoding: PositionalEncoding, entry: KVCacheEntry) -> str:
    """``"rotate"`` (turn the keys by ``Δ``) or ``"positions"`` (only the positions move) for keys that
    ``encoding`` wrote into ``entry``; ``ValueError`` naming the encoding when no shift is exact."""
    name = encoding.spec() if hasattr(encoding, "spec") else type(encoding).__name__
    if encoding.kind is Kind.ROTARY:
        if entry.rotation_dropped:
            return "positions"  # the keys were stored without their rotation
        length_dependent = getattr(getattr(encoding, "scaling", None), "length_dependent", False)
        if encoding.shifts_by_rotation and not length_dependent:
            return "rotate"
        why = "its frequencies change with the length" if length_dependent else "its rotations do not compose"
        raise ValueError(
            f"KVCache.shift_keys: {name!r} rotates keys, but {why}, so R(p + Δ) is not R(Δ) R(p): "
            "recompute the keys at their new positions instead"
        )
    if encoding.kind is Kind.BIAS and not encoding.input_dependent:
        return "positions"
    if encoding.kind is Kind.ABSOLUTE and encoding.shift_invariant:
        return "positions"  # NoPE: nothing positional in the keys
    if encoding.kind is Kind.ABSOLUTE:
        raise ValueError(
            f"KVCache.shift_keys: {name!r} adds absolute positions to the layer input, which every cached "
            "key and value carries and no shift can move; recompute them at their new positions"
        )
    raise ValueError(
        f"KVCache.shift_keys: {name!r} ({encoding.kind.value}) computes its logits from the keys and "
        "positions in its own way; shifting its cache is not supported"
    )


def _delta(delta: int | Tensor, batch: int, device: torch.device) -> Tensor:
    """``delta`` as ``[B]`` int64 on ``device``; ``ValueError`` naming it otherwise."""
    if isinstance(delta, bool) or not isinstance(delta, (int, Tensor)):
        raise ValueError(f"KVCache.shift_keys: delta must be an int or a [B] int64 tensor, got {delta!r}")
    if isinstance(delta, int):
        return torch.full((batch,), delta, dtype=torch.int64, device=device)
    if delta.dtype != torch.int64 or delta.shape not in ((batch,), ()):
        raise ValueError(
            f"KVCache.shift_keys: delta must be an int or a [{batch}] int64 tensor (one per sequence), got "
            f"shape {tuple(delta.shape)} {delta.dtype}"
        )
    return delta.to(device).expand(batch).clone()


def shift_keys(cache, layer: CacheWriter, delta: int | Tensor, *, start: int = 0) -> None:
    """Move ``layer``'s self-attention keys in ``cache`` from slot ``start`` on to their positions plus
    ``delta`` (see the module docstring), in place."""
    entry = cache.get(layer.layer_idx)
    if entry is None:
        raise ValueError(f"KVCache.shift_keys: the cache holds no entry of layer_idx={layer.layer_idx}")
    batch, length = entry.k.shape[0], entry.k.shape[2]
    entry = cache.read(layer, cross=False, batch=batch, device=entry.k.device)
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= length:
        raise ValueError(f"KVCache.shift_keys: start must be an int in [0, {length}], got {start!r}")
    if entry.padding is not None or entry.document_ids is not None or entry.evicted_real is not None:
        raise ValueError(
            "KVCache.shift_keys: the entry holds padding or document ids, whose positions count real tokens "
            "per document; shift a cache without them"
        )
    how = how_keys_shift(layer.rotary_encoding(), entry)
    steps = _delta(delta, batch, entry.k.device)
    with torch.no_grad():
        if how == "rotate":
            keys = entry.k[:, :, start:]
            # real-valued positions: the rotation's cos and sin computed from the angles, which a
            # negative Δ needs (the cached tables serve whole positions from 0 on)
            by = steps[:, None].expand(batch, keys.shape[2]).float()
            _, turned = layer.rotary_encoding().rotate(keys[:, :, :0], keys, by[:, :0], by)
            _write(entry, "k", start, turned)
        positions = entry.k_pos.expand(batch, -1)[:, start:] + steps[:, None]
        _write(entry, "k_pos", start, positions)
    entry.shift = steps if entry.shift is None else entry.shift + steps
    entry.mark_unchecked()  # the turned keys are tested for nan again by the next request


def _write(entry: KVCacheEntry, name: str, start: int, tail: Tensor) -> None:
    """Put ``tail`` in place of ``entry``'s ``name`` (``k`` or ``k_pos``) from slot ``start`` on: into the
    preallocated buffer's view, or as a new tensor of a growing entry (whose tensors may be a caller's)."""
    dim = 2 if name == "k" else 1
    if entry.axes is not None:
        getattr(entry, name).narrow(dim, start, tail.shape[dim]).copy_(tail)
        return
    head = getattr(entry, name)
    if name == "k_pos":
        head = head.expand(tail.shape[0], -1)
    setattr(entry, name, torch.cat([head.narrow(dim, 0, start), tail], dim=dim))
