"""The figures of a context-extension study folder (``posenc extrapolate --hf-model M --task text``).

- ``extrapolation.png``: perplexity against position (each bucket's perplexity at its upper end),
  one line per variant, its 95% interval across windows shaded where the records carry one
  (``--eval-examples`` >= 2), the training context marked by a dashed line;
- ``depth.png``: passkey exact match by needle depth (rows) and prompt length (columns), one panel
  per variant (:func:`posenc.viz.depth.depth_heatmap_figure`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from .registry import new_figure, set_title

__all__ = ["PROMPT_LENGTH", "perplexity_by_position_figure"]

#: The x label of the study's passkey heat map: its prompts are measured in the model's tokens.
PROMPT_LENGTH = "prompt length (tokens)"


def perplexity_by_position_figure(settings: dict[str, Any], records: list[dict[str, Any]]) -> Figure:
    """Perplexity against position per variant, the training context marked."""
    fig = new_figure(8.0, 4.5)
    ax = fig.subplots()
    for label in settings["encodings"]:
        rows = sorted(
            (r for r in records if r["encoding"] == label and r["metric"] == "perplexity"),
            key=lambda r: r["length"],
        )
        if not rows:
            continue
        (line,) = ax.plot(
            [r["length"] for r in rows], [r["value"] for r in rows], marker="o", markersize=3, label=label
        )
        bands = [r for r in rows if r.get("interval")]
        if len(bands) >= 2:
            ax.fill_between(
                [r["length"] for r in bands],
                [r["interval"][0] for r in bands],
                [r["interval"][1] for r in bands],
                color=line.get_color(),
                alpha=0.15,
                linewidth=0,
            )
    context = settings["train_len"]
    ax.axvline(context, color="grey", linestyle="--", linewidth=1.0)
    ax.text(context, 1.0, f" context {context}", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    name = Path(settings["hf_model"]).name
    set_title(
        fig, f"{name} ({settings['model_class']}, context {context}): perplexity by position, no training"
    )
    return fig


def study_figures(
    folder: Path, settings: dict[str, Any], records: list[dict[str, Any]], save: Any
) -> list[Path]:
    """Draw the study's figures into ``folder`` with ``save(fig, path)``; returns the files written."""
    from .depth import depth_heatmap_figure, has_depths

    written = []
    if any(r["metric"] == "perplexity" for r in records):
        written.append(folder / "extrapolation.png")
        save(perplexity_by_position_figure(settings, records), written[-1])
    passkey = [
        r for r in records if r.get("task") != "text-multikey"
    ]  # the multi-key needle is not the passkey
    if has_depths(passkey):
        title = f"text passkey: exact match by depth and length (context {settings['train_len']})"
        written.append(folder / "depth.png")
        figure = depth_heatmap_figure(
            passkey, list(settings["encodings"]), title=title, length_label=PROMPT_LENGTH
        )
        save(figure, written[-1])
    return written
