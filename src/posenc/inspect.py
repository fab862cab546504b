"""Helpers to inspect encodings outside an attention layer (CLI, plots, tests)."""

from __future__ import annotations

import torch

from .backends import AttentionRequest, available_backends, get_backend
from .base import PositionalEncoding
from .registry import build_for_layer, get_class

#: Layer sizes used when an encoding is inspected on its own.
EXAMPLE_LAYER = {"num_heads": 8, "head_dim": 16, "dim": 128}


def build_example(spec: str, num_heads: int = 8, head_dim: int = 16) -> PositionalEncoding:
    """Build ``spec`` for a layer of ``num_heads`` heads of size ``head_dim``.

    A bare name gets the class's ``example_options``; a spec with options uses exactly those.
    """
    from .registry import parse_spec

    name, raw = parse_spec(spec)
    extra = {} if raw else dict(get_class(name).example_options)
    return build_for_layer(spec, num_heads=num_heads, head_dim=head_dim, dim=num_heads * head_dim, **extra)


def runnable_backends(name: str, seq_len: int = 8, requires_grad: bool = False) -> list[str]:
    """Backends (in ``auto`` order) that can run encoding ``name`` in a small causal self-attention."""
    enc = build_example(name)
    b, h, d = 1, EXAMPLE_LAYER["num_heads"], EXAMPLE_LAYER["head_dim"]
    q = torch.zeros(b, h, seq_len, d, requires_grad=requires_grad)
    pos = torch.arange(seq_len)[None]
    request = AttentionRequest(q=q, k=q, v=q, encoding=enc, q_pos=pos, k_pos=pos, scale=d**-0.5, causal=True)
    return [name for name in available_backends() if not get_backend(name).reasons(request)]
