"""The near/far split's test pieces (tests/backends/test_near_far.py, tests/encodings/test_offers.py): the registered BIAS encodings that declare a far constant or separable terms, and an encoding's example for a causal or bidirectional layer with random tables."""

from __future__ import annotations

import torch

import posenc
from posenc.encodings.base import Kind
from posenc.examples import build_example

HEADS, DIM = 2, 8


def _declaring():
    """Registered BIAS encodings whose example declares a far constant or separable terms."""
    found = []
    pos = torch.arange(4)[None]
    for name in posenc.available():
        enc = build_example(name, num_heads=HEADS, head_dim=DIM)
        declared = enc.near_far() if enc.kind is Kind.BIAS else None
        if declared is not None and (
            declared.far_constant_beyond is not None or declared.separable(pos, pos)
        ):
            found.append(name)
    return found


DECLARING = _declaring()


def _encoding(name: str, causal: bool, dtype, **options):
    """The example of ``name`` for a causal or bidirectional layer (with ``options`` on top)."""
    enc = build_example(name, num_heads=HEADS, head_dim=DIM)
    if not causal and enc.causal_only:
        options = {**enc.noncausal_options, **options}
    if "bidirectional" in enc.config():
        options = {"bidirectional": not causal, **options}
    if options:
        spec = name + ":" + ",".join(f"{k}={v}" for k, v in options.items())
        enc = build_example(spec, num_heads=HEADS, head_dim=DIM)
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(0.0, 0.5)  # distinct table entries, so a wrong bucket shows
    return enc.to(dtype)
