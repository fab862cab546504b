"""Key positions of a swapped model's layers, kept with the HF cache object they belong to.

A swapped layer's keys sit in HF's cache unrotated, so the layer must know each cached key's position
(HF's ``position_ids`` of the call that wrote it: left padding makes them differ per row). It keeps
them per layer beside the cache, indexed by the layer's *stream*: the tokens ever written to that
cache layer, counted as HF's ``get_seq_length(layer_idx)`` counts them (a full layer's keys, a
sliding layer's ``cumulative_length``). At each call the cache's own length places the keys the
attention was handed: they are the tail of the stream, ``[seen - past, seen)`` with ``seen`` the
length before this call and ``past`` the cached keys handed over. So a ``crop`` (assisted and
speculative generation roll back a rejected draft with one), a ``reset``, or a sliding window that
drops its oldest keys is read off the cache, never assumed. Keys whose positions were not kept (a
static cache's empty slots, a cache written by another model) are refused, naming the cache.

HF's static cache (``StaticLayer``: slot ``s`` holds the token its stream wrote ``s``-th, and the
attention gets every slot, empty ones hidden by HF's mask) keeps the positions in a tensor of its
own instead, ``[B or 1, max_cache_len]``, written at this call's slots with ``index_copy_`` as HF
writes the keys: no value is read in Python, so ``torch.compile(fullgraph=True)`` traces it whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

#: The names HF's attention modules take their KV cache under (5.24: ``cache``; before: ``past_key_values``).
CACHE_NAMES = ("cache", "past_key_values")


def remember_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a swapped layer's attention: the KV cache of this call (None without one),
    so :func:`swapped_positions` keeps the key positions with the cache they belong to."""
    cache = next((kwargs[name] for name in CACHE_NAMES if kwargs.get(name) is not None), None)
    if cache is None and args:  # passed by position: bind to find it
        import inspect

        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        cache = next((bound[name] for name in CACHE_NAMES if bound.get(name) is not None), None)
    module.__dict__["_posenc_call_cache"] = cache


@dataclass
class _StreamPositions:
    """The key positions of one cache layer's stream indices ``start, start + 1, ...``."""

    start: int
    positions: Tensor  # [B or 1, n] int64
    layout: int = 0  # the layer's q/k channel layout when written (switch_rope_pairing_ bumps it)

    @property
    def stop(self) -> int:
        return self.start + self.positions.shape[1]

    def covers(self, first: int, stop: int) -> bool:
        return self.start <= first <= stop <= self.stop

    def take(self, first: int, stop: int) -> Tensor:
        return self.positions[:, first - self.start : stop - self.start]


def _key_positions_store(cache: Any) -> dict[int, _StreamPositions]:
    """The key positions posenc keeps with an HF cache object, per layer index."""
    store = getattr(cache, "_posenc_key_positions", None)
    if store is None:
        store = {}
        cache._posenc_key_positions = store
    return store


def _describe(cache: Any, layer: int) -> str:
    """``"DynamicCache (layer 1: DynamicSlidingWindowLayer)"``: the cache named for an error."""
    layers = getattr(cache, "layers", None)
    try:
        return f"{type(cache).__name__} (layer {layer}: {type(layers[layer]).__name__})"
    except (TypeError, IndexError, KeyError):
        return type(cache).__name__


def _seen_tokens(cache: Any, layer: int) -> int:
    """The length of the layer's stream: the tokens HF's cache counts as written to it (this call's
    included: the attention runs after the cache update)."""
    get_seq_length = getattr(cache, "get_seq_length", None)
    try:
        return int(get_seq_length(layer))  # type: ignore[misc]
    except (AttributeError, TypeError, ValueError, NotImplementedError, IndexError, KeyError) as err:
        raise ValueError(
            f"swap_encoding: the model's cache, {_describe(cache, layer)}, does not tell its length "
            f"(get_seq_length({layer}): {type(err).__name__}: {err}); a swapped model places its cached "
            "keys by the cache's length: decode with HF's DynamicCache"
        ) from err


def _held_keys(cache: Any, layer: int) -> int | None:
    """How many keys the cache layer holds after this call (a crop can bring back no others), or None
    when the layer does not show them (then every position is kept)."""
    try:
        return int(cache.layers[layer].keys.shape[-2])
    except (AttributeError, TypeError, IndexError, KeyError):
        return None


def _rows(*positions: Tensor) -> int:
    """The batch all ``[B or 1, n]`` position tensors broadcast to; a refusal when they cannot."""
    rows = [p.shape[0] for p in positions]
    if len(set(rows) - {1}) > 1:
        raise ValueError(
            f"swap_encoding: the cached keys' positions have {rows[0]} rows and this call's {rows[-1]}: "
            "a swapped model's cache keeps its batch (beam search reorders it in place)"
        )
    return max(rows)


def _cat(*positions: Tensor) -> Tensor:
    rows = _rows(*positions)
    return torch.cat([p.expand(rows, -1) for p in positions], 1)


def _static_layer(cache: Any, layer: int) -> Any:
    """The cache's layer ``layer`` when it is HF's plain ``StaticLayer`` (not a sliding or indexed
    one: their slots are not the stream's indices), else None."""
    try:
        found = cache.layers[layer]
    except (AttributeError, TypeError, IndexError, KeyError):
        return None
    return found if type(found).__name__ == "StaticLayer" and hasattr(found, "cumulative_length") else None


