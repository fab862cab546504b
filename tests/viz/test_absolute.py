"""Figures of absolute encodings (posenc.viz.absolute): the sinusoidal seed figure draws the seed dimensions."""

from __future__ import annotations

import numpy as np

from posenc.examples import build_example
from posenc.viz import PlotOptions, make_figure


def test_sinusoidal_seed_figure_draws_the_seed_dimensions() -> None:
    # The first panels are dims 2, 6, 12 of the table over the positions, as in the seed.
    fig = make_figure(build_example("sinusoidal:dim=32"), "dims", PlotOptions(length=128))
    lines = [ax.lines[0] for ax in fig.axes]
    assert [ax.get_ylabel() for ax in fig.axes] == ["dim 2", "dim 6", "dim 12"]
    positions = np.arange(128, dtype=np.float64)
    for line, dim in zip(lines, (2, 6, 12)):
        # Paper formula, interleaved: PE[p, 2k] = sin(p * 10000^(-2k/D)).
        expected = np.sin(positions * 10000.0 ** (-(dim // 2) * 2 / 32))
        np.testing.assert_allclose(line.get_ydata(), expected, atol=1e-6)
