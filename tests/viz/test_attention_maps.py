"""Attention maps from positions alone (posenc.viz.attention_maps): the causal option masks future keys;
without it every encoding renders, causal-only ones drawn causal."""

from __future__ import annotations

import numpy as np
import pytest

import posenc
from posenc.examples import build_example
from posenc.viz import PlotOptions, make_figure


def test_causal_option_masks_future_keys() -> None:
    enc = build_example("t5:bidirectional=true")
    both = make_figure(enc, "attention", PlotOptions(length=8, max_heads=2, causal=False))
    causal = make_figure(enc, "attention", PlotOptions(length=8, max_heads=2))
    weights = both.axes[0].images[0].get_array()
    masked = causal.axes[0].images[0].get_array()
    upper = np.triu_indices(8, 1)
    assert np.asarray(masked)[upper].max() == 0.0
    assert np.asarray(weights)[upper].min() > 0.0
    # The bias heatmap hides future keys only on request (t5 defines them), always for causal ALiBi.
    shown = make_figure(enc, "bias", PlotOptions(length=8, max_heads=2)).axes[0].images[0].get_array()
    hidden = (
        make_figure(enc, "bias", PlotOptions(length=8, max_heads=2, causal=True))
        .axes[0]
        .images[0]
        .get_array()
    )
    alibi = (
        make_figure(build_example("alibi"), "bias", PlotOptions(length=8, max_heads=2))
        .axes[0]
        .images[0]
        .get_array()
    )
    assert np.isfinite(np.asarray(shown)[upper]).all()
    assert np.ma.getmaskarray(hidden)[upper].all() or np.isnan(np.asarray(hidden)[upper]).all()
    assert np.ma.getmaskarray(alibi)[upper].all() or np.isnan(np.asarray(alibi)[upper]).all()


def _attention_weights(spec: str, causal: bool | None) -> np.ndarray:
    fig = make_figure(build_example(spec), "attention", PlotOptions(length=8, max_heads=2, causal=causal))
    return np.asarray(fig.axes[0].images[0].get_array())


@pytest.mark.parametrize("name", posenc.available())
def test_no_causal_attention_figure_for_every_encoding(name: str) -> None:
    """``posenc plot NAME --figure attention --no-causal``: every encoding renders; one that is not
    causal_only shows future keys, a causal_only one is drawn causal (as documented)."""
    upper = np.triu_indices(8, 1)
    weights = _attention_weights(name, causal=False)
    if build_example(name).causal_only:
        assert weights[upper].max() == 0.0, f"{name} is causal_only: future keys must stay masked"
    else:
        assert weights[upper].min() > 0.0, f"{name}: --no-causal must show future keys"
    assert _attention_weights(name, causal=None)[upper].max() == 0.0, f"{name}: the default is causal"
