"""The published section, for a ``--preset`` run: the paper's numbers beside ours, with the source
(:func:`posenc.experiments.presets.comparison_for_folder`); absent for other folders."""

from __future__ import annotations

import html

from ...experiments.presets import comparison_for_folder
from .pieces import note, table
from .view import FolderView

__all__ = ["HEADING", "ID", "render"]

ID = "published"
HEADING = "Published beside ours"


def render(view: FolderView) -> str | None:
    if not view.preset:
        return None
    try:
        comparison = comparison_for_folder(view.directory)
    except ValueError as err:
        return note(str(err))
    notes = "".join(f"<p>{html.escape(line)}</p>" for line in comparison.notes)
    return (
        f"<p>{html.escape(comparison.title)}</p>"
        + table("published", comparison.columns, comparison.rows)
        + notes
    )