def _static_key_positions(static: Any, q_pos: Tensor, k_len: int) -> Tensor:
    """The positions of a static layer's first ``k_len`` slots: this call's ``q_pos [B or 1, Tq]``
    written at its slots (the last ``Tq`` of ``cumulative_length``, which HF's update has already
    advanced), earlier calls' where they wrote. Unwritten slots hold 0 (HF's mask hides them)."""
    rows, q_len = q_pos.shape
    buffer = static.__dict__.get("_posenc_key_positions")
    size = max(int(getattr(static, "max_cache_len", k_len)), k_len)
    if buffer is None or buffer.shape != (rows, size) or buffer.device != q_pos.device:
        buffer = torch.zeros(rows, size, dtype=torch.long, device=q_pos.device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(buffer)  # a graph reads it in place, as HF's keys
        static.__dict__["_posenc_key_positions"] = buffer
    slots = torch.arange(q_len, device=q_pos.device) + (static.cumulative_length.to(q_pos.device) - q_len)
    buffer.index_copy_(1, slots, q_pos)
    return buffer[:, :k_len]


def swapped_positions(
    module: nn.Module, position_ids: Tensor | None, q_len: int, k_len: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Query positions from HF's ``position_ids`` and key positions: the cached keys' (kept with the
    cache object this call uses, so two caches, or an uncached call between two steps, never mix;
    placed by the cache's length, so a cropped or sliding cache gets its own keys' positions)
    followed by the queries'."""
    cache = module.__dict__.get("_posenc_call_cache")
    if (
        position_ids is None
        and cache is None
        and q_len == k_len
        and getattr(module, "is_causal", True) is False
    ):
        # A bidirectional encoder's layer (BERT) gets position_ids only when its caller gave them; else
        # its tokens sit at 0 .. T-1, as its embeddings count them (BertEmbeddings' position_ids).
        position_ids = torch.arange(q_len, device=device)[None]
    if position_ids is None:
        raise ValueError("swap_encoding: the model did not pass position_ids to its attention")
    if position_ids.dim() > 2:  # never guessed as M-RoPE's axes (a packed batch's restarts stay 2-D)
        raise ValueError(
            f"swap_encoding: position_ids has shape {tuple(position_ids.shape)}; a swapped layer reads one "
            "position per token, [B, T] or [T]; M-RoPE's axis ids [3, B, T] go to its encoding's "
            "position_ids(ids) context manager, not to the model"
        )
    q_pos = position_ids.to(device).long()
    if q_pos.dim() == 1:
        q_pos = q_pos[None]
    past = k_len - q_len
    layer = getattr(module, "layer_idx", 0)
    static = _static_layer(cache, layer)
    if static is not None:
        return q_pos, _static_key_positions(static, q_pos, k_len)
    if cache is None:
        if past:
            raise ValueError(
                f"swap_encoding: the attention got {past} cached keys without a cache object to place them; "
                "a swapped model decodes with HF's DynamicCache"
            )
        return q_pos, q_pos
    seen = _seen_tokens(cache, layer) - q_len  # the stream's length before this call
    first = seen - past  # the stream index of the first cached key handed over
    store = _key_positions_store(cache)
    kept = store.get(layer)
    layout = int(module.__dict__.get("posenc_qk_layout", 0))
    if past and kept is not None and kept.layout != layout:
        raise ValueError(
            f"swap_encoding: layer {layer}'s cached keys were written before posenc.hf.switch_rope_pairing_ "
            "permuted its q/k rows, so they are in the old channel layout; start a fresh cache after switching"
        )
    if past == 0:
        k_pos = q_pos
    elif first >= 0 and kept is not None and kept.covers(first, seen):
        k_pos = _cat(kept.take(first, seen).to(device), q_pos)
    else:
        if first < 0:
            found = f"counts only {max(seen, 0)} tokens before this call (empty slots of a static cache?)"
        else:
            known = "none" if kept is None else f"those of tokens {kept.start} to {kept.stop - 1}"
            found = f"places them at tokens {first} to {seen - 1}, and layer {layer} kept the positions of {known}"
        raise ValueError(
            f"swap_encoding: the attention got {past} cached keys, but the cache, {_describe(cache, layer)}, "
            f"{found}; a swapped model decodes with HF's DynamicCache (crops and sliding windows included) "
            "from a fresh start (no static cache, no cache written by another model)"
        )
    # Keep the positions a later call may hand back: every key the layer holds after this call (a crop
    # keeps a prefix of them; a sliding layer recording its past holds more than it hands over), and
    # at least this call's. A layer that does not show its keys keeps every position it has.
    held = _held_keys(cache, layer)
    wanted = 0 if held is None else seen + q_len - held  # the first stream index worth keeping
    if kept is not None and wanted < first and kept.covers(max(wanted, kept.start), seen):
        start = max(wanted, kept.start)
        store[layer] = _StreamPositions(start, _cat(kept.take(start, seen).to(device), q_pos), layout)
    else:
        store[layer] = _StreamPositions(first, k_pos, layout)
    return q_pos, k_pos
