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
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

__all__ = ["INTERVAL_METHOD", "betainc", "t_cdf", "t_interval", "t_quantile"]

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
