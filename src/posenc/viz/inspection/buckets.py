"""Bucketed relative biases: T5's ``relative_attention_bias`` (each stack's first block, shared by its
layers) and MPNet's (the encoder's, shared likewise).

Found wherever the weights hold a 2-D ``relative_attention_bias.weight`` and the config names
``relative_attention_num_buckets``. A distance ``r = key − query`` falls in a bucket by T5's rule
(:func:`posenc.functional.t5_bucket`, ``docs/conventions.md §4.1``; MPNet's
``relative_position_bucket`` is the same rule), with the config's ``relative_attention_max_distance``
(MPNet's config names none: HF's bucket function defaults to 128, :data:`DEFAULT_MAX_DISTANCE`);
an encoder's buckets are bidirectional, a decoder's causal. The page draws each head's trained bias
against ``r`` with the bucket edges marked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

from ...functional import t5_bucket
from ...pretrained.measures import bias_by_distance, bucket_edges
from .._style import head_grid
from ..registry import new_figure
from .layers import Check, Encoding, Finding, stack_of, stacks
from .model import ModelView

__all__ = ["HEADING", "ID", "INTRO", "BucketFinding", "figures", "find"]

ID = "buckets"
HEADING = "Bucketed relative bias"
INTRO = (
    "One trained scalar per head and bucket is added to the attention logit of a query and key "
    "r = key − query apart; distances share a bucket, exactly near 0 and log-spaced further out. "
    "Each panel is one head's bias against r; grey lines mark where a new bucket starts."
)

#: The max distance of T5's and MPNet's bucket functions when a config names none.
DEFAULT_MAX_DISTANCE = 128


@dataclass(frozen=True)
class BucketFinding(Finding):
    """One bucket table and the bias it gives at each distance.

    Attributes:
        name: the weight's name.
        num_buckets, max_distance, bidirectional: the bucket rule's options.
        distances: ``[N]`` the relative distances ``r = key − query`` drawn.
        buckets: ``[N]`` their bucket ids.
        bias: ``[H, N]`` each head's bias at each distance.
        edges: the distances where a new bucket starts (``bucket_edges``).
    """

    name: str = ""
    num_buckets: int = 0
    max_distance: int = 0
    bidirectional: bool = True
    distances: Any = None
    buckets: Any = None
    bias: Any = None
    edges: Any = None

    def shown(self) -> list[int]:
        """The distances the page's table lists."""
        far, d = int(self.distances[-1]), self.max_distance
        picks = [0, 1, 2, 8, d // 2, d, far]
        signed = sorted({-p for p in picks} | ({p for p in picks} if self.bidirectional else set()))
        return [r for r in signed if int(self.distances[0]) <= r <= far]

    def table(self) -> tuple[list[str], list[list[str]]]:
        shown = self.shown()
        index = {int(r): i for i, r in enumerate(self.distances)}
        rows = [
            [f"head {h}", *(f"{self.bias[h, index[r]]:+.2f}" for r in shown)]
            for h in range(self.bias.shape[0])
        ]
        return ["r = key − query", *(f"{r:+d}" for r in shown)], rows

    def numbers(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_buckets": self.num_buckets,
            "max_distance": self.max_distance,
            "bidirectional": self.bidirectional,
            "edges": [int(e) for e in self.edges],
            "distances": [int(r) for r in self.distances],
            "bias": [[float(v) for v in head] for head in self.bias],
        }


def find(view: ModelView, *, tokens: int) -> list[BucketFinding]:
    """A :class:`BucketFinding` for every 2-D ``relative_attention_bias`` of a config with buckets."""
    if getattr(view.config, "relative_attention_num_buckets", None) is None:
        return []
    names = [
        n for n in view.weights.ending("relative_attention_bias.weight") if len(view.weights.shape(n)) == 2
    ]
    return [_finding(view, name, names) for name in names]


def _finding(view: ModelView, name: str, names: list[str]) -> BucketFinding:
    config = view.config
    stack = stack_of(name, config)
    heads = next(s.heads for s in stacks(config) if s.name == stack)
    table = view.weights.tensor(name)
    num_buckets = int(config.relative_attention_num_buckets)
    named = getattr(config, "relative_attention_max_distance", None)
    max_distance = int(named) if named is not None else DEFAULT_MAX_DISTANCE
    bidirectional = stack != "decoder" and not getattr(config, "is_decoder", False)
    far = 2 * max_distance
    distances = torch.arange(-far, far + 1) if bidirectional else torch.arange(-far, 1)
    buckets = t5_bucket(distances, num_buckets, max_distance, bidirectional)
    edges = bucket_edges(distances, buckets)
    shared = sum(stack_of(n, config) == stack for n in names) == 1
    options = {
        "buckets": num_buckets,
        "max_distance": max_distance
        if named is not None
        else f"{max_distance} (HF's default; the config names none)",
        "direction": "bidirectional" if bidirectional else "causal",
        "table": "one, shared by every layer" if shared else "per layer",
    }
    checks = (
        Check(
            f"{stack}: {name} shape",
            f"{num_buckets} buckets x {heads} heads",
            " x ".join(map(str, table.shape)),
            tuple(table.shape) == (num_buckets, heads),
        ),
    )
    bias = bias_by_distance(table, buckets)
    positive = [int(e) for e in edges if e > 0] or [int(-e) for e in edges if e < 0][::-1]
    summary = (
        f"{name}: {num_buckets} buckets, {options['direction']}, max distance {max_distance}; a new bucket "
        f"starts at |r| = {', '.join(map(str, positive))}; the last bucket holds every |r| >= {positive[-1]}",
        f"bias range {float(bias.min()):+.2f} .. {float(bias.max()):+.2f}; at r = 0 per head: "
        + ", ".join(f"{float(v):+.2f}" for v in bias[:, int((distances == 0).nonzero())]),
    )
    return BucketFinding(
        title=name,
        encodings=(Encoding(stack, None, "bucketed relative bias", "added to the logits", options),),
        checks=checks,
        summary=summary,
        name=name,
        num_buckets=num_buckets,
        max_distance=max_distance,
        bidirectional=bidirectional,
        distances=distances.numpy(),
        buckets=buckets.numpy(),
        bias=bias.numpy(),
        edges=edges.numpy(),
    )


def figures(finding: BucketFinding, label: str) -> list[tuple[str, Figure, str]]:
    """``[(file stem, figure, caption)]``: each head's bias against distance, bucket edges marked."""
    heads = finding.bias.shape[0]
    cols = min(heads, 4)
    fig = new_figure(12.0, 1.0 + 2.3 * -(-heads // cols))
    axes = head_grid(fig, heads, max_cols=cols)
    low, high = float(np.min(finding.bias)), float(np.max(finding.bias))
    pad = 0.05 * (high - low or 1.0)
    linear = max(finding.num_buckets // (4 if finding.bidirectional else 2), 1)  # the exact buckets
    far = int(finding.distances[-1]) or -int(finding.distances[0])
    marks = [t for t in (0, linear, finding.max_distance) if t <= far]
    ticks = sorted({-t for t in marks} | (set(marks) if finding.bidirectional else set()))
    for head, ax in enumerate(axes):
        for edge in finding.edges:
            ax.axvline(edge - 0.5 * np.sign(edge), color="#bbb", lw=0.5, zorder=0)
        ax.step(finding.distances, finding.bias[head], where="mid", color="#235", lw=1.2)
        ax.axvline(0, color="#a33", lw=0.8, ls=":")
        ax.set_xscale("symlog", linthresh=linear)
        ax.set_xticks(ticks, [f"{t:+d}" if t else "0" for t in ticks])
        ax.set_ylim(low - pad, high + pad)
        ax.set_title(f"head {head}", fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in axes[-cols:]:
        ax.set_xlabel("r = key − query (symlog)", fontsize=8)
    fig.suptitle(
        f"{label}: {finding.name} ({finding.num_buckets} buckets, "
        f"{'bidirectional' if finding.bidirectional else 'causal'}, max distance {finding.max_distance})"
    )
    stem = finding.name.removesuffix(".weight").replace(".", "_")
    return [
        (f"buckets_{stem}", fig, f"{finding.name}: the trained bias per head against r, bucket edges in grey")
    ]
