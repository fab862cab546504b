"""Attention maps of a trained model from an experiment directory (``posenc plot --run DIR``).

The experiment runner (:mod:`posenc.experiments`) saves ``checkpoints/<run id>.pt`` with the model
state and the experiment config; the run id comes from
:func:`posenc.experiments.train.run_id_for`. We rebuild the model with the runner's own
``build_model``, load the weights, feed one evaluation example and record the attention
probabilities of every :class:`~posenc.MultiheadAttention` layer (asked for with
``need_weights=True``, which every backend supports).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from ..layers.attention import MultiheadAttention
from ._style import SEQUENTIAL, label_grid
from .registry import PlotOptions, check_map_length, new_figure, set_title

__all__ = ["attention_weights", "find_checkpoints", "load_trained_model", "run_attention_figure"]


def _experiment(directory: Path) -> dict[str, Any]:
    from ..experiments.results.records import experiment_settings, load_config

    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{directory / 'config.json'} not found: is {directory} an experiment directory?"
        )
    return experiment_settings(load_config(directory))


def find_checkpoints(directory: str | Path) -> dict[str, Path]:
    """``{encoding spec: checkpoint}`` for the encodings of the run that have one (first seed that does)."""
    from ..experiments.train import ExperimentConfig, RunSpec, run_id_for

    directory = Path(directory)
    if not (directory / "checkpoints").is_dir():
        return {}
    config = ExperimentConfig(**_experiment(directory))
    found: dict[str, Path] = {}
    for encoding in config.encodings:
        for seed in config.seeds:
            path = directory / "checkpoints" / f"{run_id_for(config, RunSpec(encoding, seed))}.pt"
            if path.is_file():
                found[encoding] = path
                break
    return found


def load_trained_model(checkpoint: Path) -> tuple[nn.Module, Any, dict[str, Any]]:
    """``(model in eval mode, task, checkpoint state)`` rebuilt from a runner checkpoint."""
    from ..experiments.train import ExperimentConfig, build_model

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    for key in ("model", "config", "run"):
        if key not in state:
            raise ValueError(f"{checkpoint} is not an experiment checkpoint (no {key!r} entry)")
    config = ExperimentConfig(**state["config"])
    task = config.make_task()
    model = build_model(config, task, state["run"]["encoding"])
    model.load_state_dict(state["model"])
    model.eval()
    return model, task, state


@contextmanager
def _recording(model: nn.Module) -> Iterator[list[Tensor]]:
    """Record the attention probabilities ``[B, H, Tq, Tk]`` of every attention layer, in call order."""
    layers = [m for m in model.modules() if isinstance(m, MultiheadAttention)]
    if not layers:
        raise ValueError("the model has no posenc MultiheadAttention layer")
    weights: list[Tensor] = []

    def wrap(layer: MultiheadAttention):
        original = layer.forward

        def forward(*args: Any, **kwargs: Any) -> Tensor:
            output, probs = original(*args, **{**kwargs, "need_weights": True})
            weights.append(probs.detach().cpu())
            return output

        return forward

    for layer in layers:
        layer.forward = wrap(layer)  # instance attribute shadows the method while recording
    try:
        yield weights
    finally:
        for layer in layers:
            del layer.forward


def attention_weights(model: nn.Module, tokens: Tensor) -> list[Tensor]:
    """Attention probabilities ``[H, T, T]`` of each layer for one sequence ``tokens [1, T]``."""
    with _recording(model) as weights, torch.no_grad():
        model(tokens)
    return [w[0] for w in weights]


def _pick(directory: Path, encoding: str | None) -> tuple[str, Path]:
    checkpoints = find_checkpoints(directory)
    if not checkpoints:
        raise FileNotFoundError(f"no model checkpoints found in {directory / 'checkpoints'}")
    if encoding is None:
        if len(checkpoints) > 1:
            raise ValueError(
                f"{directory} has models for {', '.join(checkpoints)}: name one, e.g. posenc plot {next(iter(checkpoints))} --run {directory}"
            )
        encoding = next(iter(checkpoints))
    if encoding not in checkpoints:
        raise ValueError(
            f"no checkpoint for encoding {encoding!r} in {directory}; it has: {', '.join(checkpoints)}"
        )
    return encoding, checkpoints[encoding]


def run_attention_figure(
    directory: str | Path, encoding: str | None = None, options: PlotOptions | None = None
) -> Figure:
    """Attention maps (layers × heads) of the model trained with ``encoding`` in ``directory``.

    ``options.length`` is the task size of the example (default: twice the training length, to
    show what happens beyond it); ``options.seed`` picks the example.
    """
    options = options or PlotOptions()
    directory = Path(directory)
    encoding, checkpoint = _pick(directory, encoding)
    model, task, state = load_trained_model(checkpoint)
    train_len = int(state["config"]["train_len"])
    length = options.length_or(min(2 * train_len, int(state["config"]["eval_len"])))
    check_map_length(length)
    generator = torch.Generator().manual_seed(options.seed)
    tokens = task.batch(length, 1, generator).inputs
    maps = [w.double().numpy() for w in attention_weights(model, tokens)]
    heads = min(maps[0].shape[0], options.max_heads)
    fig = new_figure(2.8 * heads + 1.2, 2.7 * len(maps) + 0.9)
    axes = fig.subplots(len(maps), heads, squeeze=False)
    image = None
    for layer, layer_maps in enumerate(maps):
        for head in range(heads):
            ax = axes[layer][head]
            image = ax.imshow(layer_maps[head], cmap=SEQUENTIAL, vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_title(f"layer {layer} head {head}", fontsize=9)
            label_grid(ax, "query", "key")
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention probability")
    step = int(state.get("step", 0))
    set_title(
        fig,
        f"{encoding} trained on {state['config']['task']} (sizes ≤ {train_len}, step {step}): "
        f"one example of size {length}, {np.asarray(tokens).shape[1]} tokens",
    )
    return fig
