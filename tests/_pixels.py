"""A figure's pixels with every text artist hidden (titles, tick labels, legends), and the check that an
image is not blank: the figure tests' (tests/viz/, tests/cli/test_plots.py) way to see that a plot shows
something."""

from __future__ import annotations

import io

import numpy as np
from matplotlib.image import imread
from matplotlib.text import Text

DPI = 40


def data_pixels(fig) -> np.ndarray:
    """RGB pixels of ``fig`` with every text artist hidden."""
    for text in fig.findobj(Text):
        text.set_visible(False)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    buffer.seek(0)
    return imread(buffer)[..., :3]


def assert_not_constant(pixels: np.ndarray) -> None:
    # A figure of nothing but white paper and axis frames has almost one colour.
    colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 8, f"image has only {len(colours)} colours"
