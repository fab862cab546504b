"""Attention-map figures: the positional pattern of any encoding in an untrained layer, and the
attention maps of a trained model (see :mod:`posenc.viz.runs`).

The positional pattern feeds the same token at every position through a randomly initialised
:class:`~posenc.MultiheadAttention` carrying the encoding, so every difference between rows and
columns comes from the encoding alone.
"""

from __future__ import annotations

import numpy as np
import torch
from matplotlib.figure import Figure

from ..encodings.base import PositionalEncoding
from ..layers.attention import MultiheadAttention
from ._style import SEQUENTIAL, head_grid, label_grid
from .registry import ANY, PlotOptions, describe, figure, new_figure, set_title

DEFAULT_LENGTH = 32


def layer_sizes(enc: PositionalEncoding) -> tuple[int, int]:
    """``(num_heads, head_dim)`` the encoding was built for (8 heads of 16 when it does not say)."""
    config = enc.config()
    heads = int(config.get("num_heads") or 8)
    head_dim = int(config.get("head_dim") or (config["dim"] // heads if config.get("dim") else 16))
    return heads, head_dim


def draw_attention_grid(
    fig: Figure, weights: np.ndarray, max_heads: int, titles: list[str] | None = None
) -> None:
    """One heatmap per head of ``weights [H, Tq, Tk]`` (probabilities), one shared colour bar."""
    heads = min(weights.shape[0], max_heads)
    axes = head_grid(fig, heads)
    # The colour range spans the values drawn: without a mask the weights of a random layer vary
    # only slightly around 1/T, and a 0-based scale would flatten them.
    low, high = float(weights[:heads].min()), float(weights[:heads].max())
    image = None
    for head, ax in enumerate(axes):
        image = ax.imshow(
            weights[head], cmap=SEQUENTIAL, vmin=low, vmax=max(high, low + 1e-12), interpolation="nearest"
        )
        ax.set_title(titles[head] if titles else f"head {head}", fontsize=10)
        label_grid(ax, "query", "key")
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention probability")


def grid_size(heads: int) -> tuple[float, float]:
    cols = min(heads, 4)
    return 3.2 * cols + 1.2, 3.0 * -(-heads // cols) + 0.8


@figure(ANY, "attention", square=True)
def positional_attention(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """Attention pattern of a random layer fed the same token everywhere: what the encoding alone does.

    Causal unless ``options.causal`` is False; a ``causal_only`` encoding (Kerple, FIRE, ALiBi's
    causal mode) is undefined for future keys, so its pattern is always drawn causal (the title
    says which).
    """
    length = options.length_or(DEFAULT_LENGTH)
    heads, head_dim = layer_sizes(enc)
    causal = options.causal is not False or enc.causal_only
    generator = torch.Generator().manual_seed(options.seed)
    with torch.random.fork_rng():
        torch.manual_seed(options.seed)
        layer = MultiheadAttention(heads * head_dim, heads, encoding=enc, causal=causal)
    layer.eval()
    token = torch.randn(1, 1, heads * head_dim, generator=generator)
    with torch.no_grad():
        _, weights = layer(token.expand(1, length, -1), need_weights=True)
    fig = new_figure(*grid_size(min(heads, options.max_heads)))
    draw_attention_grid(fig, weights[0].double().numpy(), options.max_heads)
    mask = "causal" if causal else "no mask"
    set_title(
        fig, f"{describe(enc)}: attention of a random layer, same token at all {length} positions ({mask})"
    )
    return fig
