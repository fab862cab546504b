"""Self-Extend: grouped attention far, neighbour attention near (Jin et al. 2024, "LLM Maybe LongLM:
Self-Extend LLM Context Window Without Tuning", arXiv 2401.01325; code: datamllab/LongLM,
``self_extend_patch/Llama.py``, ``self_extend_forward``).

A query at position ``i`` and a key at ``j`` closer than the neighbour window ``w_n`` (``i - j < w_n``)
keep RoPE's positions ``(i, j)``. Farther pairs use grouped positions, the query at
``floor(i / G) + w_n - floor(w_n / G)`` and the key at ``floor(j / G)`` (group size ``G``): their
relative position ``floor(i/G) - floor(j/G) + w_n - floor(w_n/G)`` continues the neighbour
window's, so distances up to ``G·(L - w_n) + w_n`` fit in a model trained on ``L`` positions. One
softmax over both parts (:mod:`~posenc.encodings._rope_parts`; the patch's ``torch.where`` of the
two attentions by the neighbour mask).

Conventions:

* The shift is whole: ``w_n - floor(w_n / G)``, as the patch's decode step writes it (``//``). The
  patch's prefill writes ``w_n - w_n / G`` (true division), a fractional query position when ``G``
  does not divide ``w_n``; the two agree when it does. posenc follows the decode form everywhere, so a
  prefill and its cached decode are one computation.
* ``group_size=1`` and a neighbour window at least the sequence length are plain RoPE.
* ``log_scale_length=L`` is the patch's optional query scaling ``max(1, log(i + 1) / log L)``
  (``scale_base``), applied to both parts; off by default. It is computed in float64.
* RoPE's options (``base``, ``pairing``, ``rotary_dim``, fixed-length ``scaling``, ...) are those of
  ``rope``. Causal only (the patch masks future keys); not shift invariant (``floor(i / G)``).

Backends: eager and the query-blocked ``relative`` backend (CONTENT kind), with the KV cache
(unrotated keys and their positions); for square causal self-attention the ``piecewise`` backend
runs each part on its tiles through the CPU flash kernel (:mod:`posenc.backends.piecewise`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._rope_parts import (
    LOG_SCALE_RANGE,
    ROPE_OPTION_RANGES,
    PartTile,
    PiecewiseRoPE,
    PositionMap,
    window_tiles,
)
from .registry import at_least, register
from .rope import Pairing
from .rope_scaling import RopeScaling

__functional__ = ["self_extend_position_maps"]


def self_extend_position_maps(
    q_pos: Tensor, k_pos: Tensor, group_size: int, neighbor_window: int
) -> tuple[Tensor, list[PositionMap]]:
    """``(part, [neighbour, grouped])``: ``part [B|1, Tq, Tk]`` is 1 where ``i - j >= neighbor_window``;
    the neighbour map is ``(i, j)``, the grouped one ``(i // G + w_n - w_n // G, j // G)``."""
    part = (q_pos[..., :, None] - k_pos[..., None, :] >= neighbor_window).long()
    shift = neighbor_window - neighbor_window // group_size
    grouped = (q_pos // group_size + shift, k_pos // group_size)
    return part, [(q_pos, k_pos), grouped]


@register("self_extend")
class SelfExtend(PiecewiseRoPE):
    """Self-Extend (Jin et al. 2024): RoPE in a neighbour window, positions floor-divided by a group size beyond it."""

    option_ranges = {
        **ROPE_OPTION_RANGES,
        "group_size": at_least(1),
        "neighbor_window": at_least(1),
        "log_scale_length": LOG_SCALE_RANGE,
    }
    example_options: dict[str, Any] = {"group_size": 3, "neighbor_window": 4}

    def __init__(
        self,
        head_dim: int | None = None,
        *,
        group_size: int,
        neighbor_window: int,
        log_scale_length: int | None = None,
        base: float = 10000.0,
        pairing: Pairing = "half",
        rotary_dim: int | None = None,
        partial_rotary_factor: float | None = None,
        scaling: str | RopeScaling | dict | None = None,
        rope_parameters: dict | None = None,
    ) -> None:
        """
        Args:
            head_dim: per-head size (filled in by the attention layer).
            group_size: ``G >= 1`` (the patch's ``group_size_1``); far positions are ``floor(p / G)``.
            neighbor_window: ``w_n >= 1`` (the patch's ``group_size_2``); pairs at distance below it
                keep RoPE's positions.
            log_scale_length: ``L`` of the optional query scaling ``max(1, log(i+1)/log L)``; None: off.

        ``base``, ``pairing``, ``rotary_dim``, ``partial_rotary_factor``, ``scaling`` and
        ``rope_parameters`` are RoPE's (:class:`~posenc.encodings.rope.RoPE`; fixed-length scalings only).
        """
        super().__init__(
            head_dim,
            log_scale_length,
            base,
            pairing,
            rotary_dim,
            partial_rotary_factor,
            scaling,
            rope_parameters,
        )
        self.group_size, self.neighbor_window = group_size, neighbor_window

    def parts(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, list[PositionMap]]:
        return self_extend_position_maps(q_pos, k_pos, self.group_size, self.neighbor_window)

    def part_tiles(self, first_position: int, length: int) -> list[PartTile]:
        return window_tiles(length, self.neighbor_window)

    def preview(self) -> str:
        g, w = self.group_size, self.neighbor_window
        query = 2 * w + 2 * g
        shift = w - w // g
        row = [query - j if query - j < w else query // g + shift - j // g for j in range(query + 1)]
        return (
            f"group_size={g}, neighbor_window={w}: relative positions of the query at {query} to keys "
            f"0..{query}: {row}"
        )
