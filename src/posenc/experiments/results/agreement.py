"""How far ours agrees with a published order: Kendall's τ with an interval across seeds.

``τ`` is Kendall's tau-b (Kendall 1945), the variant that allows ties, between two scorings of
the same items::

    τ_b = (C - D) / sqrt((P - T_x) · (P - T_y))

over the ``P = n(n-1)/2`` pairs of items: ``C`` the pairs both scorings order the same way, ``D``
the pairs they order oppositely, ``T_x`` (``T_y``) the pairs tied in ``x`` (``y``); a pair tied in
one scoring is neither concordant nor discordant. It is 1 when the orders agree, -1 when one is
the other reversed, and undefined (None here) when either scoring ties every pair. It is what
``scipy.stats.kendalltau`` computes by default.

The interval across seeds is a percentile bootstrap over seeds (:func:`seed_bootstrap`): each
task's seeds are resampled with replacement, independently per task, and the statistic recomputed
on every resample. With a few seeds the resamples are few enough to enumerate: every multiset of
``n`` seeds drawn from ``n`` has probability ``n! / (∏ counts!) / n^n``, so the bootstrap
distribution is computed exactly (no random draws); past :data:`EXACT_LIMIT` combinations a
seeded Monte Carlo bootstrap of :data:`DRAWS` resamples stands in. With three seeds a percentile
bootstrap spans about what the seeds show and no more (it is narrow, see :mod:`.stats`): read the
interval as "how much the order moves when seeds are swapped", not as a calibrated 95% interval.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["DRAWS", "EXACT_LIMIT", "BootstrapInterval", "kendall_tau", "seed_bootstrap", "seed_resamples"]

#: Above this many resample combinations (product over tasks), :func:`seed_bootstrap` draws.
EXACT_LIMIT = 20_000
#: Monte Carlo resamples past :data:`EXACT_LIMIT`.
DRAWS = 4_000


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Kendall's tau-b of the paired scorings ``x`` and ``y`` (None when undefined: fewer than two
    items, or every pair tied in ``x`` or in ``y``)."""
    if len(x) != len(y):
        raise ValueError(f"kendall_tau: {len(x)} values against {len(y)}")
    concordant = discordant = tied_x = tied_y = pairs = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        pairs += 1
        dx, dy = x[i] - x[j], y[i] - y[j]
        if dx == 0 or dy == 0:
            tied_x += dx == 0
            tied_y += dy == 0
        elif (dx > 0) == (dy > 0):
            concordant += 1
        else:
            discordant += 1
    denominator = math.sqrt((pairs - tied_x) * (pairs - tied_y))
    return (concordant - discordant) / denominator if denominator else None


def seed_resamples(seeds: Sequence[int]) -> list[tuple[float, dict[int, int]]]:
    """Every resample of ``seeds`` with replacement as ``(probability, {seed: times drawn})``, one
    entry per multiset (``n! / ∏ counts! / n^n`` each; they sum to 1)."""
    n = len(seeds)
    resamples = []
    for multiset in itertools.combinations_with_replacement(sorted(seeds), n):
        counts = Counter(multiset)
        ways = math.factorial(n) // math.prod(math.factorial(c) for c in counts.values())
        resamples.append((ways / n**n, dict(counts)))
    return resamples


@dataclass(frozen=True)
class BootstrapInterval:
    """The percentile interval of a statistic over seed resamples, and how it was obtained."""

    low: float
    high: float
    #: "exact bootstrap over seeds (N resamples)" or "Monte Carlo bootstrap over seeds (N draws)".
    method: str
    #: Probability of the resamples on which the statistic was undefined (left out).
    undefined: float = 0.0


def seed_bootstrap(
    seeds: dict[str, Sequence[int]],
    statistic: Callable[[dict[str, dict[int, int]]], float | None],
    level: float = 0.95,
    exact_limit: int = EXACT_LIMIT,
    draws: int = DRAWS,
) -> BootstrapInterval | None:
    """The percentile interval of ``statistic`` over resamples of each task's ``seeds``
    (``{task: seeds}``, resampled independently per task). ``statistic`` gets ``{task: {seed:
    times drawn}}`` and returns a value or None (undefined on that resample; left out). None when
    every task has one seed (no resample differs) or the statistic is never defined."""
    if not seeds or all(len(s) < 2 for s in seeds.values()):
        return None
    tasks = list(seeds)
    per_task = [seed_resamples(seeds[task]) for task in tasks]
    combinations = math.prod(len(options) for options in per_task)
    values: list[tuple[float, float]] = []
    undefined = 0.0
    if combinations <= exact_limit:
        method = f"exact bootstrap over seeds ({combinations} distinct resamples, weighted)"
        for combo in itertools.product(*per_task):
            weight = math.prod(w for w, _ in combo)
            value = statistic({task: counts for task, (_, counts) in zip(tasks, combo)})
            if value is None:
                undefined += weight
            else:
                values.append((value, weight))
    else:
        method = f"Monte Carlo bootstrap over seeds ({draws} draws)"
        rng = random.Random(0)
        for _ in range(draws):
            resample = {
                task: dict(Counter(rng.choices(list(seeds[task]), k=len(seeds[task])))) for task in tasks
            }
            value = statistic(resample)
            if value is None:
                undefined += 1 / draws
            else:
                values.append((value, 1 / draws))
    if not values:
        return None
    total = sum(w for _, w in values)
    values.sort()
    tail = (1 - level) / 2

    def quantile(q: float) -> float:
        cumulative = 0.0
        for value, weight in values:
            cumulative += weight / total
            if cumulative >= q - 1e-12:
                return value
        return values[-1][0]

    return BootstrapInterval(quantile(tail), quantile(1 - tail), method, undefined)
