"""The decode caches: :class:`KVCache` (:mod:`.kv_cache`), the entry one layer keeps in it
(:mod:`.entry`), and the keys a cache carries transformed for PaTH (:mod:`.carried_keys`).
"""

# The face hands on :mod:`.kv_cache`'s public names, listed once, in its ``__all__``.
from .kv_cache import *  # noqa: F403
from .kv_cache import __all__  # noqa: F401
