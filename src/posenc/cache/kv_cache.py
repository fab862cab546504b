"""``posenc.KVCache`` and the rules every cache of posenc keeps.

* **Only the writer reads.** An entry carries a :class:`CacheStamp`: the layer that wrote it and
  the form of its keys (the q/k channel layout, whether the rotation was dropped). A reader that is
  another layer, has another batch or device, or whose form changed since, gets a ``ValueError``
  naming the writer, never keys it would misread. :class:`~posenc.layers.mla.LatentCache` entries carry
  the same stamp.
* **A windowed layer keeps ``W - 1`` keys** (:meth:`KVCache.trim_to_window`): the next query sees
  no older one. ``entry.evicted`` counts the rest, so positions continue.
* **StreamingLLM's retention** (``KVCache(recent_tokens=R, sink_tokens=S)``, Xiao et al. 2023):
  every layer keeps the first ``S`` and the last ``R`` tokens, positions are those inside the
  cache, and rotary keys are stored unrotated and rotated at each step.
* **A preallocated cache** (``KVCache(max_length=N)``) writes each step's keys, values and key
  positions in place into ``[B, Hkv, N, D]`` buffers (:class:`TimeAxis`) and hands the kernel views
  of them: no step concatenates the cache. A windowed layer's view slides along its buffer and is
  copied back to the front when it reaches the end (once every ``N - W + 1`` steps); StreamingLLM
  moves its recent tokens back behind the sinks. It equals the growing cache exactly. It writes in
  place, so it serves inference (``torch.no_grad``/``inference_mode``); gradients through cached
  keys need the growing cache.

``window`` is a layer's sliding-window mask only (:class:`~posenc.MultiheadAttention`); the
cache's retention is ``recent_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from ..encodings.base import FiniteMark, Kind, PositionalEncoding, TokenStates, token_states_function
from .entry import (
    CacheFullError,
    CacheStamp,
    CacheWriter,
    KVCacheEntry,
    TimeAxis,
    check_in_place_write,
    context_key,
    rotation_dropped,
)
from .slots import SlotState, fixed_shape_problems

__all__ = [
    "CacheFullError",
    "CacheStamp",
    "CacheWriter",
    "KVCache",
    "KVCacheEntry",
    "TimeAxis",
    "check_in_place_write",
    "context_key",
    "rotation_dropped",
    "token_states_with_cache",
    "window_retention",
]


class KVCache:
    """Keys, values, key positions and padding of past tokens, for incremental decoding.

    One object serves a whole model: each attention layer keeps its entries under its
    ``layer_idx``, one for self-attention and one for cross-attention. An entry records the layer
    that wrote it, and only that layer may read it (a layer that finds another layer's entry, a
    changed batch size or, in cross-attention, another context raises ``ValueError``). Queries of a
    decoding step get positions that continue from the cache (``past_len + arange(T)``, or from the
    padding mask or document ids when there are some).
    """

    def __init__(
        self,
        recent_tokens: int | None = None,
        sink_tokens: int = 0,
        *,
        max_length: int | None = None,
        **renamed: Any,
    ) -> None:
        """Args:
        recent_tokens: None (keep every token), or StreamingLLM (Xiao et al. 2023): every layer keeps
            the first ``sink_tokens`` tokens and the last ``recent_tokens`` ones, memory
            ``O(sink_tokens + recent_tokens)`` for any number of steps. Positions are those inside
            the cache (the paper's rule): cached keys are kept unrotated and rotary encodings
            rotate them at each step.
        sink_tokens: with ``recent_tokens``, the first tokens that are never evicted (attention sinks).
        max_length: None (the cache grows by concatenation), or the number of tokens each layer's
            preallocated ``[B, Hkv, max_length, D]`` buffers hold: every step is written in place
            and the kernel reads views. A layer without a window needs room for the prompt and every
            generated token; a windowed layer needs ``max_length >= window`` (a prompt longer than
            the buffer is attended whole, then its last ``window - 1`` keys are kept); StreamingLLM
            needs ``max_length > sink_tokens + recent_tokens``. Inference only: in-place writes
            cannot carry gradients through cached keys.
        """
        if "window" in renamed:
            raise TypeError(
                "KVCache: the StreamingLLM retention is recent_tokens= (the last tokens every layer keeps, "
                "beside sink_tokens); window= is a layer's sliding-window mask "
                "(MultiheadAttention(..., window=W)). Pass KVCache(recent_tokens=..., sink_tokens=...)"
            )
        if renamed:
            raise TypeError(f"KVCache got an unexpected keyword argument {next(iter(renamed))!r}")
        if recent_tokens is not None and (
            isinstance(recent_tokens, bool) or not isinstance(recent_tokens, int) or recent_tokens < 1
        ):
            raise ValueError(f"KVCache: recent_tokens must be a positive int or None, got {recent_tokens!r}")
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"KVCache: sink_tokens must be an int >= 0, got {sink_tokens!r}")
        if sink_tokens and recent_tokens is None:
            raise ValueError(
                "KVCache: sink_tokens needs recent_tokens (StreamingLLM keeps sinks plus the recent tokens)"
            )
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        ):
            raise ValueError(f"KVCache: max_length must be a positive int or None, got {max_length!r}")
        if max_length is not None and recent_tokens is not None and max_length <= sink_tokens + recent_tokens:
            raise ValueError(
                f"KVCache: max_length={max_length} must exceed sink_tokens + recent_tokens = "
                f"{sink_tokens + recent_tokens}: the buffer holds the kept tokens plus the new one"
            )
        self.recent_tokens, self.sink_tokens, self.max_length = recent_tokens, sink_tokens, max_length
        self._entries: dict[tuple[int, bool], KVCacheEntry] = {}
        self._slots: dict[int, SlotState] = {}  # inside fixed_shapes(): layer_idx -> its slot state

    @property
    def streaming(self) -> bool:
        """True for a StreamingLLM cache (the recent tokens plus sink tokens)."""
        return self.recent_tokens is not None

    def get(self, layer_idx: int = 0, *, cross: bool = False) -> KVCacheEntry | None:
        return self._entries.get((layer_idx, cross))

    def length(self, layer_idx: int = 0, *, cross: bool | None = None) -> int:
        """Number of cached tokens of layer ``layer_idx`` (0 when empty).

        ``cross=None``: the self-attention entry, or the cross-attention one when there is no other.
        """
        entry = self.get(layer_idx, cross=bool(cross))
        if entry is None and cross is None:
            entry = self.get(layer_idx, cross=True)
        return 0 if entry is None else entry.k.shape[2]

    def __len__(self) -> int:
        selfs = sorted(idx for idx, cross in self._entries if not cross)
        return self.length(selfs[0], cross=False) if selfs else 0

    def update(self, layer_idx: int, entry: KVCacheEntry, *, cross: bool = False) -> None:
        self._entries[(layer_idx, cross)] = entry

    def reset(self) -> None:
        if self._slots:
            raise ValueError("KVCache.reset() inside fixed_shapes(): leave the with-block first")
        self._entries.clear()

    # ------------------------------------------------------------------ fixed shapes (posenc.cache.slots)
    @contextmanager
    def fixed_shapes(self) -> Iterator[KVCache]:
        """Decode in fixed shapes (:mod:`posenc.cache.slots`): inside the block, a one-token call of a
        layer writes its key and value at the next slot of the preallocated buffers and attends over
        every slot (the unwritten ones masked), so ``torch.compile(fullgraph=True)`` of the layer or
        the model traces one graph for every step. Needs ``KVCache(max_length=N)`` holding a prompt
        of every self-attention layer (run it through the layer or model first); leaving the block
        records the tokens written. Other calls, :meth:`reset` and a nested block are refused."""
        self._start_fixed_shapes()
        try:
            yield self
        finally:
            states, self._slots = self._slots, {}
            for state in states.values():
                state.entry.set_length(state.length())

    def _start_fixed_shapes(self) -> None:
        if self.max_length is None or self.streaming:
            raise ValueError(
                "KVCache.fixed_shapes() needs a preallocated, non-streaming cache: KVCache(max_length=N)"
            )
        if self._slots:
            raise ValueError("KVCache.fixed_shapes(): the cache is already inside a fixed_shapes() block")
        entries = {idx: entry for (idx, cross), entry in self._entries.items() if not cross}
        if not entries:
            raise ValueError(
                "KVCache.fixed_shapes(): the cache holds no self-attention entry; run the prompt "
                "through the layer or model first"
            )
        for idx, entry in entries.items():
            problems = fixed_shape_problems(entry)
            if problems:
                raise ValueError(
                    f"KVCache.fixed_shapes(): the entry of layer_idx={idx} cannot be decoded in fixed "
                    f"shapes: {'; '.join(problems)}; decode it with the growing path (outside the block)"
                )
        self._slots = {idx: SlotState.start(entry) for idx, entry in entries.items()}

    def slot_state(self, layer_idx: int) -> SlotState | None:
        """Layer ``layer_idx``'s :class:`~posenc.cache.slots.SlotState` inside :meth:`fixed_shapes`, else None."""
        return self._slots.get(layer_idx) if self._slots else None

    @property
    def in_fixed_shapes(self) -> bool:
        """Whether a :meth:`fixed_shapes` block is open."""
        return bool(self._slots)

    def rewind(self, length: int) -> None:
        """Inside :meth:`fixed_shapes`: forget every layer's tokens after the first ``length`` (a
        rejected speculative draft, a benchmark's next repeat); the next step writes slot ``length``
        at the position after the token before it."""
        if not self._slots:
            raise ValueError("KVCache.rewind() works inside fixed_shapes() only")
        for idx, state in self._slots.items():
            written = state.length()
            if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= written:
                raise ValueError(
                    f"KVCache.rewind: length must be an int in [0, {written}] (layer_idx={idx}), got {length!r}"
                )
            state.continue_from(length)

    def __repr__(self) -> str:
        layers = sorted({idx for idx, _ in self._entries})
        static = "" if self.max_length is None else f", max_length={self.max_length}"
        return f"KVCache(layers={layers}, length={len(self)}{static})"

    # ------------------------------------------------------------------ the rules
    def read(
        self,
        layer: CacheWriter,
        *,
        cross: bool,
        batch: int,
        device: torch.device,
        context: Tensor | None = None,
    ) -> KVCacheEntry | None:
        """``layer``'s entry, after checking that ``layer`` wrote it, in its current form, for this
        batch on ``device`` (and, in cross-attention, from the same ``context`` tensor); None if empty."""
        if self._slots:
            raise ValueError(
                f"cache: layer_idx={layer.layer_idx} was called inside KVCache.fixed_shapes() with more "
                "than one token per row, another argument, or a layer the block cannot serve; inside "
                "the block a call is one new token of each row and nothing else: leave the block first"
            )
        entry = self.get(layer.layer_idx, cross=cross)
        if entry is None:
            return None
        kind = "cross-attention" if cross else "self-attention"
        entry.check_reader(
            layer,
            what=f"the {kind} entry of layer_idx={layer.layer_idx}",
            batch=batch,
            device=device,
            fresh="KVCache",
        )
        if cross and context is not None and not _same_context(entry, context):
            raise ValueError(
                f"cache: the cross-attention entry of layer_idx={layer.layer_idx} holds the keys of another "
                "context; pass the same context tensor, or reset the cache for a new one"
            )
        return entry

    def write(
        self,
        layer: CacheWriter,
        entry: KVCacheEntry,
        *,
        cross: bool = False,
        previous: KVCacheEntry | None = None,
    ) -> None:
        """Store ``entry`` as ``layer``'s, stamped with the layer and the form of its keys
        (``previous``: the entry, read by ``layer``, that this one extends)."""
        entry.stamp(layer, previous)
        if self.streaming and not cross:
            entry.rotation_dropped = None  # stored unrotated: every step rotates them in its own mode
        self.update(layer.layer_idx, entry, cross=cross)

    def append(
        self,
        layer: CacheWriter,
        entry: KVCacheEntry | None,
        k: Tensor,
        v: Tensor,
        k_pos: Tensor,
        *,
        padding: Tensor | None,
        document_ids: Tensor | None,
        states: TokenStates | None,
        window: int | None = None,
        chunk: int | None = None,
        prefix: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Every key, value and key position so far: ``entry``'s (``layer``'s, read; or None), then the
        new ``k``, ``v`` ``[B, Hkv, T, D]`` at ``k_pos``. They are stored as ``layer``'s entry with
        the keys' ``padding``, ``document_ids`` and token ``states`` (all ``[B, past + T]``).

        ``window``, ``chunk``, ``prefix`` (whether the call has a ``prefix_len``): the layer's mask,
        from which the cache decides what the stored entry keeps (:func:`window_retention`); a
        windowed entry is trimmed after this call (:meth:`trim_to_window`), and a preallocated cache
        stores only the kept keys when the buffer cannot hold them all. The returned keys are every
        key this call attends to."""
        keep_last = window_retention(window, chunk=chunk, documents=document_ids is not None, prefix=prefix)
        if self.max_length is not None:
            k, v, k_pos, stored = self._append_in_place(entry, k, v, k_pos, keep_last)
        else:
            if entry is not None:
                batch = k.shape[0]
                k = torch.cat([entry.k, k], dim=2)
                v = torch.cat([entry.v, v], dim=2)
                k_pos = torch.cat([entry.k_pos.expand(batch, -1), k_pos.expand(batch, -1)], dim=1)
            stored = KVCacheEntry(k=k, v=v, k_pos=k_pos, padding=padding)
            stored.evicted = 0 if entry is None else entry.evicted
        stored.padding, stored.document_ids = padding, document_ids
        stored.evicted_real = None if entry is None else entry.evicted_real
        stored.shift = None if entry is None else entry.shift
        if states is not None:
            stored.token_state, stored.token_index = states.k, states.k_index
        # A full buffer kept only the window's keys (k holds every key): the rest leave with them.
        stored.evict_with_keys(k.shape[2] - stored.k.shape[2], 0 if entry is None else entry.evicted)
        self.write(layer, stored, previous=entry)
        if keep_last is not None:
            self.trim_to_window(layer.layer_idx, keep_last + 1)
        return k, v, k_pos

    def _append_in_place(
        self, entry: KVCacheEntry | None, k: Tensor, v: Tensor, k_pos: Tensor, keep_last: int | None
    ) -> tuple[Tensor, Tensor, Tensor, KVCacheEntry]:
        """:meth:`append` into the preallocated buffers: ``(k, v, k_pos, stored entry)``."""
        self._check_in_place(entry, k, v)
        k_pos = k_pos.expand(k.shape[0], -1)
        steps, evicted = k.shape[2], 0 if entry is None else entry.evicted
        axes = None if entry is None else entry.axes
        if axes is not None and axes["k"].fits(steps):
            for name, new in (("k", k), ("v", v), ("k_pos", k_pos)):
                axes[name].append(new)
            stored = KVCacheEntry(k=k, v=v, k_pos=k_pos, padding=None, evicted=evicted, axes=axes)
            stored.refresh_views()
            return stored.k, stored.v, stored.k_pos, stored
        if entry is not None:  # past + new exceed the buffer: a windowed layer keeps its tail
            k = torch.cat([entry.k, k], dim=2)
            v = torch.cat([entry.v, v], dim=2)
            k_pos = torch.cat([entry.k_pos, k_pos], dim=1)
        total = k.shape[2]
        if total > self.max_length:
            if keep_last is not None and keep_last + 1 > self.max_length:
                raise ValueError(
                    f"KVCache(max_length={self.max_length}) cannot hold a decode step of a layer with "
                    f"window={keep_last + 1} ({keep_last} cached keys plus the new one) once {total} tokens "
                    "are seen; pass max_length >= the window"
                )
            if keep_last is None:
                raise CacheFullError(
                    f"KVCache(max_length={self.max_length}) is full: this layer has {total - steps} tokens "
                    f"cached and the call adds {steps}; pass a max_length that holds the prompt and every "
                    "generated token, or use KVCache() (grows)"
                )
            kept = slice(total - keep_last, total)
            evicted += total - keep_last
        else:
            kept = slice(0, total)
        axes = {
            "k": TimeAxis(k[:, :, kept], 2, self.max_length),
            "v": TimeAxis(v[:, :, kept], 2, self.max_length),
            "k_pos": TimeAxis(k_pos[:, kept], 1, self.max_length),
        }
        stored = KVCacheEntry(k=k, v=v, k_pos=k_pos, padding=None, evicted=evicted, axes=axes)
        stored.refresh_views()
        if kept.stop - kept.start == total:  # the kernel reads the buffers, as every later step will
            return stored.k, stored.v, stored.k_pos, stored
        return k, v, k_pos, stored

    def _check_in_place(self, entry: KVCacheEntry | None, k: Tensor, v: Tensor) -> None:
        held = None if entry is None or entry.axes is None else entry.k
        check_in_place_write(f"KVCache(max_length={self.max_length})", "KVCache()", "keys", held, k, v)

    def shift_keys(self, layer: CacheWriter, delta: int | Tensor, *, start: int = 0) -> None:
        """Move ``layer``'s cached keys from slot ``start`` on to their positions plus ``delta`` (an int,
        or ``[B]`` int64 per sequence), and every later token's default position with them: context
        shifting and a prefix reused at another offset (:func:`posenc.cache.shift.shift_keys`)."""
        from .shift import shift_keys  # (the shift reads the encoding's rotation; kept beside the cache)

        if self._slots:
            raise ValueError("KVCache.shift_keys inside fixed_shapes(): leave the with-block first")
        if self.streaming:
            raise ValueError(
                "KVCache.shift_keys: a streaming KVCache (recent_tokens=...) assigns positions inside the "
                "cache at every step; there is nothing to shift"
            )
        shift_keys(self, layer, delta, start=start)

    def checked_keys(
        self, layer_idx: int, previous: KVCacheEntry | None, *, cross: bool
    ) -> tuple[int, FiniteMark | None]:
        """``(known_finite_keys, finite_mark)`` for the request of ``layer_idx``'s step, once its keys
        are in the cache: how many leading keys and values are known finite, and the mark of the
        entry now stored, which the request sets when it finds all its keys and values finite.

        Self-attention: the request's keys are ``previous``'s (the entry before this step's append)
        followed by the new ones; cross-attention: the stored entry's. A streaming cache rotates
        its keys anew at each step, so none of them is known finite."""
        stored = self.get(layer_idx, cross=cross)
        if stored is None or (self.streaming and not cross):
            return 0, None
        known = stored if cross else previous
        return (known.k.shape[2] if known is not None and known.finite.finite else 0), stored.finite

    def trim_to_window(self, layer_idx: int, window: int) -> None:
        """A windowed layer keeps only the ``window - 1`` newest keys: the next query sees no older one."""
        entry = self.get(layer_idx)
        if entry is None:
            return
        drop = entry.k.shape[2] - (window - 1)
        if drop <= 0:
            return
        if entry.axes is not None:  # the views slide along the buffers; nothing moves
            for axis in entry.axes.values():
                axis.drop_front(drop)
            entry.refresh_views()
        else:
            entry.k, entry.v = entry.k[:, :, drop:], entry.v[:, :, drop:]
            entry.k_pos = entry.k_pos[:, drop:]
        entry.evict_with_keys(drop, entry.evicted)
        entry.evicted += drop

    def append_streaming(
        self,
        layer: CacheWriter,
        entry: KVCacheEntry | None,
        k: Tensor,
        v: Tensor,
        states: TokenStates | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """StreamingLLM: ``(k, v, q_pos, k_pos)``, every key and value so far (``entry``'s, read, then
        the new unrotated ``k``, ``v`` ``[B, Hkv, T, D]``) at positions inside the cache (``q_pos [1,
        T]``, ``k_pos [1, past + T]``). Stores what the cache keeps of them: the first
        ``sink_tokens`` and the last ``recent_tokens`` (and their token states), unrotated."""
        past = 0 if entry is None else entry.k.shape[2]
        q_len = k.shape[2]
        q_pos = torch.arange(past, past + q_len, device=k.device)[None]
        k_pos = torch.arange(past + q_len, device=k.device)[None]
        kept = self._kept(past + q_len)
        if self.max_length is not None:
            k, v, stored = self._stream_in_place(entry, k, v, k_pos[:, kept])
        else:
            if entry is not None:
                k, v = torch.cat([entry.k, k], dim=2), torch.cat([entry.v, v], dim=2)
            stored = KVCacheEntry(k=k[:, :, kept], v=v[:, :, kept], k_pos=k_pos[:, kept], padding=None)
        if states is not None:
            stored.token_state, stored.token_index = states.k[..., kept], states.k_index[kept]
        self.write(layer, stored, previous=entry)
        return k, v, q_pos, k_pos

    def _stream_in_place(
        self, entry: KVCacheEntry | None, k: Tensor, v: Tensor, kept_pos: Tensor
    ) -> tuple[Tensor, Tensor, KVCacheEntry]:
        """StreamingLLM into the preallocated buffers: every key and value so far, and the entry
        whose views are the kept ones (the sinks, then the recent tokens, at ``kept_pos``)."""
        self._check_in_place(entry, k, v)
        axes = None if entry is None else entry.axes
        if axes is None or not axes["k"].fits(k.shape[2]):  # a prompt longer than the buffer
            if entry is not None:
                k, v = torch.cat([entry.k, k], dim=2), torch.cat([entry.v, v], dim=2)
            kept = self._kept(k.shape[2])
            axes = {name: TimeAxis(t[:, :, kept], 2, self.max_length) for name, t in (("k", k), ("v", v))}
        else:
            axes["k"].append(k)
            axes["v"].append(v)
            k, v = axes["k"].view(), axes["v"].view()
            if k.shape[2] > self.sink_tokens + self.recent_tokens:  # eviction moves what the kernel reads
                k, v = k.clone(), v.clone()
                for axis in axes.values():
                    axis.keep(self.sink_tokens, self.recent_tokens)
        stored = KVCacheEntry(k=k, v=v, k_pos=kept_pos, padding=None, axes=axes)
        stored.refresh_views()
        return k, v, stored

    def _kept(self, length: int) -> slice | Tensor:
        """Indices of the tokens StreamingLLM keeps out of ``length``."""
        sinks, recent = self.sink_tokens, self.recent_tokens
        if length <= sinks + recent:
            return slice(None)
        return torch.cat([torch.arange(sinks), torch.arange(length - recent, length)])

    def check_streaming_layer(
        self,
        encoding: PositionalEncoding,
        *,
        window: int | None,
        chunk: int | None,
        **given: Any,
    ) -> None:
        """Refuse what a streaming cache cannot honour: ``given`` positions, padding, documents or
        prefixes (it assigns positions inside the cache), an absolute encoding (cached keys cannot
        shed it) and a layer with a window or chunk of its own."""
        for name, value in given.items():
            if value is not None:
                raise ValueError(
                    f"{name}: a streaming KVCache (recent_tokens=...) assigns positions inside the cache; "
                    f"it takes no {name}"
                )
        if encoding.kind is Kind.ABSOLUTE and not encoding.shift_invariant:
            raise ValueError(
                f"a streaming KVCache re-assigns positions, but {encoding.name!r} adds absolute positions "
                "to the layer input, which cached keys cannot shed; use a rotary, bias or relative encoding"
            )
        if window is not None or chunk is not None:
            raise ValueError("a streaming KVCache serves layers without window or chunk of their own")


def window_retention(window: int | None, *, chunk: int | None, documents: bool, prefix: bool) -> int | None:
    """How many keys a layer's cache entry keeps after a call: ``window - 1`` for a sliding window
    (the next query sees no older key), None to keep every key.

    A window combined with chunks keeps every key (chunks count keys from the start of the
    sequence), and so does one with packed documents or a prefix (their masks read every key).
    Padding does not stop the trim: padded keys are evicted with the others, and the evicted real
    tokens are counted so positions continue (``KVCacheEntry.evicted_real``).
    """
    if window is None or chunk is not None or documents or prefix:
        return None
    return window - 1


def token_states_with_cache(
    encoding: PositionalEncoding, x: Tensor, entry: KVCacheEntry | None, padding: Tensor | None
) -> TokenStates | None:
    """An input-dependent bias's states (FoX): the new tokens' (queries, from ``x [B, T, E]``) after
    the cached ones, which the entry keeps beside its keys (keys: all). ``padding [B, past + T]``
    covers every key. None for position-only encodings."""
    if not encoding.input_dependent:
        return None
    q_len = x.shape[1]
    new_padding = None if padding is None else padding[:, padding.shape[1] - q_len :]
    previous = None if entry is None else entry.token_state
    new = token_states_function(encoding)(x, previous, new_padding)
    if entry is None or previous is None:
        return TokenStates.same_sequence(new)
    cached = entry.token_index
    start = int(cached[-1]) + 1 if cached.numel() else 0  # only the order of indices matters
    q_index = torch.arange(start, start + q_len, device=x.device)
    keys = torch.cat([previous, new], dim=-1)
    return TokenStates(q=new, k=keys, q_index=q_index, k_index=torch.cat([cached, q_index]))


def _same_context(entry: KVCacheEntry, context: Tensor) -> bool:
    """Whether ``entry``'s cross-attention keys were made from ``context`` as it is now."""
    return entry.context_key is not None and entry.context_key.matches(context)
