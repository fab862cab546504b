"""Position ids for training at the short length over a longer target: PoSE and CREAM.

Both train on sequences of the pre-trained length ``n`` tokens while giving them position ids that
reach a target ``N > n``, so that the model meets every relative distance of ``[0, N)`` without ever
attending over ``N`` tokens. The ids are a pure function of a few integer draws
(:func:`pose_position_ids`, :func:`cream_position_ids`); the samplers draw them from a
``torch.Generator`` (:func:`sample_pose_positions`, :func:`sample_cream_positions`).

PoSE (Zhu et al., ICLR 2024; dwzhu-pku/PoSE ``train_preprocess_function_pose``). The sequence is cut
into chunks; chunk ``i`` keeps its tokens' order and moves by a skip ``u_i`` with ``u_0 = 0`` and
``u_i ~ U{u_{i-1}, ..., N - n}``. With two chunks (the reference's only form) the first chunk's length
is ``U{1, ..., (n + 1) // 2}``; with more, the ``chunks - 1`` cut points are distinct and uniform over
``1..n-1`` (the paper's general form, which its code does not ship).

CREAM (Wu et al., NeurIPS 2024; bigai-nlco/CREAM ``CREAM``). With ``factor = N // n``, a head and a
tail of ``h`` tokens keep the first and the last ``h`` positions of the target window: ``0..h-1`` and
``factor·n - h .. factor·n - 1``. ``h`` is ``n // 3`` (relativity) or ``4·factor`` (continuity), each
with probability 1/2. The middle ``m = n - 2h`` tokens take consecutive positions ending at ``e``:
``r = floor(interp(u, Φ((x - μ)/σ), x))`` over ``x = linspace(2, 2·factor, 1000)``, ``μ = 1 + factor``,
``u ~ U[0, 1)`` (a Gaussian over ``r`` whose tails beyond ``[2, 2·factor]`` pile up at the ends, as
``np.interp`` clamps), then ``e ~ U{floor(h + (m - 1)·r/2), ..., floor(r·n/2) - h - 1}``.

Conventions here (posenc's harness, not the papers' corpora): only the positions change; the tokens
stay one contiguous example (the references also skip content of a longer text, which a synthetic
task has no room for). The reference draws CREAM's head choice once per 3000-example map batch; posenc
draws it once per training batch.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "CONTINUITY_HEAD",
    "cream_head",
    "cream_middle_end_range",
    "cream_position_ids",
    "cream_rate",
    "pose_position_ids",
    "sample_cream_positions",
    "sample_pose_positions",
]

#: CREAM's continuity head (and tail) length, in units of ``factor``: ``4·factor`` tokens.
CONTINUITY_HEAD = 4


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def pose_position_ids(length: int, target: int, cuts: list[int], skips: list[int]) -> Tensor:
    """PoSE's position ids ``[length]``: token ``t`` of chunk ``i`` sits at ``t + skips[i]``.

    ``cuts``: the first index of each chunk after the first (``0 < c_1 < c_2 < ... < length``);
    ``skips``: one per chunk, ``0 = skips[0] <= skips[1] <= ... <= target - length``.
    """
    _positive_int("length", length)
    _positive_int("target", target)
    if target < length:
        raise ValueError(f"target={target} must be at least length={length}")
    if len(skips) != len(cuts) + 1:
        raise ValueError(f"give one skip per chunk: {len(cuts) + 1} chunks, {len(skips)} skips")
    bounds = [0, *cuts, length]
    if any(a >= b for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cuts must increase strictly inside (0, {length}), got {cuts}")
    if skips[0] != 0 or any(a > b for a, b in itertools.pairwise(skips)) or skips[-1] > target - length:
        raise ValueError(
            f"skips must start at 0 and not decrease up to target - length = {target - length}, got {skips}"
        )
    ids = torch.arange(length)
    for start, end, skip in zip(bounds, bounds[1:], skips, strict=False):
        ids[start:end] += skip
    return ids


def sample_pose_positions(
    rows: int, length: int, target: int, chunks: int, generator: torch.Generator
) -> Tensor:
    """``[rows, length]`` PoSE position ids, each row's chunks and skips drawn from ``generator``
    (the module docstring gives the distributions)."""
    _positive_int("rows", rows)
    _positive_int("chunks", chunks)
    if chunks < 2:
        raise ValueError(f"pose: chunks must be at least 2 (one chunk is plain training), got {chunks}")
    if length < chunks:
        raise ValueError(f"pose: a {length}-token sequence cannot be cut into chunks={chunks}")
    spread = target - length
    out = []
    for _ in range(rows):
        if chunks == 2:
            cuts = [int(torch.randint(1, (length + 1) // 2 + 1, (), generator=generator))]
        else:
            cuts = sorted((torch.randperm(length - 1, generator=generator)[: chunks - 1] + 1).tolist())
        skips = [0]
        for _ in range(chunks - 1):
            skips.append(int(torch.randint(skips[-1], spread + 1, (), generator=generator)))
        out.append(pose_position_ids(length, target, cuts, skips))
    return torch.stack(out)


def cream_head(length: int, factor: int, relativity: bool) -> int:
    """The head (= tail) length: ``length // 3`` (relativity) or ``4·factor`` (continuity)."""
    return length // 3 if relativity else CONTINUITY_HEAD * factor


