"""The attention-pattern tests' shared pieces (windows, chunks, packed documents, prefix LM as layer
options): the layer size, an example layer with its zero tables randomised, float64, and weighted
gradients."""

from __future__ import annotations

import torch

import posenc
from posenc.examples import build_example

HEADS, HEAD_DIM = 2, 8


EMBED = HEADS * HEAD_DIM


NAMES = posenc.available()


def _layer(name: str, *, causal: bool = True, dtype=torch.float64, **options) -> posenc.MultiheadAttention:
    enc = build_example(name, num_heads=HEADS, head_dim=HEAD_DIM)
    torch.manual_seed(1)
    layer = posenc.MultiheadAttention(EMBED, HEADS, encoding=enc, causal=causal, **options)
    with torch.no_grad():
        for param in layer.encoding.parameters():
            if param.numel() and bool((param == 0).all()):
                param.normal_(0.0, 0.5)
    return layer.to(dtype).eval()


def _grads(out: torch.Tensor, inputs) -> list[torch.Tensor]:
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
