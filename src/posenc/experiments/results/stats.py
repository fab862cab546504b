"""Student's t intervals for the few seeds an experiment runs (no scipy: the quantile is computed here).

With ``n`` per-seed values ``x`` (or per-seed differences of two rows), the interval of their mean is
``mean(x) ± t_{(1+level)/2, n-1} · s / √n`` with ``s`` the sample standard deviation (``n - 1`` in
the denominator). It holds its level for normal values at any ``n >= 2``; the percentile bootstrap
it replaces spans about the smallest to the largest value at ``n = 3`` and covers the mean far less
than 95% of the time (``tests/reliability/test_results.py`` measures both by simulation).

The quantile ``t_{p, df}`` inverts the distribution function
``P(T <= t) = 1 - I_{df/(df+t²)}(df/2, 1/2) / 2`` for ``t >= 0``, where ``I_x(a, b)`` is the
regularized incomplete beta function, evaluated by its continued fraction (modified Lentz, as in
Numerical Recipes §6.4) and inverted by bisection to machine precision.

The paired tests (:func:`paired_t`, :func:`mcnemar_exact`) and Holm's step-down correction
(:func:`holm`) decide a study's comparisons, where every variant scores the same windows and the same
prompts (:mod:`posenc.experiments.study.paired`):

* **paired t** on differences ``d_i = a_i - b_i``: ``t = mean(d) / (s_d / √n)``, two-sided
  ``p = 2 P(T_{n-1} > |t|) = I_{df/(df+t²)}(df/2, 1/2)``, interval ``mean(d) ± t_{0.975, n-1} s_d / √n``;
* **McNemar's exact test** on paired outcomes: with ``n10`` prompts only A gets right and ``n01``
  only B, ``p = min(1, 2 P(X <= min(n10, n01)))`` for ``X ~ Binomial(n10 + n01, 1/2)``; the interval
  of the difference of accuracies is Agresti and Min's (2005): half a prompt added to each of the
  four cells, then the Wald interval of the paired difference;
* **Holm**: the ``m`` p values sorted ascending, ``p_holm_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = [
    "INTERVAL_METHOD",
    "PairedTest",
    "betainc",
    "holm",
    "mcnemar_exact",
    "paired_t",
    "t_cdf",
    "t_interval",
    "t_quantile",
]

#: How every interval across seeds is computed, as the outputs name it.
INTERVAL_METHOD = "Student's t"

_TINY = 1e-300
_EPS = 1e-16


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of ``I_x(a, b)`` (converges fast for ``x < (a + 1) / (a + b + 2)``)."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, 100_000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _TINY else _TINY
            h *= d * c
        if abs(d * c - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"betainc({a}, {b}, {x}): the continued fraction did not converge")


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` for ``a, b > 0`` and ``0 <= x <= 1``."""
    if not (a > 0 and b > 0):
        raise ValueError(f"betainc: a and b must be > 0, got a={a}, b={b}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc: x must be in [0, 1], got {x}")
    if x == 0.0 or x == 1.0:
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def _upper_tail(t: float, df: float) -> float:
    """``P(T > t)`` for ``t >= 0``."""
    return 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))


def t_cdf(t: float, df: float) -> float:
    """``P(T <= t)`` for Student's t with ``df`` degrees of freedom."""
    if not df > 0:
        raise ValueError(f"t_cdf: df must be > 0, got {df}")
    tail = _upper_tail(abs(t), df)
    return 1.0 - tail if t >= 0 else tail


@lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """``t`` with ``P(T <= t) = p`` for Student's t with ``df`` degrees of freedom (``0 < p < 1``)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    if not df > 0:
        raise ValueError(f"t_quantile: df must be > 0, got {df}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    tail = 1.0 - p
    low, high = 0.0, 1.0
    while _upper_tail(high, df) > tail:
        low, high = high, 2.0 * high
    while high - low > 4 * _EPS * high:
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if _upper_tail(middle, df) > tail:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


def t_interval(samples: Any, level: float = 0.95) -> tuple[Any, Any]:
    """The Student's t interval of the mean of ``samples`` along its last axis (numpy ``[..., n]``,
    ``n >= 2``): ``(low, high)``, arrays of the leading shape (floats for one sample)."""
    import numpy as np

    if not 0.0 < level < 1.0:
        raise ValueError(f"t_interval: level must be in (0, 1), got {level}")
    data = np.asarray(samples, dtype=float)
    n = data.shape[-1]
    if n < 2:
        raise ValueError(f"t_interval: needs at least 2 values along the last axis, got {n}")
    centre = data.mean(axis=-1)
    half = t_quantile((1.0 + level) / 2.0, n - 1) * data.std(axis=-1, ddof=1) / math.sqrt(n)
    if data.ndim == 1:
        return float(centre - half), float(centre + half)
    return centre - half, centre + half


@dataclass(frozen=True)
class PairedTest:
    """One paired test of A against B: ``n`` pairs, the mean difference ``a - b`` with its ``interval``
    (``level``), and the two-sided ``p`` (None where nothing can be tested, with the reason in ``note``)."""

    test: str
    n: int
    mean_diff: float
    interval: tuple[float, float] | None
    p: float | None
    note: str = ""


def _checked_pairs(a: Sequence[float], b: Sequence[float], name: str) -> tuple[list[float], list[float]]:
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) != len(b):
        raise ValueError(f"{name}: a and b must pair up, got {len(a)} and {len(b)} values")
    return a, b


def paired_t(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> PairedTest:
    """Student's paired t test of ``mean(a - b) = 0`` over ``n`` pairs, two-sided.

    Fewer than 2 pairs, or a value that is not finite: no test (``p`` None, the reason in ``note``).
    Differences without spread: ``p = 1`` when they are all 0 (nothing differs), ``p = 0`` otherwise
    (every pair differs by the same amount), with a zero-width interval."""
    a, b = _checked_pairs(a, b, "paired_t")
    n = len(a)
    diffs = [x - y for x, y in zip(a, b)]
    centre = sum(diffs) / n if n else math.nan
    if n < 2:
        return PairedTest("paired_t", n, centre, None, None, f"cannot test: {n} pair(s), a paired t needs 2")
    if not all(math.isfinite(d) for d in diffs):
        return PairedTest("paired_t", n, centre, None, None, "cannot test: a value is not finite")
    sd = math.sqrt(sum((d - centre) ** 2 for d in diffs) / (n - 1))
    half = t_quantile((1.0 + level) / 2.0, n - 1) * sd / math.sqrt(n)
    if sd == 0.0:
        return PairedTest("paired_t", n, centre, (centre, centre), 1.0 if centre == 0.0 else 0.0)
    t = centre / (sd / math.sqrt(n))
    df = n - 1.0
    p = betainc(df / 2.0, 0.5, df / (df + t * t))
    return PairedTest("paired_t", n, centre, (centre - half, centre + half), min(1.0, p))


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool], z: float = 1.959964) -> PairedTest:
    """McNemar's exact test of paired right/wrong outcomes (``a[i]``, ``b[i]`` on the same prompt ``i``),
    two-sided; ``mean_diff`` is A's accuracy minus B's, with Agresti and Min's 95% interval.

    No prompt: no test. No discordant prompt: ``p = 1`` (the binomial of 0 trials)."""
    if len(a) != len(b):
        raise ValueError(f"mcnemar_exact: a and b must pair up, got {len(a)} and {len(b)} outcomes")
    n = len(a)
    if n == 0:
        return PairedTest("mcnemar_exact", 0, math.nan, None, None, "cannot test: no prompt")
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    discordant = only_a + only_b
    tail = sum(math.comb(discordant, k) for k in range(min(only_a, only_b) + 1)) / 2.0**discordant
    # Agresti & Min: add 1/2 to each of the four cells (n + 2 prompts), then the paired Wald interval.
    a10, a01, total = only_a + 0.5, only_b + 0.5, n + 2.0
    centre = (a10 - a01) / total
    half = z * math.sqrt(max(0.0, (a10 + a01) - (a10 - a01) ** 2 / total)) / total
    interval = (max(-1.0, centre - half), min(1.0, centre + half))
    return PairedTest("mcnemar_exact", n, (only_a - only_b) / n, interval, min(1.0, 2.0 * tail))


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of a family of p values, in their order (None stays None and does
    not count in the family's size)."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    adjusted: list[float | None] = [None] * len(p_values)
    running, m = 0.0, len(tested)
    for rank, (p, i) in enumerate(tested):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"holm: p values must be in [0, 1], got {p}")
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted
