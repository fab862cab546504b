"""Why an encoding fails beyond the training length, read from the trained checkpoints (no training).

Three figures for ``posenc report``, each computed from the models the runner saved
(``checkpoints/<run id>.pt``, rebuilt by :func:`posenc.viz.runs.load_trained_model`):

- :func:`attention_at_lengths_figure`: one model's attention on one evaluation example of size L
  and of size 2L, side by side, one row per layer (the mean over its heads). In the 2L map, dotted
  lines mark the last token position a training example reaches.
- :func:`entropy_figure`: the attention entropy of every head against the example size, one panel
  per model, with the entropy of uniform attention over the visible keys for reference. Entropy that
  climbs toward uniform past L is the dispersion the NoPE paper (Kazemnejad et al. 2023) and later
  work use to explain failures: attention spreads over more keys than it learnt to pick from.
- :func:`learned_table_figure`: a learned absolute table after training against its
  initialisation (rebuilt from the run's seed, as the runner draws it): rows past the trained
  positions get no gradient, so they are still at their random init.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib import colors
from matplotlib.figure import Figure

from ._style import DIVERGING, SEQUENTIAL, symmetric_limits
from .registry import new_figure, set_title

__all__ = [
    "attention_at_lengths_figure",
    "entropy_by_length",
    "entropy_figure",
    "learned_table_drift",
    "learned_table_figure",
]


def _tokens(task: Any, size: int, examples: int = 1, seed: int = 0) -> torch.Tensor:
    """``examples`` evaluation inputs ``[B, T]`` of task size ``size`` (seeded, reproducible)."""
    return task.batch(size, examples, torch.Generator().manual_seed(seed)).inputs


def _sizes(state: dict[str, Any]) -> tuple[int, int]:
    """``(L, largest evaluated size)`` of a checkpoint."""
    return int(state["config"]["train_len"]), int(state["config"]["eval_len"])


def attention_at_lengths_figure(checkpoint: Path, seed: int = 0) -> Figure:
    """Attention of the model in ``checkpoint`` on one evaluation example of size L and of size 2L
    (at most the largest evaluated size), side by side, one row per layer: the mean over its heads
    of the attention probabilities (square-root colour scale, so weak attention stays visible).
    Panel widths follow the token counts, so the L map and the first part of the 2L map share a
    scale; dotted lines in the 2L map mark the positions a training example reaches."""
    from .runs import attention_weights, load_trained_model

    model, task, state = load_trained_model(checkpoint)
    train_len, eval_len = _sizes(state)
    sizes = [train_len, min(2 * train_len, eval_len)]
    maps = [
        [w.double().mean(dim=0).numpy() for w in attention_weights(model, _tokens(task, n, seed=seed))]
        for n in sizes
    ]
    widths = [m[0].shape[-1] for m in maps]
    layers = len(maps[0])
    fig = new_figure(5.4, 2.3 * layers + 0.7)
    axes = fig.subplots(layers, 2, squeeze=False, gridspec_kw={"width_ratios": widths})
    norm = colors.PowerNorm(0.5, vmin=0.0, vmax=1.0)
    image = None
    for column, (size, per_layer) in enumerate(zip(sizes, maps)):
        for layer, weights in enumerate(per_layer):
            ax = axes[layer][column]
            image = ax.imshow(weights, cmap=SEQUENTIAL, norm=norm, interpolation="nearest", aspect="equal")
            ax.set_title(f"layer {layer}, size {size}" + (" (L)" if size == train_len else ""), fontsize=8)
            ax.tick_params(labelsize=7)
            if column == 1 and size > train_len:
                edge = widths[0] - 0.5
                ax.axvline(edge, color="white", linestyle=":", linewidth=1)
                ax.axhline(edge, color="white", linestyle=":", linewidth=1)
            if layer == layers - 1:
                ax.set_xlabel("key", fontsize=8)
            if column == 0:
                ax.set_ylabel("query", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.7, label="attention (mean over heads)")
    run = state["run"]
    fig.suptitle(f"{run['encoding']}, seed {run['seed']}, step {int(state.get('step', 0))}", fontsize=9)
    return fig


def entropy_by_length(
    checkpoint: Path, sizes: list[int], examples: int = 8, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(entropy [layers, heads, sizes], uniform [sizes])`` in nats: per head, the entropy of its
    attention over the keys, averaged over queries and ``examples`` evaluation examples of each
    size; ``uniform``: the same average for attention spread evenly over the visible keys."""
    from .runs import attention_weights, load_trained_model

    model, task, _ = load_trained_model(checkpoint)
    entropy, uniform = [], []
    for size in sizes:
        tokens = _tokens(task, size, examples, seed)
        per_layer = []
        for row in range(tokens.shape[0]):
            weights = attention_weights(model, tokens[row : row + 1])
            per_layer.append(torch.stack([-torch.special.xlogy(w, w).sum(-1).mean(-1) for w in weights]))
        entropy.append(torch.stack(per_layer).mean(0).double().numpy())  # [layers, heads]
        visible = (weights[0][0] > 0).sum(-1).double()  # keys each query sees (causal: i + 1)
        uniform.append(float(torch.log(visible).mean()))
    return np.stack(entropy, axis=-1), np.asarray(uniform)


