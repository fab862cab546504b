"""One layer's cache entry and the stamp that says who wrote it: :class:`KVCacheEntry` (its keys,
values and key positions, growing or preallocated in :class:`TimeAxis` buffers), :class:`CacheStamp`
(the writer and the form of its keys: only the writer reads), and the checks every in-place write
makes. :class:`~posenc.cache.kv_cache.KVCache` holds one entry per layer; see :mod:`posenc.cache.kv_cache` for the
rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from ..encodings.base import FiniteMark, PositionalEncoding

__all__ = [
    "CacheFullError",
    "CacheStamp",
    "CacheWriter",
    "ContextKey",
    "KVCacheEntry",
    "TimeAxis",
    "check_in_place_write",
    "context_key",
    "rotation_dropped",
]


class CacheWriter(Protocol):
    """What a cache asks of the layer that writes or reads an entry (both attention layers have it)."""

    layer_idx: int
    training: bool
    #: The layer's q/k channel layout, bumped when ``switch_rope_pairing_`` permutes those channels.
    qk_layout: int

    def describe(self) -> str:
        """The layer in one line, for error messages."""
        ...

    def rotary_encoding(self) -> PositionalEncoding:
        """The encoding whose rotation the cached keys carry."""
        ...


def rotation_dropped(layer: CacheWriter) -> bool:
    """Whether ``layer``'s rotary encoding leaves q and k unrotated now (RoPE's ``drop_rotation``)."""
    return bool(getattr(layer.rotary_encoding(), "rotation_dropped", False))


@dataclass(kw_only=True)
class CacheStamp:
    """Who wrote a cache entry, and in which form: a layer reads only an entry it wrote in its current form.

    :class:`KVCache` and :class:`~posenc.layers.mla.LatentCache` entries carry it; :meth:`stamp` fills it
    when a layer writes the entry and :meth:`check_reader` refuses, with a ``ValueError`` naming the
    writer, what another layer, another batch, another device or another channel layout or rotation
    mode would otherwise read silently.
    """

    writer_id: int = 0  # id() of the layer that wrote the entry
    writer: str = ""  # that layer, described for error messages
    layout: int = 0  # the writer's q/k channel layout then (switch_rope_pairing_ changes it)
    # Whether the writer's encoding skipped its rotation then (RoPE drop_rotation="eval" in eval
    # mode); None: the keys are stored unrotated (a streaming KVCache rotates them at every step).
    rotation_dropped: bool | None = False

    def held(self) -> Tensor:
        """The tensor whose batch size (dim 0) and device are the entry's."""
        raise NotImplementedError

    def stamp(self, layer: CacheWriter, previous: CacheStamp | None = None) -> None:
        """Record ``layer`` as the writer; ``previous``, the entry this one extends, if any (its
        writer's description is reused rather than formatted again on every decode step)."""
        if previous is not None and previous.writer_id == id(layer):
            self.writer_id, self.writer = previous.writer_id, previous.writer
        else:
            self.writer_id, self.writer = id(layer), layer.describe()
        self.layout, self.rotation_dropped = layer.qk_layout, rotation_dropped(layer)

    def check_reader(
        self, layer: CacheWriter, *, what: str, batch: int, device: torch.device, fresh: str
    ) -> None:
        """Raise unless ``layer`` wrote this entry (``what``, e.g. "the self-attention entry of
        layer_idx=0") in its current form, for a batch of ``batch`` on ``device``; ``fresh`` names
        the cache class to start again with."""
        held = self.held()
        if held.device != device:
            raise ValueError(
                f"cache: {what} is on device {held.device} but the layer is on {device}; "
                f"use a fresh {fresh} on this device"
            )
        if self.writer_id != id(layer):
            raise ValueError(
                f"cache: {what} was written by {self.writer}, not by this layer, {layer.describe()}; "
                f"give every layer its own layer_idx, or use a fresh {fresh}"
            )
        if self.layout != layer.qk_layout:
            raise ValueError(
                f"cache: {what} holds keys in the q/k channel order this layer had before "
                f"switch_rope_pairing_ permuted it; use a fresh {fresh}"
            )
        dropped = rotation_dropped(layer)
        if self.rotation_dropped is not None and self.rotation_dropped != dropped:
            then, now = ("without", "with") if self.rotation_dropped else ("with", "without")
            raise ValueError(
                f"cache: {what} holds keys written {then} rotation, but this layer's encoding now runs "
                f"{now} it (drop_rotation='eval' rotates in training mode only, and the layer was switched "
                f"to {'training' if layer.training else 'eval'} mode since); use a fresh {fresh} after "
                "train() or eval()"
            )
        if held.shape[0] != batch:
            raise ValueError(
                f"cache: {what} holds a batch of {held.shape[0]}, this call has {batch}; use a fresh "
                f"{fresh} (or cache.reset()) for a new batch"
            )


class CacheFullError(ValueError):
    """A preallocated cache (``max_length=N``) cannot hold what a call asks it to keep."""


