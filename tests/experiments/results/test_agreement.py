"""Agreement with a published ranking (posenc.experiments.results.agreement): Kendall's tau against known
values, ties included, and the seed bootstrap enumerated exactly."""

from __future__ import annotations

import math

import pytest

# ---------------------------------------------------------------------------- agreement (Kendall's τ)


def test_kendall_tau_matches_known_values_ties_included():
    from posenc.experiments.results.agreement import kendall_tau

    # scipy.stats.kendalltau's docstring example (tau-b): tau = -0.47140452079103173.
    assert kendall_tau([12, 2, 1, 12, 2], [1, 4, 7, 1, 0]) == pytest.approx(-0.47140452079103173)
    assert kendall_tau([1, 2, 3, 4, 5], [5, 4, 3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)  # C = 2, D = 1 of 3 pairs
    # One tie in x: 6 pairs, 5 concordant, 1 tied in x -> 5 / sqrt(5 * 6).
    assert kendall_tau([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(5 / math.sqrt(30))
    assert kendall_tau([1, 1, 1], [1, 2, 3]) is None and kendall_tau([1], [2]) is None


def test_seed_resamples_enumerate_the_bootstrap_exactly():
    from posenc.experiments.results.agreement import seed_bootstrap, seed_resamples

    resamples = seed_resamples([0, 1, 2])
    assert len(resamples) == 10 and sum(p for p, _ in resamples) == pytest.approx(1.0)
    probability = {tuple(sorted(counts.items())): p for p, counts in resamples}
    assert probability[((0, 3),)] == pytest.approx(1 / 27)
    assert probability[((0, 1), (1, 1), (2, 1))] == pytest.approx(6 / 27)
    values = {0: 0.0, 1: 1.0, 2: 2.0}

    def mean_of(resample):
        counts = resample["t"]
        return sum(values[s] * c for s, c in counts.items()) / sum(counts.values())

    # The extremes 0 and 2 each have probability 1/27 > 2.5%: the 95% percentile interval is [0, 2].
    exact = seed_bootstrap({"t": [0, 1, 2]}, mean_of)
    assert (exact.low, exact.high) == (0.0, 2.0) and "exact" in exact.method
    drawn = seed_bootstrap({"t": [0, 1, 2]}, mean_of, exact_limit=0, draws=2000)
    assert "Monte Carlo" in drawn.method and drawn.low <= 1 / 3 and drawn.high >= 5 / 3
    assert seed_bootstrap({"t": [0]}, mean_of) is None  # one seed: nothing to resample
