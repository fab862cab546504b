"""Attention maps of a trained model from an experiment directory (``posenc plot --run DIR``)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from .registry import PlotOptions


def find_checkpoints(directory: str | Path) -> dict[str, Path]:
    """``{encoding: checkpoint}`` of the trained models saved in ``directory`` (empty when none)."""
    return {}


def run_attention_figure(directory: str | Path, encoding: str | None = None, options: PlotOptions | None = None) -> Figure:
    """Attention maps of the model trained with ``encoding`` in experiment ``directory``."""
    checkpoints = find_checkpoints(directory)
    if not checkpoints:
        raise FileNotFoundError(f"no model checkpoints found in {directory}")
    raise ValueError("reading checkpoints is not implemented yet")
