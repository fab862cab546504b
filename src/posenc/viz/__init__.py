"""Figures of positional encodings (matplotlib, headless) and the HTML report of an experiment.

Figures are registered per encoding name, per kind, or for every encoding
(:mod:`posenc.viz.registry`); ``posenc plot --list SPEC`` lists those of an encoding.

Examples:
    >>> from posenc.examples import build_example
    >>> from posenc.viz import make_figure, save_figure
    >>> enc = build_example("t5:num_buckets=32,bidirectional=true")
    >>> save_figure(make_figure(enc, "buckets"), "t5_buckets.png")
"""

from __future__ import annotations

from . import absolute, attention_maps, bias, content, rotary  # noqa: F401  (importing registers the figures)
from .registry import (
    ANY,
    PlotOptions,
    figure,
    figures_for,
    make_figure,
    new_figure,
    save_figure,
)

__all__ = [
    "ANY",
    "PlotOptions",
    "figure",
    "figures_for",
    "make_figure",
    "new_figure",
    "save_figure",
]
