"""Shared by the reliability tests: the small layer most cases use, and the sizes of a tiny experiment."""

from __future__ import annotations

import torch

import posenc

E, H = 16, 2


def _layer(encoding="rope", **kw):
    torch.manual_seed(0)
    return posenc.MultiheadAttention(E, H, encoding, **kw).eval()


TINY_RUN = dict(d_model=16, num_layers=1, num_heads=2, d_ff=16, batch_size=4, warmup=1, eval_examples=3)