def cream_rate(uniform: float, factor: int, sigma: float) -> int:
    """CREAM's ``r`` in ``{2, ..., 2·factor}`` from ``u ∈ [0, 1)``: the inverse of the normal CDF
    ``Φ((x - (1 + factor)) / σ)`` tabulated on ``linspace(2, 2·factor, 1000)``, clamped at both ends
    and floored."""
    x = np.linspace(2, factor * 2, 1000)
    cdf = 0.5 * (1 + np.vectorize(math.erf)((x - (1 + factor)) / (sigma * math.sqrt(2))))
    return int(np.interp(uniform, cdf, x))


def cream_middle_end_range(length: int, factor: int, head: int, rate: int) -> tuple[int, int]:
    """The inclusive range ``(lo, hi)`` the middle's last position ``e`` is drawn from."""
    middle = length - 2 * head
    return int(head + (middle - 1) * (rate / 2)), rate * length // 2 - head - 1


def cream_position_ids(length: int, factor: int, head: int, end: int) -> Tensor:
    """CREAM's position ids ``[length]``: ``0..head-1``, then ``end - m + 1 .. end`` (``m = length - 2·head``),
    then ``factor·length - head .. factor·length - 1``."""
    middle = length - 2 * head
    if middle < 1:
        raise ValueError(f"cream: a head and tail of {head} tokens leave no middle in {length} tokens")
    if end - middle + 1 < head:
        raise ValueError(f"cream: the middle ending at {end} overlaps the head 0..{head - 1}")
    if end >= factor * length - head:
        raise ValueError(f"cream: the middle ending at {end} reaches the tail at {factor * length - head}")
    return torch.cat(
        [
            torch.arange(head),
            torch.arange(end - middle + 1, end + 1),
            torch.arange(factor * length - head, factor * length),
        ]
    )


def sample_cream_positions(
    rows: int, length: int, target: int, sigma: float, generator: torch.Generator
) -> Tensor:
    """``[rows, length]`` CREAM position ids over ``target`` positions; the head choice is drawn once
    for the batch, ``r`` and ``e`` once per row (the module docstring gives the distributions)."""
    _positive_int("rows", rows)
    factor = target // length
    if factor < 1:
        raise ValueError(f"cream: target={target} must be at least length={length}")
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"cream: sigma must be positive and finite, got {sigma!r}")
    relativity = bool(torch.randint(0, 2, (), generator=generator))
    head = cream_head(length, factor, relativity)
    if length - 2 * head < 1:
        raise ValueError(
            f"cream: {length}-token sequences are too short for the continuity head of 4·factor = {head} "
            f"tokens (factor {factor}); train at a longer length or extend by less"
        )
    out = []
    for _ in range(rows):
        rate = cream_rate(float(torch.rand((), generator=generator, dtype=torch.float64)), factor, sigma)
        lo, hi = cream_middle_end_range(length, factor, head, rate)
        end = int(torch.randint(lo, hi + 1, (), generator=generator))
        out.append(cream_position_ids(length, factor, head, end))
    return torch.stack(out)