def _entropy_sizes(train_len: int, eval_len: int, count: int = 10) -> list[int]:
    """About ``count`` sizes from L/4 to the largest evaluated, with L and 2L among them."""
    low = max(1, train_len // 4)
    sizes = {round(float(v)) for v in np.linspace(low, eval_len, count)}
    sizes |= {train_len, min(2 * train_len, eval_len)}
    return sorted(n for n in sizes if low <= n <= eval_len)


def entropy_figure(checkpoints: dict[str, Path], width: float = 11.0) -> Figure:
    """Attention entropy per head against example size, one panel per model (``{row: checkpoint}``),
    heads coloured by layer, uniform attention dashed, L marked and the sizes past it shaded."""
    import math

    from .runs import load_trained_model

    count = len(checkpoints)
    cols = min(4, count)
    rows = math.ceil(count / cols)
    fig = new_figure(width, 1.9 * rows + 0.8)
    grid = fig.subplots(rows, cols, squeeze=False, sharex=True, sharey=True)
    flat = [ax for row in grid for ax in row]
    for ax in flat[count:]:
        ax.set_visible(False)
    train_len = None
    for ax, (name, path) in zip(flat, checkpoints.items()):
        _, _, state = load_trained_model(path)
        train_len, eval_len = _sizes(state)
        sizes = _entropy_sizes(train_len, eval_len)
        entropy, uniform = entropy_by_length(path, sizes)
        for layer in range(entropy.shape[0]):
            for head in range(entropy.shape[1]):
                label = f"layer {layer}" if head == 0 else "_"
                ax.plot(sizes, entropy[layer, head], color=f"C{layer}", linewidth=1, alpha=0.8, label=label)
        ax.plot(sizes, uniform, color="black", linestyle="--", linewidth=1, label="uniform")
        ax.axvline(train_len, color="0.35", linestyle="--", linewidth=0.9)
        ax.axvspan(train_len, ax.get_xlim()[1], color="0.5", alpha=0.07, linewidth=0)
        ax.set_xlim(sizes[0], sizes[-1])
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for col in range(cols):
        bottom = grid[max(r for r in range(rows) if r * cols + col < count)][col]
        bottom.xaxis.set_tick_params(labelbottom=True)
        bottom.set_xlabel("example size", fontsize=8)
    for row in grid:
        row[0].set_ylabel("entropy (nats)", fontsize=8)
    flat[0].legend(fontsize=7, loc="upper left")
    set_title(
        fig,
        f"attention entropy per head against size (mean over queries of 8 examples; L={train_len} dashed)",
    )
    return fig


def _learned_tables(model: torch.nn.Module) -> list[torch.Tensor]:
    from ..encodings.learned import Learned

    return [m.table.weight.detach().double() for m in model.modules() if isinstance(m, Learned)]


def learned_table_drift(checkpoint: Path) -> tuple[np.ndarray, np.ndarray, int] | None:
    """``(trained table [P, D], |trained - init| per row [P], positions a training example
    reaches)`` of the first learned absolute table of the model in ``checkpoint`` (None when it has
    none). The init is rebuilt as the runner draws it: the run's seed, then ``build_model``."""
    from ..experiments.tasks.catalog import mix_seed
    from ..experiments.train import ExperimentConfig, build_model
    from .runs import load_trained_model

    model, task, state = load_trained_model(checkpoint)
    trained = _learned_tables(model)
    if not trained:
        return None
    config = ExperimentConfig(**state["config"])
    with torch.random.fork_rng():
        torch.manual_seed(mix_seed(int(state["run"]["seed"]), "init"))
        initial = _learned_tables(build_model(config, task, state["run"]["encoding"]))
    drift = (trained[0] - initial[0]).norm(dim=-1).numpy()
    reached = int(_tokens(task, config.train_len).shape[1])
    return trained[0].numpy(), drift, reached


def learned_table_figure(checkpoint: Path, name: str) -> Figure | None:
    """The trained learned-absolute table (positions × channels) and how far each row moved from
    its initialisation, positions a training example reaches left of the dashed line (None when
    the model has no learned table)."""
    found = learned_table_drift(checkpoint)
    if found is None:
        return None
    table, drift, reached = found
    fig = new_figure(11.0, 3.0)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.3, 1]})
    low, high = symmetric_limits(table)
    image = left.imshow(table.T, cmap=DIVERGING, vmin=low, vmax=high, aspect="auto", interpolation="nearest")
    left.axvline(reached - 0.5, color="black", linestyle="--", linewidth=1)
    left.set_xlabel("position", fontsize=8)
    left.set_ylabel("channel", fontsize=8)
    left.set_title("trained table", fontsize=9)
    fig.colorbar(image, ax=left, shrink=0.8)
    positions = np.arange(len(drift))
    right.bar(positions, drift, width=1.0, color=["C0" if p < reached else "C3" for p in positions])
    right.axvline(reached - 0.5, color="black", linestyle="--", linewidth=1)
    right.set_xlabel("position", fontsize=8)
    right.set_ylabel("|trained - init| of the row", fontsize=8)
    beyond = drift[reached:]
    moved = float(beyond.max()) if beyond.size else 0.0
    right.set_title(f"change since init; rows {reached}..{len(drift) - 1}: largest {moved:.1e}", fontsize=9)
    for ax in (left, right):
        ax.tick_params(labelsize=8)
    set_title(fig, f"{name}: learned absolute positions; a training example reaches position {reached - 1}")
    return fig
