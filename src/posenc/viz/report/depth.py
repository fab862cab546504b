"""The retrieval section: exact match by needle depth and length (:mod:`posenc.viz.depth`), for
folders whose records carry a depth breakdown (passkey); absent otherwise."""

from __future__ import annotations

from ..depth import depth_heatmap_figure, has_depths
from ..hf_study import PROMPT_LENGTH
from .pieces import image
from .view import FolderView

__all__ = ["HEADING", "ID", "render"]

ID = "depth"
HEADING = "Retrieval by depth and length"


def render(view: FolderView) -> str | None:
    """The depth x length heat map (a study's prompts measured in tokens), or None without depths."""
    if not has_depths(view.records):
        return None
    kw = {"length_label": PROMPT_LENGTH} if view.study else {}
    return image(
        depth_heatmap_figure(view.records, view.rows, **kw), "exact match by needle depth and length"
    )
