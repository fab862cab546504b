"""Bias figures (posenc.viz.bias): every BIAS encoding gets the generic bias heat map."""

from __future__ import annotations

import pytest

import posenc
from _pixels import assert_not_constant, data_pixels
from posenc.encodings.base import Kind
from posenc.examples import build_example
from posenc.viz import PlotOptions, make_figure


@pytest.mark.parametrize("name", [n for n in posenc.available() if posenc.get_class(n).kind is Kind.BIAS])
def test_generic_bias_heatmap_for_every_bias_encoding(name: str) -> None:
    pixels = data_pixels(make_figure(build_example(name), "bias", PlotOptions(length=8, max_heads=2)))
    assert_not_constant(pixels)
