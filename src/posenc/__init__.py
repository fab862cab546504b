"""posenc: positional encodings for Transformers, exact, with one attention layer for all of them.

Examples:
    >>> import posenc
    >>> enc = posenc.build("t5", num_heads=8, num_buckets=32, max_distance=128, bidirectional=True)
    >>> attn = posenc.MultiheadAttention(512, 8, encoding="rope:base=500000", causal=True)
"""

from __future__ import annotations

from typing import Any

from . import functional
from .backends import use_backend
from .cache.kv_cache import KVCache
from .encodings.base import (
    AbsoluteEncoding,
    BiasEncoding,
    ContentEncoding,
    Kind,
    LayerContext,
    PositionalEncoding,
    RotaryEncoding,
)
from .encodings.registry import available, build, get_class, register
from .encodings.rope_pairing import switch_rope_pairing_
from .layers.attention import MultiheadAttention
from .layers.mla import LatentCache, MultiLatentAttention

__version__ = "0.1.0"

__all__ = [
    "AbsoluteEncoding",
    "BiasEncoding",
    "ContentEncoding",
    "KVCache",
    "Kind",
    "LatentCache",
    "LayerContext",
    "MultiLatentAttention",
    "MultiheadAttention",
    "PositionalEncoding",
    "RotaryEncoding",
    "TransformerLM",
    "available",
    "build",
    "functional",
    "get_class",
    "register",
    "switch_rope_pairing_",
    "use_backend",
]


def __getattr__(name: str) -> Any:
    # The model module is imported lazily so that `import posenc` stays light.
    if name in ("TransformerLM", "TransformerEncoder"):
        from .layers import model

        return getattr(model, name)
    raise AttributeError(f"module 'posenc' has no attribute {name!r}")
