"""The decode caches: :class:`KVCache` (:mod:`.kv_cache`), the entry one layer keeps in it
(:mod:`.entry`), and the keys a cache carries transformed for PaTH (:mod:`.carried_keys`).
"""

from .kv_cache import (
    CacheFullError,
    CacheStamp,
    CacheWriter,
    KVCache,
    KVCacheEntry,
    TimeAxis,
    check_in_place_write,
    context_key,
    rotation_dropped,
    token_states_with_cache,
    window_retention,
)

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
