"""Key positions of a swapped model's layers, kept with the HF cache object they belong to."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

#: The names HF's attention modules take their KV cache under (5.24: ``cache``; before: ``past_key_values``).
CACHE_NAMES = ("cache", "past_key_values")


def remember_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a swapped layer's attention: the KV cache of this call (None without one),
    so :func:`_swapped_positions` keeps the key positions with the cache they belong to."""
    cache = next((kwargs[name] for name in CACHE_NAMES if kwargs.get(name) is not None), None)
    if cache is None and args:  # passed by position: bind to find it
        import inspect

        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        cache = next((bound[name] for name in CACHE_NAMES if bound.get(name) is not None), None)
    module.__dict__["_posenc_call_cache"] = cache


def _key_positions_store(cache: Any) -> dict[int, Tensor]:
    """The key positions posenc keeps with an HF cache object, per layer index."""
    store = getattr(cache, "_posenc_key_positions", None)
    if store is None:
        store = {}
        cache._posenc_key_positions = store
    return store


def swapped_positions(
    module: nn.Module, position_ids: Tensor | None, q_len: int, k_len: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Query positions from HF's ``position_ids`` and key positions: the cached keys' (kept with the
    cache object this call uses, so two caches, or an uncached call between two steps, never mix)
    followed by the queries'."""
    if position_ids is None:
        raise ValueError("swap_encoding: the model did not pass position_ids to its attention")
    q_pos = position_ids.to(device).long()
    if q_pos.dim() == 1:
        q_pos = q_pos[None]
    past = k_len - q_len
    cache = module.__dict__.get("_posenc_call_cache")
    layer = getattr(module, "layer_idx", 0)
    previous = None if cache is None else _key_positions_store(cache).get(layer)
    if past == 0:
        k_pos = q_pos
    elif previous is not None and previous.shape[1] >= past:
        # A sliding-window cache keeps the newest keys only: the last ``past`` positions.
        batch = max(previous.shape[0], q_pos.shape[0])
        k_pos = torch.cat(
            [previous[:, previous.shape[1] - past :].expand(batch, -1), q_pos.expand(batch, -1)], 1
        )
    else:
        had = "none" if previous is None else previous.shape[1]
        raise ValueError(
            f"swap_encoding: the attention got {past} cached keys but the cache remembers the positions of "
            f"{had}; a swapped model decodes with HF's dynamic cache from a fresh start (no static cache)"
        )
    if cache is not None:
        _key_positions_store(cache)[layer] = k_pos
    return q_pos, k_pos
