"""PoSE's and CREAM's training position ids against their reference code, restated here.

PoSE: dwzhu-pku/PoSE ``train_preprocess_function_pose`` (two chunks): ``rt1 = randint(1, (n + 1) // 2)``
tokens keep positions ``0..rt1-1``, the rest move by ``rt = randint(0, N - n)``. CREAM: bigai-nlco/CREAM
``CREAM``: a head and a tail of ``n // 3`` or ``4·factor`` tokens at the two ends of ``[0, factor·n)``,
the middle ending at ``end_id``, drawn after a clamped Gaussian ``rand_factor``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import scipy.special as sp
import torch
from scipy import stats

from posenc.experiments.extension.positions import (
    cream_head,
    cream_middle_end_range,
    cream_position_ids,
    cream_rate,
    pose_position_ids,
    sample_cream_positions,
    sample_pose_positions,
)


def _reference_pose(n: int, target: int, rt1: int, rt: int) -> list[int]:
    pos_ids = torch.arange(n)
    pos_ids[:rt1] += 0
    pos_ids[rt1:] += rt
    return pos_ids.tolist()


@pytest.mark.parametrize(("n", "target"), [(1, 1), (2, 5), (7, 20), (10, 10)])
def test_pose_ids_equal_the_reference_for_every_draw(n, target):
    for rt1 in range(1, (n + 1) // 2 + 1):
        for rt in range(target - n + 1):
            cuts = [rt1] if rt1 < n else []
            skips = [0, rt] if rt1 < n else [0]
            assert pose_position_ids(n, target, cuts, skips).tolist() == _reference_pose(n, target, rt1, rt)


def test_pose_sampler_draws_the_reference_distribution():
    """Two chunks: the first chunk's length is uniform over 1..(n+1)//2 and the skip over 0..N-n."""
    n, target, rows = 9, 30, 6000
    ids = sample_pose_positions(rows, n, target, 2, torch.Generator().manual_seed(0))
    jumps = ids.diff(dim=1) - 1  # one jump per row: where the second chunk starts, and by how much
    first = (jumps != 0).int().argmax(dim=1) + 1
    skip = jumps.sum(dim=1)
    first = torch.where(skip == 0, torch.full_like(first, -1), first)  # a zero skip hides the cut
    lengths = first[first > 0].numpy()
    counts = np.bincount(lengths, minlength=(n + 1) // 2 + 1)[1:]
    assert len(counts) == (n + 1) // 2
    assert stats.chisquare(counts).pvalue > 1e-3
    skips = np.bincount(skip.numpy(), minlength=target - n + 1)
    assert len(skips) == target - n + 1
    assert stats.chisquare(skips).pvalue > 1e-3


@pytest.mark.parametrize("chunks", [2, 3, 5])
def test_pose_positions_increase_and_cover_the_target(chunks):
    n, target = 12, 40
    ids = sample_pose_positions(4000, n, target, chunks, torch.Generator().manual_seed(chunks))
    assert bool((ids.diff(dim=1) >= 1).all())
    assert int(ids.min()) == 0 and int(ids.max()) == target - 1
    assert set(ids.flatten().tolist()) == set(range(target))


def test_pose_refuses_what_it_cannot_cut():
    with pytest.raises(ValueError, match="chunks"):
        sample_pose_positions(1, 3, 10, 4, torch.Generator())
    with pytest.raises(ValueError, match="at least 2"):
        sample_pose_positions(1, 3, 10, 1, torch.Generator())
    with pytest.raises(ValueError, match="skips"):
        pose_position_ids(5, 8, [2], [0, 4])


def _reference_cream(n: int, factor: int, relativity: bool, uniform: float, end_draw, sigma: float = 3.0):
    """bigai-nlco/CREAM's ``CREAM`` for one example, its random draws given."""
    head_len = n // 3 if relativity else 4 * factor
    tail_len = head_len
    len_chunk = n - head_len - tail_len
    pos_ids_1 = torch.arange(0, head_len)
    pos_ids_3 = torch.arange(factor * n - tail_len, factor * n)
    mu = 1 + factor
    x = np.linspace(2, factor * 2, 1000)
    cdf = 0.5 * (1 + sp.erf((x - mu) / (sigma * np.sqrt(2))))
    rand_factor = np.interp(uniform, cdf, x).astype(int)
    lo = int(head_len + ((len_chunk - 1) * (rand_factor / 2)))
    hi = int((rand_factor / 2) * n) - tail_len - 1
    end_id = end_draw(lo, hi)
    pos_ids_2 = torch.arange(end_id - (len_chunk - 1), end_id + 1)
    return int(rand_factor), (lo, hi), torch.cat([pos_ids_1, pos_ids_2, pos_ids_3]).tolist()


@pytest.mark.parametrize(("n", "factor"), [(48, 2), (66, 4), (100, 3)])
@pytest.mark.parametrize("relativity", [True, False])
def test_cream_ids_equal_the_reference_for_given_draws(n, factor, relativity):
    head = cream_head(n, factor, relativity)
    for uniform in np.linspace(0.0, 0.999, 37):
        for pick in (lambda lo, hi: lo, lambda lo, hi: hi, lambda lo, hi: (lo + hi) // 2):
            rate, bounds, want = _reference_cream(n, factor, relativity, float(uniform), pick)
            assert cream_rate(float(uniform), factor, 3.0) == rate
            assert cream_middle_end_range(n, factor, head, rate) == bounds
            assert cream_position_ids(n, factor, head, pick(*bounds)).tolist() == want


def test_cream_sampler_draws_the_reference_distribution():
    """The middle's last position over many rows: posenc's sampler against the reference's own
    draws (Python's random and numpy's, seeded), binned and compared by a chi-square test."""
    n, factor, rows = 40, 4, 4000
    generator = torch.Generator().manual_seed(1)
    ours = torch.cat([sample_cream_positions(50, n, factor * n, 3.0, generator) for _ in range(rows // 50)])
    rng, np_rng = random.Random(2), np.random.default_rng(3)
    theirs = []
    for _ in range(rows // 50):
        relativity = rng.randint(0, 1) == 0
        for _ in range(50):
            uniform = float(np_rng.random())
            theirs.append(_reference_cream(n, factor, relativity, uniform, rng.randint)[2])
    theirs = torch.tensor(theirs)
    middle_end = lambda ids: ids[:, n - cream_head(n, factor, True) - 1]  # noqa: E731 the relativity rows' middle end
    ours_rel = ours[ours[:, n // 3] != n // 3]  # not contiguous past the head: a relativity row or a jump
    assert abs(len(ours_rel) - len(theirs[theirs[:, n // 3] != n // 3])) < 0.15 * rows
    edges = np.linspace(0, factor * n, 9)
    a = np.histogram(middle_end(ours).numpy(), edges)[0]
    b = np.histogram(middle_end(theirs).numpy(), edges)[0]
    keep = (a + b) > 0
    assert stats.chi2_contingency(np.stack([a[keep], b[keep]])).pvalue > 1e-3


def test_cream_refuses_a_length_too_short_for_its_continuity_head():
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="too short"):
        for _ in range(20):  # the head choice is a coin: continuity comes up
            sample_cream_positions(1, 16, 64, 3.0, generator)
    with pytest.raises(ValueError, match="sigma"):
        sample_cream_positions(1, 40, 80, float("nan"), generator)