class TimeAxis:
    """A preallocated time axis: one buffer of ``capacity`` steps along ``dim``, a live slice of it.

    :meth:`append` copies new steps in place after the live ones, :meth:`drop_front` forgets the
    oldest (the view slides; nothing moves) and :meth:`view` is the live slice, a view of the buffer.
    When an append reaches the buffer's end the live steps are copied back to its front first, so a
    sliding window costs one copy of the window per ``capacity - window`` steps.
    """

    def __init__(self, first: Tensor, dim: int, capacity: int) -> None:
        shape = list(first.shape)
        shape[dim] = capacity
        self.buffer = first.new_zeros(shape)  # finite: a fixed-shape step reads (masked) unwritten slots
        self.dim, self.capacity, self.start, self.length = dim, capacity, 0, 0
        self.append(first)

    def view(self) -> Tensor:
        return self.buffer.narrow(self.dim, self.start, self.length)

    def fits(self, steps: int) -> bool:
        return self.length + steps <= self.capacity

    def append(self, new: Tensor) -> None:
        """Copy ``new`` after the live steps (:meth:`view` then includes it)."""
        steps = new.shape[self.dim]
        if not self.fits(steps):
            raise CacheFullError(f"{self.length} + {steps} steps exceed the capacity {self.capacity}")
        if self.start + self.length + steps > self.capacity:
            self._to_front()
        self.buffer.narrow(self.dim, self.start + self.length, steps).copy_(new)
        self.length += steps

    def drop_front(self, steps: int) -> None:
        self.start, self.length = self.start + steps, self.length - steps

    def keep(self, head: int, tail: int) -> None:
        """Keep the first ``head`` and the last ``tail`` live steps (StreamingLLM's sinks and recent)."""
        if self.length <= head + tail:
            return
        recent = self.view().narrow(self.dim, self.length - tail, tail).clone()  # regions may overlap
        self.buffer.narrow(self.dim, self.start + head, tail).copy_(recent)
        self.length = head + tail

    def _to_front(self) -> None:
        live = self.view().clone()  # source and destination may overlap
        self.start = 0
        self.buffer.narrow(self.dim, 0, self.length).copy_(live)


