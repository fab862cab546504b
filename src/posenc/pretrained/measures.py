"""What ``posenc inspect`` measures on a trained model's positional weights: pure functions, no state.

Each takes tensors read from a checkpoint (a position table, a bucket table, captured queries and
keys, a rotary embedding's inverse frequencies) and returns float64 tensors; the reading and the
page are :mod:`posenc.viz.inspection`'s.

* Absolute tables ``[P, D]``: :func:`cosine_matrix` (the banded figure of a learned table),
  :func:`row_norms`, :func:`cosine_by_offset` (the band's mean profile), and the two fixed sinusoids
  a table is compared with, :func:`sinusoid_table` (Vaswani et al.'s interleaved one and Whisper's
  sin | cos halves).
* Bucketed biases (T5, MPNet): :func:`bias_by_distance` (a ``[buckets, heads]`` table read at each
  relative distance through its bucket ids) and :func:`bucket_edges` (where a new bucket starts).
* RoPE: :func:`pair_norms` (the norm of each rotated pair of a query or key, Barbero et al. 2024,
  "Round and round we go! What makes Rotary Positional Encodings useful?") and :func:`wavelengths`
  (``2π / θ_k``, in tokens).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "bias_by_distance",
    "bucket_edges",
    "cosine_by_offset",
    "cosine_matrix",
    "pair_norms",
    "row_norms",
    "sinusoid_table",
    "wavelengths",
]


def row_norms(table: Tensor) -> Tensor:
    """The Euclidean norm of each row of ``table`` ``[P, D]``: ``[P]`` float64."""
    return table.double().norm(dim=-1)


def cosine_matrix(table: Tensor) -> Tensor:
    """``C[p, q] = cos(table[p], table[q])`` of a ``[P, D]`` table: ``[P, P]`` float64.

    A row of norm zero (a padding row) has cosine 0 with every row, itself included, instead of NaN.
    """
    rows = table.double()
    norms = rows.norm(dim=-1, keepdim=True)
    unit = torch.where(norms > 0, rows / norms.clamp_min(1e-300), torch.zeros_like(rows))
    return unit @ unit.T


def cosine_by_offset(cosine: Tensor) -> Tensor:
    """The mean of ``cosine[p, p + d]`` over ``p``, for ``d = 0 .. P - 1`` (``[P]``, float64): how the
    band of :func:`cosine_matrix` falls off with the distance between two positions."""
    size = cosine.shape[-1]
    return torch.stack([torch.diagonal(cosine, offset=d).double().mean() for d in range(size)])


def sinusoid_table(
    length: int, dim: int, layout: Literal["interleaved", "halves"], max_timescale: float = 10000.0
) -> Tensor:
    """A fixed sinusoidal position table ``[length, dim]`` (float64; ``dim`` even).

    * ``"interleaved"`` (Vaswani et al. 2017): ``T[p, 2i] = sin(p / s^(2i/dim))``,
      ``T[p, 2i + 1] = cos(p / s^(2i/dim))``, ``s = max_timescale``.
    * ``"halves"`` (Whisper's ``sinusoids``): ``T[p] = [sin(p·w) | cos(p·w)]`` with the ``dim / 2``
      frequencies ``w_i = exp(-i·ln(s) / (dim/2 - 1))``, from 1 down to ``1/s`` inclusive.
    """
    if dim % 2 or dim < 4:
        raise ValueError(f"sinusoid_table: dim must be even and at least 4, got {dim}")
    half = dim // 2
    positions = torch.arange(length, dtype=torch.float64)[:, None]
    if layout == "halves":
        rates = torch.exp(-math.log(max_timescale) / (half - 1) * torch.arange(half, dtype=torch.float64))
        angles = positions * rates[None]
        return torch.cat([angles.sin(), angles.cos()], dim=1)
    if layout == "interleaved":
        rates = max_timescale ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = positions * rates[None]
        return torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(length, dim)
    raise ValueError(f"sinusoid_table: layout must be 'interleaved' or 'halves', got {layout!r}")


def bias_by_distance(table: Tensor, buckets: Tensor) -> Tensor:
    """The bias each head adds at each relative distance: ``table[buckets[n], h]`` as ``[H, N]``
    float64, for a bucket table ``[num_buckets, H]`` and the bucket ids ``[N]`` of ``N`` distances."""
    return table.double()[buckets.long()].T.contiguous()


def bucket_edges(distances: Tensor, buckets: Tensor) -> Tensor:
    """The distances at which a new bucket starts, moving away from 0 (``[E]`` int64, ascending).

    ``distances`` ``[N]`` are consecutive integers around 0 and ``buckets`` ``[N]`` their bucket ids.
    On the positive side an edge is a ``d > 0`` whose bucket differs from that of ``d - 1``; on the
    negative side a ``d < 0`` whose bucket differs from that of ``d + 1``.
    """
    d = distances.long()
    b = buckets.long()
    changed = b[1:] != b[:-1]
    positive = d[1:][changed & (d[1:] > 0)]
    negative = d[:-1][changed & (d[:-1] < 0)]
    return torch.cat([negative, positive]).sort().values


def pair_norms(x: Tensor, rotary_dim: int, pairing: Literal["half", "interleaved"] = "half") -> Tensor:
    """The norm of each rotated pair of ``x`` ``[..., D]``: ``[..., rotary_dim / 2]`` float64.

    RoPE rotates ``rotary_dim / 2`` pairs of channels, pair ``k`` by the angle ``position·θ_k``; the
    rotation keeps each pair's norm, so the norm of pair ``k`` of a query or key is what frequency
    ``k`` carries of it. ``"half"`` (HF's ``rotate_half``): pair ``k`` is channels ``(k, k +
    rotary_dim/2)``; ``"interleaved"`` (llama.cpp, GPT-J): ``(2k, 2k + 1)``. Channels past
    ``rotary_dim`` (partial rotary) are not rotated and not counted.
    """
    if rotary_dim % 2 or not 0 < rotary_dim <= x.shape[-1]:
        raise ValueError(f"pair_norms: rotary_dim must be even and in (0, {x.shape[-1]}], got {rotary_dim}")
    rotated = x[..., :rotary_dim].double()
    half = rotary_dim // 2
    if pairing == "half":
        first, second = rotated[..., :half], rotated[..., half:]
    elif pairing == "interleaved":
        first, second = rotated[..., 0::2], rotated[..., 1::2]
    else:
        raise ValueError(f"pair_norms: pairing must be 'half' or 'interleaved', got {pairing!r}")
    return torch.sqrt(first**2 + second**2)


def wavelengths(inv_freq: Tensor) -> Tensor:
    """Each pair's wavelength in tokens, ``2π / θ_k``, from the inverse frequencies ``θ`` ``[P]`` (float64)."""
    return 2 * math.pi / inv_freq.double()
