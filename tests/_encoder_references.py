"""Written-out references for the BERT and MPNet tests (``tests/hf/test_encoders.py``,
``tests/test_real_encoders.py``): T5's bidirectional bucket, the paper's ALiBi slopes and bias, and
HF's eager mask form with a bias in it. Plain Python and torch, nothing of posenc's."""

from __future__ import annotations

import math

import torch


def t5_bucket(r: int, num_buckets: int = 32, max_distance: int = 128) -> int:
    """T5's bidirectional bucket of ``r = key - query`` (mesh-tf's ``_relative_position_bucket``,
    written out): half the buckets per direction, keys after the query in the upper half, the first
    ``half // 2`` distances exact, then log-spaced up to ``max_distance``."""
    half = num_buckets // 2
    base, n = (half if r > 0 else 0), abs(r)
    exact = half // 2
    if n < exact:
        return base + n
    return base + min(
        half - 1, exact + int(math.log(n / exact) / math.log(max_distance / exact) * (half - exact))
    )


def unreached_buckets(num_buckets: int = 32, max_distance: int = 128) -> set[int]:
    """The buckets no relative position falls in (every ``|r|`` past ``max_distance`` saturates)."""
    reach = 40 * max_distance
    return set(range(num_buckets)) - {
        t5_bucket(r, num_buckets, max_distance) for r in range(-reach, reach + 1)
    }


def alibi_slopes(heads: int) -> list[float]:
    """The paper's ``get_slopes`` (Press et al. 2022): ``2^(-8h/n)`` for a power of two ``n``; else the
    slopes of the power of two below, then every other slope of the one above."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(heads).is_integer():
        return power_of_two(heads)
    closest = 2 ** math.floor(math.log2(heads))
    return power_of_two(closest) + power_of_two(2 * closest)[0::2][: heads - closest]


def symmetric_alibi(heads: int, length: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """ALiBi for an encoder, ``-m_h·|i - j|`` ``[H, L, L]`` (x-transformers' symmetric form)."""
    slopes = torch.tensor(alibi_slopes(heads), dtype=torch.float64)
    pos = torch.arange(length, dtype=torch.float64)
    return (-slopes[:, None, None] * (pos[None, :, None] - pos[None, None, :]).abs()).to(dtype)


def with_padding(bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HF's eager mask form with ``bias [H, L, L]`` in it: ``[B, H, L, L]``, padded keys (``mask == 0``)
    at the dtype's minimum."""
    hidden = (mask == 0)[:, None, None, :]
    return bias[None].expand(mask.shape[0], -1, -1, -1).masked_fill(hidden, torch.finfo(bias.dtype).min)
