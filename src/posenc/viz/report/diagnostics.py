"""Section 3, why encodings fail, from the checkpoints (:mod:`posenc.viz.diagnostics`): each trained
model's attention at L and 2L side by side, attention entropy per head against length, and a
learned absolute table's rows past L against their init. Absent for a pretrained model's folder
(no trained checkpoints)."""

from __future__ import annotations

import html
from pathlib import Path

from .. import diagnostics
from ..runs import find_checkpoints
from .pieces import image
from .view import FolderView

__all__ = ["HEADING", "ID", "render"]

ID = "diagnostics"
HEADING = "Why encodings fail: the trained models"

#: What a diagnostic may raise for one checkpoint: said on the page, not fatal.
FAILURES = (ValueError, RuntimeError, KeyError)

ATTENTION = (
    "<h3>Attention at L and at 2L</h3>"
    "<p>One evaluation example of size L and one of size 2L per trained model (first seed), one row "
    "per layer, the mean over its heads. Dotted lines in the 2L map: the last position a training "
    "example reaches; below and right of them, every query or key position is new to the model.</p>"
)
ENTROPY = (
    "<h3>Attention entropy against length</h3>"
    "<p>Per head (coloured by layer) the entropy of its attention, averaged over the queries of 8 "
    "examples of each size; dashed: attention spread evenly over the visible keys. A head whose "
    "entropy climbs toward that line past L disperses: it spreads over more keys than it learnt to "
    "choose from.</p>"
)


def render(view: FolderView) -> str | None:
    if view.pretrained:
        return None
    try:
        checkpoints = find_checkpoints(view.directory)
    except (TypeError, ValueError, FileNotFoundError) as err:
        return f'<p class="note">No diagnostics: {html.escape(str(err))}</p>'
    if not checkpoints:
        return "<p>No checkpoints in this directory: the diagnostics read the trained models.</p>"
    order = {enc: i for i, enc in enumerate(view.rows)}
    checkpoints = dict(sorted(checkpoints.items(), key=lambda item: order.get(item[0], 1e9)))
    failures: list[str] = []
    parts = [
        ATTENTION,
        '<div class="grid">',
        *(_attention(encoding, path, failures) for encoding, path in checkpoints.items()),
        "</div>",
        ENTROPY,
        _entropy(checkpoints, failures),
        *(_learned_table(encoding, path, failures) for encoding, path in checkpoints.items()),
    ]
    parts += [f'<p class="note">No diagnostic for {html.escape(f)}</p>' for f in failures]
    return "".join(parts)


def _attention(encoding: str, path: Path, failures: list[str]) -> str:
    try:
        fig = diagnostics.attention_at_lengths_figure(path)
    except FAILURES as err:
        failures.append(f"{encoding}: {err}")
        return ""
    return image(fig, f"attention of the trained model at L and 2L: {encoding}", dpi=72)


def _entropy(checkpoints: dict[str, Path], failures: list[str]) -> str:
    try:
        fig = diagnostics.entropy_figure(checkpoints)
    except FAILURES as err:
        failures.append(f"entropy: {err}")
        return ""
    return image(fig, "attention entropy per head against size", dpi=72)


def _learned_table(encoding: str, path: Path, failures: list[str]) -> str:
    """A learned absolute table after training and how far its rows past L moved ("" for others)."""
    try:
        fig = diagnostics.learned_table_figure(path, encoding)
    except FAILURES as err:
        failures.append(f"{encoding}: {err}")
        return ""
    if fig is None:
        return ""
    _, drift, reached = diagnostics.learned_table_drift(path)  # type: ignore[misc]
    moved = float(drift[reached:].max()) if len(drift) > reached else 0.0
    verdict = (
        f"Rows {reached}..{len(drift) - 1}, past the last position a training example reaches, "
        "got no gradient: they are exactly their random init, which is what the model reads beyond L."
        if moved == 0
        else f"Rows past position {reached - 1} moved too (largest change {moved:.2g}): training "
        "reached them (randomized or packed positions)."
    )
    return (
        f"<h3>Learned positions past L: <code>{html.escape(encoding)}</code></h3>"
        "<p>The trained table and how far each row moved from its initialisation (rebuilt from "
        f"the run's seed). {html.escape(verdict)}</p>"
        + image(fig, f"learned absolute table after training: {encoding}", dpi=72)
    )
