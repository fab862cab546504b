"""Student's t for the seed intervals (posenc.experiments.results.stats), against closed forms written
here: the regularized incomplete beta function ``I_x(a, 1) = x^a``, ``I_x(1, b) = 1 - (1 - x)^b``,
``I_x(a, b) = 1 - I_(1-x)(b, a)`` and ``I_(1/2)(a, a) = 1/2``; the t distribution function of one degree
of freedom (Cauchy: ``1/2 + atan(t)/pi``) and of two (``1/2 + t / (2 sqrt(2 + t^2))``); and the interval
of a mean worked by hand from the printed table (``t_0.975 = 3.182446`` for 3 degrees of freedom).

The quantiles against the printed tables: tests/reliability/test_results.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from posenc.experiments.results.stats import betainc, t_cdf, t_interval


@pytest.mark.parametrize("x", [0.0, 0.1, 0.37, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("a", [0.5, 1.0, 2.5, 7.0])
def test_the_incomplete_beta_function_equals_its_closed_forms(a, x):
    assert betainc(a, 1.0, x) == pytest.approx(x**a, abs=1e-12)
    assert betainc(1.0, a, x) == pytest.approx(1 - (1 - x) ** a, abs=1e-12)
    assert betainc(a, 3.0, x) == pytest.approx(1 - betainc(3.0, a, 1 - x), abs=1e-12)
    assert betainc(a, a, 0.5) == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize("t", [-30.0, -2.5, -1.0, -0.1, 0.0, 0.4, 1.0, 3.7, 100.0])
def test_the_t_distribution_equals_the_closed_forms_of_one_and_two_degrees_of_freedom(t):
    assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
    assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


def test_the_interval_of_a_mean_is_the_one_worked_by_hand():
    # 1, 2, 3, 4: mean 2.5, sample sd sqrt(5/3), standard error sqrt(5/3)/2, t_0.975(3) = 3.182446
    half = 3.182446 * math.sqrt(5 / 3) / 2
    low, high = t_interval(np.array([1.0, 2.0, 3.0, 4.0]))
    assert low == pytest.approx(2.5 - half, abs=1e-5) and high == pytest.approx(2.5 + half, abs=1e-5)
    lows, highs = t_interval(np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 5.0, 5.0]]))
    assert lows.shape == highs.shape == (2,) and lows[1] == highs[1] == 5.0  # no spread, no width


def test_arguments_outside_the_domain_are_named():
    with pytest.raises(ValueError, match="betainc: a and b must be > 0"):
        betainc(0.0, 1.0, 0.5)
    with pytest.raises(ValueError, match=r"betainc: x must be in \[0, 1\]"):
        betainc(1.0, 1.0, 1.5)
    with pytest.raises(ValueError, match="t_cdf: df must be > 0"):
        t_cdf(1.0, 0)
    with pytest.raises(ValueError, match=r"t_interval: level must be in \(0, 1\)"):
        t_interval(np.array([1.0, 2.0]), level=1.0)
