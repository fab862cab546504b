"""Figures of BIAS encodings: the generic per-head bias heatmap and bias-against-distance profile
(computed from ``enc.bias``, so they work for every registered BIAS encoding), plus the T5 bucket
map and the ALiBi slopes.
"""

from __future__ import annotations

import numpy as np
import torch
from matplotlib.figure import Figure

from ..encodings.base import Kind, PositionalEncoding, TokenStates
from ..encodings.t5 import T5Bias
from ._style import DIVERGING, head_grid, label_grid, symmetric_limits
from .index_maps import index_figure
from .registry import PlotOptions, describe, figure, new_figure, set_title

DEFAULT_LENGTH = 32
PROFILE_LENGTH = 128
T5_GRID = 8


def dense_bias(enc: PositionalEncoding, length: int, causal: bool) -> np.ndarray:
    """``enc.bias(length, length)`` as float64 ``[H, L, L]``, future keys set to NaN when ``causal``."""
    with torch.no_grad():
        bias = enc.bias(length, length).double().cpu().numpy()
    if causal:
        future = np.triu(np.ones((length, length), dtype=bool), k=1)
        bias[:, future] = np.nan
    return bias


@figure(Kind.BIAS, "bias", square=True)
def bias_heatmap(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """Per-head bias heatmap over a query × key grid (from ``enc.bias``)."""
    length = options.length_or(DEFAULT_LENGTH)
    # A causal-only encoding's bias means nothing for keys after the query: always hide them.
    causal = enc.causal_only or bool(options.causal)
    bias = dense_bias(enc, length, causal)
    heads = min(bias.shape[0], options.max_heads)
    low, high = symmetric_limits(bias[:heads])
    cols = min(heads, 4)
    fig = new_figure(3.2 * cols + 1.2, 3.0 * -(-heads // cols) + 0.8)
    axes = head_grid(fig, heads)
    image = None
    for head, ax in enumerate(axes):
        image = ax.imshow(bias[head], cmap=DIVERGING, vmin=low, vmax=high, interpolation="nearest")
        ax.set_title(f"head {head}")
        label_grid(ax, "query i", "key j")
    fig.colorbar(image, ax=axes, shrink=0.8, label="bias added to the logit")
    shown = f"first {heads} of {bias.shape[0]} heads" if heads < bias.shape[0] else f"{heads} heads"
    at = ", at zero input" if enc.input_dependent else ""
    set_title(fig, f"{describe(enc)}: per-head bias ({shown}{', causal' if causal else ''}{at})")
    return fig


@figure("fox", "gates")
def fox_gates(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """FoX on a random input (seed 0): each token's forget gate per head, and the bias they give."""
    length = options.length_or(DEFAULT_LENGTH)
    generator = torch.Generator().manual_seed(0)
    weight = enc.to_gates.weight
    x = torch.randn(1, length, weight.shape[1], generator=generator).to(weight)
    with torch.no_grad():
        log_gates = enc.log_gates(x)[0].double().cpu().numpy()  # [S, T]
        states = TokenStates.same_sequence(enc.token_states(x))
        bias = enc.bias_from_states(states)[0].double().cpu().numpy()
    causal = enc.causal_only or bool(options.causal)
    if causal:
        bias[:, np.triu(np.ones((length, length), dtype=bool), k=1)] = np.nan
    heads = min(bias.shape[0], options.max_heads, 4)
    fig = new_figure(3.2 * heads + 1.2, 7.0)
    top, bottom = fig.subfigures(2, 1, height_ratios=[1, 1.3])
    gate_ax = top.subplots()
    for head in range(heads):
        gate_ax.plot(np.exp(log_gates[head] / enc.post_log_scale), color=f"C{head}", label=f"head {head}")
    gate_ax.set_xlabel("token t")
    gate_ax.set_ylabel("forget gate f_t")
    gate_ax.legend(fontsize=8, ncols=heads)
    gate_ax.grid(alpha=0.3)
    low, high = symmetric_limits(bias[:heads])
    image = None
    axes = np.atleast_1d(bottom.subplots(1, heads))
    for head, ax in enumerate(axes):
        image = ax.imshow(bias[head], cmap=DIVERGING, vmin=low, vmax=high, interpolation="nearest")
        ax.set_title(f"head {head}: bias")
        label_grid(ax, "query i", "key j")
    bottom.colorbar(image, ax=list(axes), shrink=0.8, label="bias added to the logit")
    set_title(fig, f"{describe(enc)}: gates and bias of a random input (seed 0)")
    return fig


def _profile(enc: PositionalEncoding, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Bias of the last query (position ``length − 1``) against its distance ``i − j`` to each key."""
    with torch.no_grad():
        row = enc.bias(1, length, q_offset=length - 1)[:, 0, :].double().cpu().numpy()
    distance = (length - 1) - np.arange(length)
    return distance, row


def _draw_profile(ax, enc: PositionalEncoding, options: PlotOptions, labels: list[str] | None = None) -> str:
    """Draw the per-head profile on ``ax``; returns which heads it drew, in words ("8 heads", or
    "the first 8 of 12 heads (--max-heads draws more)")."""
    distance, row = _profile(enc, options.length_or(PROFILE_LENGTH))
    heads = min(row.shape[0], options.max_heads)
    colors = [f"C{h % 10}" for h in range(heads)]
    for head in range(heads):
        label = labels[head] if labels else f"head {head}"
        ax.plot(distance, row[head], color=colors[head], label=label)
    ax.set_xlabel("distance i − j (query minus key)")
    ax.set_ylabel("bias")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    total = row.shape[0]
    return (
        f"the first {heads} of {total} heads (--max-heads draws more)" if heads < total else f"{heads} heads"
    )


@figure(Kind.BIAS, "profile")
def bias_profile(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """Per-head bias of the last query against its distance to each earlier key."""
    fig = new_figure(8, 5)
    shown = _draw_profile(fig.subplots(), enc, options)
    set_title(fig, f"{describe(enc)}: bias against distance, {shown}")
    return fig


@figure("alibi", "slopes")
def alibi_slopes_figure(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """ALiBi: per-head bias against distance, each line labelled with its slope m_h."""
    from .. import functional as F

    slopes = F.alibi_slopes(enc.num_heads).double().numpy()
    fig = new_figure(12, 5)
    line_ax, slope_ax = fig.subplots(1, 2, width_ratios=(2, 1))
    shown = _draw_profile(
        line_ax, enc, options, [f"head {h}: m = 2^{np.log2(m):.3g}" for h, m in enumerate(slopes)]
    )
    line_ax.set_title(f"bias of the last query against distance, {shown}")
    slope_ax.bar(np.arange(len(slopes)), slopes, color=[f"C{h % 10}" for h in range(len(slopes))])
    slope_ax.set_xticks(np.arange(len(slopes)))
    slope_ax.set_yscale("log", base=2)
    slope_ax.set_xlabel("head")
    slope_ax.set_ylabel("slope m_h")
    slope_ax.set_title(f"slopes for {len(slopes)} heads")
    set_title(fig, describe(enc))
    return fig


@figure("t5", "buckets", square=True)
def t5_buckets(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """T5: bucket id of every (query, key) pair of a small grid, and bucket against key − query."""
    if not isinstance(enc, T5Bias):
        raise TypeError(f"the buckets figure draws a T5Bias, got {type(enc).__name__}")
    length = options.length_or(T5_GRID)
    positions = torch.arange(length)
    grid = enc.buckets(positions[None, :] - positions[:, None])
    reach = int(1.5 * enc.max_distance)
    relative = torch.arange(-reach, reach + 1)
    return index_figure(
        grid.numpy(),
        relative.numpy(),
        enc.buckets(relative).numpy(),
        title=f"{describe(enc)}: bucket ids",
        curve_xlabel="relative position r = j − i (key minus query)",
        value_label="bucket",
        marks={"±max_distance": enc.max_distance},
    )
