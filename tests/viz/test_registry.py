"""Figures (posenc.viz.registry): every posenc plot figure writes a real image whose pixels follow the
encoding. Each case draws a figure for two settings of an encoding parameter; with every text artist
hidden, the two renderings must differ and neither may be constant, so an empty axes or a plot that
ignores the parameter fails. Every registered encoding has a default figure."""

from __future__ import annotations

import numpy as np
import pytest

import posenc
from _pixels import assert_not_constant, data_pixels
from posenc.encodings.base import Kind
from posenc.examples import build_example
from posenc.viz import PlotOptions, figures_for, make_figure

# (figure, spec A, spec B, length): the two specs differ in one parameter the figure must show.
CASES = [
    ("seed", "sinusoidal:dim=64", "sinusoidal:dim=64,base=100", 64),
    ("dims", "sinusoidal:dim=32", "sinusoidal:dim=32,base=1000", 64),
    ("vectors", "sinusoidal:dim=32", "sinusoidal:dim=32,base=1000", 16),
    ("heatmap", "sinusoidal:dim=32", "sinusoidal:dim=32,layout=concat", 32),
    ("similarity", "sinusoidal:dim=32", "sinusoidal:dim=32,base=100", 32),
    ("heatmap", "learned:dim=16,max_len=32", "learned:dim=32,max_len=32", 16),
    ("buckets", "t5:bidirectional=true", "t5:bidirectional=false", 8),
    ("buckets", "t5:max_distance=128", "t5:max_distance=32", 8),
    ("bias", "alibi:mode=causal", "alibi:mode=symmetric", 12),
    ("bias", "t5:bidirectional=true", "t5:bidirectional=false", 12),
    ("profile", "alibi:num_heads=8", "alibi:num_heads=4", 32),
    ("slopes", "alibi:num_heads=8", "alibi:num_heads=6", 32),
    ("scaling", "rope:head_dim=32", "rope:head_dim=32,base=500", 256),
    ("decay", "rope:head_dim=16", "rope:head_dim=16,base=100", 256),
    ("index", "shaw:k=2", "shaw:k=4", 8),
    (
        "index",
        "deberta:position_buckets=-1,max_relative_positions=3",
        "deberta:position_buckets=8,max_relative_positions=32",
        8,
    ),
    ("attention", "alibi:num_heads=8", "alibi:num_heads=4", 12),
    ("attention", "rope:base=10000", "rope:base=10", 12),
]


@pytest.mark.parametrize(("name", "spec_a", "spec_b", "length"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_figure_follows_parameters(name: str, spec_a: str, spec_b: str, length: int) -> None:
    options = PlotOptions(length=length, max_heads=4)
    first = data_pixels(make_figure(build_example(spec_a), name, options))
    second = data_pixels(make_figure(build_example(spec_b), name, options))
    assert_not_constant(first)
    assert_not_constant(second)
    assert first.shape == second.shape
    assert np.abs(first - second).max() > 0.1, f"{name}: {spec_a} and {spec_b} draw the same pixels"


def test_data_pixels_catches_an_empty_plot() -> None:
    # The check itself must be able to fail: an axes with no data but a title is "constant".
    from posenc.viz import new_figure

    fig = new_figure(4, 3)
    ax = fig.subplots()
    ax.set_title("sinusoidal:dim=32")
    with pytest.raises(AssertionError):
        assert_not_constant(data_pixels(fig))


def test_every_registered_encoding_has_a_default_figure() -> None:
    for name in posenc.available():
        enc = build_example(name)
        figures = figures_for(enc)
        assert figures, f"{name} has no figure"
        if enc.kind is Kind.BIAS:
            assert "bias" in figures, f"BIAS encoding {name} lacks the generic bias heatmap"


@pytest.mark.parametrize("name", ["slopes", "profile"])
def test_a_profile_of_more_heads_than_it_draws_says_so(name):
    """Issue 62 item 10: `posenc plot alibi:num_heads=12` drew 8 of 12 heads without a note."""
    import matplotlib.pyplot as plt

    for heads, max_heads, words in (
        (12, 8, "the first 8 of 12 heads (--max-heads draws more)"),
        (6, 8, "6 heads"),
    ):
        fig = make_figure(build_example(f"alibi:num_heads={heads}"), name, PlotOptions(max_heads=max_heads))
        titles = [fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in fig.axes]
        assert any(words in " ".join(title.split()) for title in titles), titles  # titles wrap
        assert len(fig.axes[0].get_lines()) == min(heads, max_heads)
        plt.close(fig)
