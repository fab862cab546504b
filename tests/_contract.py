"""The contract tests' shared pieces: the registered names, the layer size, the example encoding and
layer of a name (tests/test_contract.py, and the decode, cache and kind tests that run every
registered encoding)."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.examples import build_example

NAMES = posenc.available()
HEADS, HEAD_DIM = 2, 16
EMBED = HEADS * HEAD_DIM


def make_encoding(name: str, *, causal: bool = True):
    """The example encoding; without a causal mask, with the class's ``noncausal_options`` (ALiBi symmetric)."""
    cls = posenc.get_class(name)
    try:
        enc = build_example(name, num_heads=HEADS, head_dim=HEAD_DIM)
        if not causal and enc.causal_only and cls.noncausal_options:
            options = {**enc.config(), **cls.noncausal_options}
            enc = posenc.encodings.registry.build_for_layer(
                name,
                num_heads=HEADS,
                head_dim=HEAD_DIM,
                dim=EMBED,
                **{k: v for k, v in options.items() if k not in ("num_heads", "head_dim", "dim")},
            )
    except ValueError as err:  # pragma: no cover - a message for encoding authors
        pytest.fail(f"{name}: cannot build for a {HEADS}x{HEAD_DIM} layer ({err}); set example_options")
    if not causal and enc.causal_only:
        pytest.skip(f"{name} is defined for causal attention only")
    return enc


def make_layer(name: str, *, causal: bool = True, dtype=torch.float32, **kwargs) -> posenc.MultiheadAttention:
    enc = make_encoding(name, causal=causal)
    layer = posenc.MultiheadAttention(EMBED, HEADS, encoding=enc, causal=causal, **kwargs)
    _randomize(layer)
    return layer.to(dtype).eval()


def _randomize(module: torch.nn.Module) -> None:
    """Give zero-initialised tables (CoPE, DeBERTa biases) random values so tests can see them."""
    with torch.no_grad():
        for param in module.encoding.parameters():
            if param.numel() and bool((param == 0).all()):
                param.normal_(0.0, 0.5)


def _x(batch: int, length: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(batch, length, EMBED, dtype=dtype)


def nan_hook(step: list[int], at: int):
    """A forward hook that puts a nan into the new token's projection at decode step ``at``."""

    def hook(module, inputs, out):
        if step[0] != at:
            return None
        out = out.clone()
        out[:, -1, 3] = float("nan")
        return out

    return hook
