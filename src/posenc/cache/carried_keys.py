"""Keys a cache carries transformed (PaTH): the layer's side of an encoding's ``InputTransform``.

PaTH (:mod:`posenc.encodings.path`) applies each new token's Householder-like transform to every
earlier key, so its cache stores keys already carried through the transforms seen so far, not the
projections. These functions are what :class:`~posenc.MultiheadAttention` does for such an
encoding: find its transform, widen keys and values to the transform's heads, store the carried
keys, and refuse a cache that would re-position them.
"""

from __future__ import annotations

from torch import Tensor

from ..encodings.base import InputTransform, Kind, PositionalEncoding
from .kv_cache import KVCache

__all__ = ["check_carrying_cache", "input_transform", "store_carried", "transform_heads"]


def input_transform(encoding: PositionalEncoding) -> InputTransform | None:
    """The encoding's :class:`~posenc.encodings.base.InputTransform` (PaTH), or None."""
    if encoding.kind is not Kind.CONTENT or not encoding.input_dependent:
        return None
    return encoding.input_transform()


def transform_heads(
    encoding: PositionalEncoding, heads: int | None, num_kv_heads: int, k: Tensor, v: Tensor
) -> tuple[Tensor, Tensor]:
    """``k, v [B, num_kv_heads, T, D]`` repeated to the transform's ``heads`` (a multiple of the
    layer's ``num_kv_heads``; None: the layer's)."""
    if heads is None or heads == num_kv_heads:
        return k, v
    if heads % num_kv_heads:
        raise ValueError(
            f"{encoding.name}: num_kv_heads={heads} is not a multiple of the layer's "
            f"num_kv_heads={num_kv_heads}; build it with num_kv_heads={num_kv_heads}"
        )
    groups = heads // num_kv_heads
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def store_carried(cache: KVCache, layer_idx: int, k: Tensor, carried: Tensor) -> Tensor:
    """Store ``carried [B, Hkv, Tk, D]`` as ``layer_idx``'s cached keys (the last ones, where the
    entry keeps a window's tail or a full buffer kept one) and return the keys this call attends
    to, ``k``, copied first where it shares memory with the buffer the carried keys overwrite."""
    stored = cache.get(layer_idx)
    tail = carried[:, :, carried.shape[2] - stored.k.shape[2] :]
    if stored.axes is None:
        stored.k = tail
        return k
    if k.untyped_storage().data_ptr() == stored.k.untyped_storage().data_ptr():
        k = k.clone()
    stored.k.copy_(tail)
    return k


def check_carrying_cache(encoding: PositionalEncoding, cache: KVCache | None) -> None:
    """Refuse a streaming cache for an encoding whose cache carries its keys (PaTH): it would evict
    and re-position keys whose transforms are already applied."""
    transform = input_transform(encoding)
    if cache is None or transform is None or transform.carry_keys is None:
        return
    if cache.streaming:
        raise ValueError(
            f"cache: {encoding.name!r} keeps its keys carried through every later token's transform, "
            "which a KVCache with recent_tokens (streaming) cannot hold; use KVCache() (grows or "
            "max_length=N)"
        )
