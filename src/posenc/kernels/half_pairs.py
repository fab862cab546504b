"""RoPE's half pairing (channel ``k`` with ``k + d_r/2``, HF's ``rotate_half``) as eager passes.

The reference form of the half pairing: :mod:`posenc.kernels.rope` runs it where the compiled loop
of :mod:`posenc.kernels.rope_native` does not serve, and that loop is checked against it bit for
bit when it loads. Per element, ``o1 = addcmul(x1·cos, x2, sin, value=-1)`` and
``o2 = addcmul(x2·cos, x1, sin)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rotate_half_pairs"]


def rotate_half_pairs(src: Tensor, dst: Tensor, cos: Tensor, sin: Tensor, half: int, inplace: bool) -> None:
    """Rotate ``src``'s ``2 * half`` channels (the last dimension) into ``dst`` (``inplace``: the same
    tensor) with ``cos``, ``sin`` tables broadcastable to ``[..., half]``."""
    x1, x2 = src.chunk(2, dim=-1)  # src and dst hold exactly the 2 * half rotated channels
    o1, o2 = dst.chunk(2, dim=-1)
    if inplace:
        first = x1.clone()  # small: one chunk
        o1.mul_(cos).addcmul_(x2, sin, value=-1.0)
        o2.mul_(cos).addcmul_(first, sin)
    else:
        torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1.0)
        torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
