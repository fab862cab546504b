"""Figures of CONTENT encodings with a relative-embedding table: which table row each
(query, key) pair reads (Shaw's clipped ``j − i``, DeBERTa's clamped, log-bucketed ``i − j``).
"""

from __future__ import annotations

import torch
from matplotlib.figure import Figure

from .. import functional as F
from ..encodings.base import PositionalEncoding
from .index_maps import index_figure
from .registry import PlotOptions, describe, figure

DEFAULT_GRID = 8


def _grid_positions(options: PlotOptions) -> torch.Tensor:
    return torch.arange(options.length_or(DEFAULT_GRID))[None]


@figure("shaw", "index", square=True)
def shaw_index(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """Shaw: the clipped relative index clip(j − i, −k, k) + k of every (query, key) pair."""
    config = enc.config()
    k, max_len = config["k"], config["max_len"]
    positions = _grid_positions(options)
    grid = F.shaw_relative_index(positions, positions, k, max_len)[0]
    # Keys around one query in the middle of the unclipped range show the clipping at ±k.
    reach = 2 * k + 4 if k is not None else max_len - 1
    query = torch.tensor([[reach]])
    keys = torch.arange(0, 2 * reach + 1)[None]
    row = F.shaw_relative_index(query, keys, k, max_len)[0, 0]
    clip = f"k = {k}" if k is not None else f"unclipped, max_len = {max_len}"
    return index_figure(
        grid.numpy(),
        (keys[0] - reach).numpy(),
        row.numpy(),
        title=f"{describe(enc)}: relative table row ({clip})",
        curve_xlabel="relative position j − i (key minus query)",
        value_label="table row",
        marks={"±k": k} if k is not None else None,
    )


@figure("deberta", "index", square=True)
def deberta_index(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """DeBERTa: the relative table row clamp(bucket(i − j) + span, 0, 2·span − 1) of every pair."""
    config = enc.config()
    buckets, max_relative = config["position_buckets"], config["max_relative_positions"]
    max_embeddings = config["max_position_embeddings"]
    positions = _grid_positions(options)
    grid = F.deberta_relative_index(positions, positions, buckets, max_relative, max_embeddings)[0]
    reach = int(1.25 * (max_relative if max_relative >= 1 else max_embeddings))
    query = torch.tensor([[reach]])
    keys = torch.arange(0, 2 * reach + 1)[None]
    row = F.deberta_relative_index(query, keys, buckets, max_relative, max_embeddings)[0, 0]
    span = F.deberta_att_span(buckets, max_relative, max_embeddings)
    return index_figure(
        grid.numpy(),
        (reach - keys[0]).numpy(),
        row.numpy(),
        title=f"{describe(enc)}: relative table row (span {span}, {2 * span} rows)",
        curve_xlabel="relative position i − j (query minus key)",
        value_label="table row",
        marks={"±max_relative_positions": max_relative} if max_relative >= 1 else None,
    )
