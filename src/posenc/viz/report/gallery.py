"""The gallery (``posenc report --gallery``): the default figure of every encoding of the folder,
built untrained (:mod:`posenc.viz.registry`)."""

from __future__ import annotations

import html

from ...examples import build_example
from ..registry import PlotOptions, describe, figures_for, make_figure
from .pieces import image
from .view import FolderView

__all__ = ["HEADING", "ID", "render"]

ID = "encodings"
HEADING = "The encodings, untrained"


def render(view: FolderView) -> str:
    heads, head_dim = _shape(view.settings)
    return "".join(_figure(spec, heads, head_dim) for spec in view.encodings if spec not in view.variants)


def _shape(settings: dict) -> tuple[int, int]:
    """``(heads, head dim)`` of the folder's model (8 heads of 16 when it does not say)."""
    heads = int(settings.get("num_heads") or 8)
    if settings.get("head_dim"):
        return heads, int(settings["head_dim"])
    return heads, int(settings["d_model"]) // heads if settings.get("d_model") else 16


def _figure(spec: str, heads: int, head_dim: int) -> str:
    try:
        enc = build_example(spec, heads, head_dim)
        name = next(iter(figures_for(enc)))
        fig = make_figure(enc, name, PlotOptions())
    except (ValueError, StopIteration) as err:
        # Shown on the page, not hidden: the reader sees which figure is missing and why.
        return f'<p class="note">No figure for <code>{html.escape(spec)}</code>: {html.escape(str(err))}</p>'
    return image(fig, f"{describe(enc)}: {name}")