def check_in_place_write(owner: str, growing: str, what: str, held: Tensor | None, *new: Tensor) -> None:
    """Refuse what writing ``new`` in place into the preallocated buffers of ``owner`` (which now
    hold ``what`` like ``held``, or nothing yet) would get wrong: gradients, which autograd cannot
    carry through an in-place write, and another dtype, which ``copy_`` would cast silently.
    ``growing`` names the cache to use instead."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in new):
        raise ValueError(
            f"{owner} writes in place, which autograd cannot differentiate through: decode under "
            f"torch.no_grad() or torch.inference_mode(), or use {growing} (grows) to backpropagate "
            "through the cache"
        )
    if held is not None and held.dtype != new[0].dtype:
        raise ValueError(
            f"{owner} holds {held.dtype} {what} but this call writes {new[0].dtype}; keep one dtype "
            f"per cache, or use a fresh one"
        )


@dataclass(kw_only=True)
class KVCacheEntry(CacheStamp):
    """One layer's self- or cross-attention entry of a :class:`KVCache`."""

    k: Tensor  # [B, Hkv, T, D], keys after the encoding's rotation
    v: Tensor  # [B, Hkv, T, D]
    k_pos: Tensor  # [B or 1, T] int64
    padding: Tensor | None  # [B, T] bool, True = padding
    document_ids: Tensor | None = None  # [B, T] int64, the keys' documents
    context_key: ContextKey | None = None  # cross-attention: which context tensor the keys came from
    evicted: int = 0  # tokens dropped from the front (a windowed layer keeps what its window sees)
    # [B] int64: the real (unpadded) tokens among the evicted ones, once a padded key was evicted
    # (None: every evicted token was real); positions count the real tokens before each new one
    evicted_real: Tensor | None = None
    # [B] int64: what KVCache.shift_keys added to the positions of every later token (None: nothing)
    shift: Tensor | None = None
    token_state: Tensor | None = None  # [B, S, T]: an input-dependent bias's states of the keys (FoX)
    token_index: Tensor | None = None  # [T] int64: the keys' indices among all tokens seen
    finite: FiniteMark = field(default_factory=FiniteMark)  # set once every stored k and v is seen finite
    # KVCache(max_length=N): the buffers k, v and k_pos are views of (shared by the entries of one
    # layer's successive steps; each step's entry keeps its own views and finite mark)
    axes: dict[str, TimeAxis] | None = None

    def held(self) -> Tensor:
        return self.k

    def refresh_views(self) -> None:
        """Point ``k``, ``v`` and ``k_pos`` at the live part of the preallocated buffers."""
        for name, axis in self.axes.items():
            setattr(self, name, axis.view())

    # ------------------------------------------------ the buffers of KVCache(max_length=N), by position
    def buffers(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """The whole preallocated buffers of a ``KVCache(max_length=N)`` entry: keys and values
        ``[B, Hkv, N, D]`` and key positions ``[B, N]`` int64, whose slots ``first_slot`` to
        ``first_slot + T`` are the live ``k``, ``v``, ``k_pos`` (the other slots hold zeros or stale
        tokens); None for a growing cache, or a streaming one (it keeps no positions: they are those
        inside the cache). The entries of one layer's successive steps share them."""
        if self.axes is None or "k_pos" not in self.axes:
            return None
        return self.axes["k"].buffer, self.axes["v"].buffer, self.axes["k_pos"].buffer

    @property
    def first_slot(self) -> int:
        """The buffer slot of the first live key: 0 until a window slides the live part along the buffers."""
        return 0 if self.axes is None else self.axes["k"].start

    def write_at(self, slot: Tensor, k: Tensor, v: Tensor, k_pos: Tensor) -> None:
        """Write one token's key and value ``[B, Hkv, 1, D]`` and key position ``k_pos [B, 1]`` (int64)
        into buffer slot ``slot`` (a 0-d int64 tensor), in place (``index_copy_``). Shapes only are
        read, never ``slot``'s value, so a compiled graph serves every slot. The live part and the
        finite mark stay as they are: :meth:`set_length` records the tokens written. Refuses a
        growing entry, a write that needs gradients and another dtype than the buffers'."""
        buffers = self._buffers_for("write_at")
        check_in_place_write("KVCacheEntry.write_at", "KVCache()", "keys", buffers[0], k, v)
        index = slot.reshape(1)
        for buffer, new, dim in zip(buffers, (k, v, k_pos), (2, 2, 1), strict=True):
            buffer.index_copy_(dim, index, new)

    def set_length(self, length: int) -> None:
        """Make the ``length`` slots from :attr:`first_slot` on the live keys, values and positions
        (after :meth:`write_at`, or to forget the last tokens), and :meth:`mark_unchecked` them.
        Refuses a growing entry, a length past the buffers and an entry with per-key padding,
        document ids or token states (they would no longer match the keys)."""
        self._buffers_for("set_length")
        room = self.axes["k"].capacity - self.first_slot
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= room:
            raise ValueError(f"KVCacheEntry.set_length: length must be an int in [0, {room}], got {length!r}")
        if self.padding is not None or self.document_ids is not None or self.token_state is not None:
            raise ValueError(
                "KVCacheEntry.set_length: the entry holds padding, document ids or token states per key, "
                "which a new length would not match"
            )
        for axis in self.axes.values():
            axis.length = length
        self.refresh_views()
        self.mark_unchecked()

    def mark_unchecked(self) -> None:
        """Forget that the stored keys and values were seen finite (tokens written without a check):
        the next request that reads them tests every one for nan and inf again."""
        self.finite.finite = False

    def _buffers_for(self, method: str) -> tuple[Tensor, Tensor, Tensor]:
        buffers = self.buffers()
        if buffers is None:
            raise ValueError(
                f"KVCacheEntry.{method}: the entry has no preallocated buffers; use KVCache(max_length=N)"
            )
        return buffers

    def evict_with_keys(self, drop: int, evicted_before: int) -> None:
        """The padding and token states of the ``drop`` oldest keys leave with them (evicted after
        ``evicted_before`` earlier ones): every per-key field stays as long as the keys."""
        if self.token_state is not None and drop > 0:
            self.token_state, self.token_index = self.token_state[..., drop:], self.token_index[drop:]
        self.evict_padding(drop, evicted_before)

    def evict_padding(self, drop: int, evicted_before: int) -> None:
        """Drop the padding of the ``drop`` oldest keys (evicted with them, after ``evicted_before``
        earlier ones) and count their real tokens, so that positions still count every real token."""
        if self.padding is None or drop <= 0:
            return
        real = (~self.padding[:, :drop]).sum(dim=1)
        before = self.evicted_real if self.evicted_real is not None else torch.full_like(real, evicted_before)
        self.evicted_real = before + real
        self.padding = self.padding[:, drop:]


@dataclass(frozen=True, eq=False)
class ContextKey:
    """Which context tensor a cross-attention entry's keys came from, and its contents then.

    A normal tensor is identified without reading it: storage, shape, strides and its in-place
    version counter. A tensor made under ``torch.inference_mode`` counts no in-place writes, so a
    copy of it is kept and compared whole (as cheap as one read of the cached keys).
    """

    identity: tuple  # storage, shape, strides, device type
    version: int | None  # the in-place version; None for an inference tensor
    snapshot: Tensor | None  # an inference tensor's contents when the keys were made

    def matches(self, x: Tensor) -> bool:
        """Whether ``x`` is the same tensor with the same contents."""
        if self.identity != _identity(x) or x.is_inference() != (self.snapshot is not None):
            return False
        if self.snapshot is None:
            return x._version == self.version
        return torch.equal(x, self.snapshot)


def _identity(x: Tensor) -> tuple:
    return (x.data_ptr(), tuple(x.shape), x.stride(), x.device.type)


def context_key(x: Tensor) -> ContextKey:
    """The :class:`ContextKey` of ``x`` now."""
    if x.is_inference():
        return ContextKey(_identity(x), None, x.clone())
    return ContextKey(_identity(x), x._version, None)
