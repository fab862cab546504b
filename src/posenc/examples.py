"""Example encodings built outside a model, sized like a small attention layer.

:func:`build_example` is the one builder used by ``posenc show``, ``posenc plot``, the report's
encoding figures and the registry-wide tests, so they always look at the same encoding.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .backends import AttentionRequest, available_backends, backend_limits, get_backend
from .encodings.base import LayerContext, PositionalEncoding, TokenStates, token_states_function
from .encodings.registry import build_for_layer, get_class, options
from .encodings.spec import parse_spec
from .layers.attention import MultiheadAttention

__all__ = ["EXAMPLE_LAYER", "build_example", "runnable_backends"]

#: Layer sizes used when an encoding is inspected on its own.
EXAMPLE_LAYER = {"num_heads": 8, "head_dim": 16, "dim": 128}


def build_example(
    spec: str, num_heads: int = EXAMPLE_LAYER["num_heads"], head_dim: int = EXAMPLE_LAYER["head_dim"]
) -> PositionalEncoding:
    """Build ``spec`` on its own for a layer of ``num_heads`` heads of size ``head_dim``.

    Layer options written in the spec win over the arguments: ``"sinusoidal:dim=512"`` builds a
    512-wide table (``head_dim = dim // num_heads``), ``"alibi:num_heads=12"`` twelve heads. A bare
    name gets the class's ``example_options``; a spec with options gets the example values only of
    the required options it leaves out (``"sinusoidal2d:base=100"`` still gets an example
    ``grid_width``). ``ValueError`` names the option at fault.
    """
    name, raw = parse_spec(spec)
    extra = _example_options(name, raw)
    heads = _pop_int(name, raw, "num_heads", num_heads)
    if "head_dim" in raw:
        head_dim = _pop_int(name, raw, "head_dim", head_dim)
    elif "dim" in raw:
        head_dim = max(_pop_int(name, dict(raw), "dim", 0) // heads, 1)
    dim = _pop_int(name, raw, "dim", heads * head_dim)
    if heads < 1 or head_dim < 1 or dim < 1:
        raise ValueError(f"num_heads, head_dim and dim must be positive, got {heads}, {head_dim}, {dim}")
    rest = ",".join(f"{k}={v}" for k, v in raw.items())
    return build_for_layer(
        name + (":" + rest if rest else ""), num_heads=heads, head_dim=head_dim, dim=dim, **extra
    )


def _pop_int(name: str, raw: dict[str, str], key: str, default: int) -> int:
    """Pop layer option ``key`` from the raw spec options as an int (``default`` when absent)."""
    if key not in raw:
        return default
    value = raw.pop(key)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: option {key!r} must be an int, got {value!r}") from None


def _example_options(name: str, given: dict[str, str]) -> dict[str, Any]:
    """The class's example options that apply: all for a bare name, else the missing required ones."""
    examples = {k: v for k, v in get_class(name).example_options.items() if k not in LayerContext.SIZES}
    if not given:
        return examples
    required = {k for k, p in options(name).items() if p.default is inspect.Parameter.empty}
    return {k: v for k, v in examples.items() if k in required and k not in given}


def runnable_backends(name: str, seq_len: int = 8, requires_grad: bool = False) -> list[str]:
    """Backends (in ``auto`` order) that state no reason against encoding ``name`` in a causal
    self-attention of ``seq_len`` tokens (the example layer's sizes)."""
    return [
        backend
        for backend, reasons in backend_limits_by_name(name, seq_len, requires_grad).items()
        if not reasons
    ]


def backend_limits_by_name(name: str, seq_len: int, requires_grad: bool = False) -> dict[str, list[str]]:
    """Every backend's hard limits (:func:`~posenc.backends.backend_limits`; empty: it serves the call),
    in ``auto``'s order (:data:`posenc.backends.dispatch.PRIORITY`), for encoding ``name`` in a causal
    self-attention of ``seq_len`` tokens through an attention layer of the example sizes."""
    enc = build_example(name)
    b, h, d = 1, EXAMPLE_LAYER["num_heads"], EXAMPLE_LAYER["head_dim"]
    layer = MultiheadAttention(h * d, h, encoding=enc, causal=True)  # content kinds read its projections
    q = torch.zeros(b, h, seq_len, d, requires_grad=requires_grad)
    pos = torch.arange(seq_len)[None]
    states = None
    if enc.input_dependent:
        x = torch.zeros(b, seq_len, h * d, requires_grad=requires_grad)
        states = TokenStates.same_sequence(token_states_function(enc)(x, None, None))
    request = AttentionRequest.from_keywords(
        q=q,
        k=q,
        v=q,
        encoding=layer.encoding,
        q_pos=pos,
        k_pos=pos,
        scale=d**-0.5,
        causal=True,
        token_states=states,
        layer=layer,
    )
    return {backend: backend_limits(get_backend(backend), request) for backend in available_backends()}
