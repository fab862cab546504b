"""T5 relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer Learning").

Each pair (query ``i``, key ``j``) gets a learned per-head scalar ``table[bucket(j − i), h]``
added to the logits. T5 has no ``1/√d`` logit scaling: to reproduce HF T5 build the layer with
``scale=1.0``.

Bucket function (docs/conventions.md §4.1; equal to mesh-tf and HF ``T5Attention._relative_position_bucket``
for every ``num_buckets``, ``max_distance`` and direction), on ``r = key − query``:

* ``bidirectional=True`` (encoder): half the buckets per direction; future keys (``r > 0``) use the
  upper half; ``n = |r|``. ``bidirectional=False`` (decoder): ``n = max(−r, 0)``, so every future
  key shares bucket 0 with ``r = 0`` (they are masked anyway).
* With ``nb`` buckets for the direction and ``max_exact = nb // 2``: ``n < max_exact`` is its own
  bucket; larger ``n`` get ``min(nb − 1, max_exact + trunc(ln(n/max_exact) / ln(max_distance/
  max_exact)·(nb − max_exact)))``, with the log in float32 divided by a double, as HF does.
* ``max_distance`` is not where saturation starts: with 32 buckets and 128 the last bucket starts
  at ``n = 91`` (bidirectional) or ``n = 113`` (causal). Bidirectional never uses bucket
  ``num_buckets // 2``.

One table serves every layer of a stack (``shared_across_layers``), as T5 shares block 0's bias.
Queries under a KV cache are at ``past_len + arange(Tq)`` (HF ``past_seen_tokens``). Kind BIAS:
``bias_at`` is elementwise, so it is also the flex ``score_mod``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .base import BiasEncoding, LayerContext, NearFar
from .registry import at_least, register

__functional__ = ["t5_bucket"]

#: Standard deviation of the initial bias table.
INIT_STD = 0.02


def _check_options(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    """The bucket function needs at least one exact bucket and a log range above it."""
    smallest = 4 if bidirectional else 2
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < smallest:
        raise ValueError(
            f"t5: num_buckets must be an integer >= {smallest} with bidirectional={bidirectional}, "
            f"got num_buckets={num_buckets!r}"
        )
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance <= max_exact:
        raise ValueError(
            f"t5: max_distance must be an integer > {max_exact} (the exact-bucket range for num_buckets={num_buckets}, "
            f"bidirectional={bidirectional}), got max_distance={max_distance!r}"
        )


def t5_bucket(
    relative_position: Tensor, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
) -> Tensor:
    """T5 bucket ids (int64, in ``[0, num_buckets)``) of integer ``relative_position = key − query``.

    Any shape; elementwise. Raises ``ValueError`` for ``num_buckets`` below 4 (bidirectional) or 2
    (causal), or ``max_distance`` not above the exact range ``max_exact``.
    """
    _check_options(num_buckets, max_distance, bidirectional)
    r = relative_position.long()
    if bidirectional:
        per_direction = num_buckets // 2
        offset = (r > 0).long() * per_direction  # future keys: upper half
        n = r.abs()
    else:
        per_direction = num_buckets
        offset = torch.zeros_like(r)
        n = (-r).clamp(min=0)  # future keys collapse onto n = 0
    max_exact = per_direction // 2
    # Clamp inside the log so small n (whose result is discarded) never evaluates log(0).
    scaled = n.clamp(min=max_exact).float() / max_exact
    log_bucket = (
        max_exact
        + (torch.log(scaled) / math.log(max_distance / max_exact) * (per_direction - max_exact)).long()
    )
    log_bucket = log_bucket.clamp(max=per_direction - 1)
    return offset + torch.where(n < max_exact, n, log_bucket)


@register("t5")
class T5Bias(BiasEncoding):
    """Learned per-head scalar bias on log-spaced relative-distance buckets (T5)."""

    integer_positions_reason = "T5 buckets whole relative distances, one learned bias per bucket"

    layer_sizes = ("num_heads",)
    option_ranges = {"num_heads": at_least(1), "num_buckets": at_least(2), "max_distance": at_least(1)}

    @classmethod
    def layer_defaults(cls, ctx: LayerContext) -> dict[str, Any]:
        """Bidirectional buckets for a layer without a causal mask, causal buckets for a causal one."""
        return {"bidirectional": not ctx.causal}

    shift_invariant = True
    shared_across_layers = True

    def __init__(
        self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
    ) -> None:
        """Args: ``num_heads`` (filled in by the layer); ``num_buckets``; ``max_distance``;
        ``bidirectional`` (True for encoders, False for causal decoders)."""
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"t5: num_heads must be a positive integer, got num_heads={num_heads!r}")
        _check_options(num_buckets, max_distance, bidirectional)
        self.num_heads, self.num_buckets = num_heads, num_buckets
        self.max_distance, self.bidirectional = max_distance, bidirectional
        self.table = nn.Embedding(num_buckets, num_heads)  # HF relative_attention_bias: [buckets, heads]
        nn.init.normal_(self.table.weight, mean=0.0, std=INIT_STD)

    def buckets(self, relative_position: Tensor) -> Tensor:
        """Bucket ids of ``relative_position = key − query`` with this encoding's options."""
        return t5_bucket(relative_position, self.num_buckets, self.max_distance, self.bidirectional)

    def bias_at(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``table[bucket(k_pos − q_pos), head]`` for broadcastable integer tensors.

        float32, or float64 when the table is float64 (never narrower than float32). The table is
        promoted before it is indexed, so the gather's backward sums the gradient of each entry (over
        every pair in its bucket, ~L² of them) in float32: indexed in bfloat16, that sum lost 30-60%.
        """
        weight = self.table.weight
        weight = weight.to(torch.promote_types(weight.dtype, torch.float32))
        return weight[self.buckets(k_pos - q_pos), head]

    def near_far(self) -> NearFar:
        """Beyond the distance from which every bucket is the last of its direction (with 32 buckets
        and ``max_distance=128``: 91 bidirectional, 113 causal) the bias is one table entry."""
        return NearFar(far_constant_beyond=self._last_bucket_distance())

    def _last_bucket_distance(self) -> int:
        n = torch.arange(self.max_distance + 1)
        last = self.buckets(-n) == self.buckets(torch.tensor([-self.max_distance]))
        beyond = int(n[~last].max()) + 1
        if self.bidirectional:
            last_after = self.buckets(n) == self.buckets(torch.tensor([self.max_distance]))
            beyond = max(beyond, int(n[~last_after].max()) + 1)
        return beyond

    def preview(self) -> str:
        distances = torch.arange(-20, 21)
        row = self.buckets(distances).tolist()
        direction = "bidirectional" if self.bidirectional else "causal"
        lines = [
            f"{direction}, num_buckets={self.num_buckets}, max_distance={self.max_distance}; "
            "bucket of r = key - query:"
        ]
        for start in range(0, len(row), 14):
            chunk = range(start, min(start + 14, len(row)))
            lines.append("  r      " + " ".join(f"{int(distances[i]):>3}" for i in chunk))
            lines.append("  bucket " + " ".join(f"{row[i]:>3}" for i in chunk))
        return "\n".join(lines)
