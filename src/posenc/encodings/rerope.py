"""ReRoPE and Leaky ReRoPE: RoPE inside a window, a rectified relative position beyond it (Su 2023,
"Rectified Rotary Position Embeddings", https://kexue.fm/archives/9708; code: bojone/rerope,
``rerope_patch.py`` and ``leaky_rerope_patch.py``).

For a query at position ``i`` and a key at ``j`` (distance ``d = i - j``, window ``w``), the logit is
RoPE's ``⟨R(i) q_i, R(j) k_j⟩ · scale`` (relative position ``d``) when ``d < w``, and beyond it the
logit of the relative position

* ``w`` (ReRoPE): query rotated at ``w``, key at 0 (the patch's unrotated key);
* ``w + (d - w) / k`` (Leaky ReRoPE, ``leaky_factor = k``): query at ``(i + w(k - 1)) / k``, key at
  ``j / k`` (the patch's linearly scaled second RoPE at ``position + offset``, ``offset = w(k - 1)``).

So distances past the window never reach positions the model was not trained on (ReRoPE) or grow
``k`` times slower (leaky). One softmax over both parts (:mod:`~posenc.encodings._rope_parts`).

Conventions:

* The patches' prefill marks a pair near when ``|d| < w`` and their decode step clamps ``d`` at ``w``;
  both agree on past keys (``d >= 0``), the only ones a causal decoder sees. Both families are causal
  only; a future key takes the near part (masked anyway).
* ``leaky_factor=1`` and a window at least the sequence length are plain RoPE.
* ``log_scale_length=L`` is the patches' optional query scaling ``max(1, log(i + 1) / log L)``
  (their ``training_length``), applied to both parts; off by default. It is computed in float64.
* RoPE's options (``base``, ``pairing``, ``rotary_dim``, fixed-length ``scaling``, ...) are those of
  ``rope``; ``attention_scale`` multiplies both sides of both parts (the patch leaves the far key
  unrotated: without a scaling the two agree).
* Shift invariant: both parts depend on ``i - j`` only.

Backends: eager and the query-blocked ``relative`` backend (CONTENT kind), with the KV cache
(unrotated keys and their positions); for square causal self-attention the ``piecewise`` backend
runs each part on its tiles through the CPU flash kernel (:mod:`posenc.backends.piecewise`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._rope_parts import (
    LOG_SCALE_RANGE,
    ROPE_OPTION_RANGES,
    PartTile,
    PiecewiseRoPE,
    PositionMap,
    as_positions,
    window_tiles,
)
from .registry import at_least, register
from .rope import Pairing
from .rope_scaling import RopeScaling

__functional__ = ["rerope_relative_position", "rerope_position_maps"]


def rerope_relative_position(distance: Tensor, window: int, leaky_factor: float | None = None) -> Tensor:
    """The relative position ReRoPE gives a pair at ``distance = i - j``: ``d`` below ``window``, then
    ``window`` (``leaky_factor`` None) or ``window + (d - window) / leaky_factor`` (float64)."""
    distance = distance.double()
    far = (
        torch.full_like(distance, float(window))
        if leaky_factor is None
        else window + (distance - window) / leaky_factor
    )
    return torch.where(distance < window, distance, far)


def rerope_position_maps(
    q_pos: Tensor, k_pos: Tensor, window: int, leaky_factor: float | None = None
) -> tuple[Tensor, list[PositionMap]]:
    """``(part, [near, far])``: ``part [B|1, Tq, Tk]`` is 1 where ``i - j >= window``, and each map is
    ``(query positions, key positions)``: near ``(i, j)``; far ``(window, 0)`` (ReRoPE) or
    ``((i + window·(k - 1)) / k, j / k)`` (leaky, ``k = leaky_factor``; float64)."""
    part = (q_pos[..., :, None] - k_pos[..., None, :] >= window).long()
    if leaky_factor is None:
        far = (as_positions(window, q_pos), as_positions(0, k_pos))
    else:
        far = ((q_pos.double() + window * (leaky_factor - 1)) / leaky_factor, k_pos.double() / leaky_factor)
    return part, [(q_pos, k_pos), far]


class _Rectified(PiecewiseRoPE):
    """What ReRoPE and Leaky ReRoPE share: the two parts of :func:`rerope_position_maps`."""

    shift_invariant = True
    window: int
    leaky_factor: float | None

    def parts(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, list[PositionMap]]:
        return rerope_position_maps(q_pos, k_pos, self.window, self.leaky_factor)

    def part_tiles(self, first_position: int, length: int) -> list[PartTile]:
        return window_tiles(length, self.window)

    def preview(self) -> str:
        distances = torch.arange(0, 2 * self.window + 3)
        relative = rerope_relative_position(distances, self.window, self.leaky_factor)
        pairs = ", ".join(f"{int(d)}→{float(r):g}" for d, r in zip(distances, relative))
        return f"relative position by distance i - j (window={self.window}): {pairs}"


_RANGES = {**ROPE_OPTION_RANGES, "window": at_least(1), "log_scale_length": LOG_SCALE_RANGE}


@register("rerope")
class ReRoPE(_Rectified):
    """ReRoPE (Su 2023): RoPE within a window; beyond it every pair sits at the window's relative position."""

    option_ranges = _RANGES
    example_options: dict[str, Any] = {"window": 4}

    def __init__(
        self,
        head_dim: int | None = None,
        *,
        window: int,
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
            window: ``w``; pairs at distance below it keep RoPE's positions.
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
        self.window, self.leaky_factor = window, None


@register("leaky_rerope")
class LeakyReRoPE(_Rectified):
    """Leaky ReRoPE (Su 2023): RoPE within a window; beyond it relative positions grow leaky_factor times slower."""

    option_ranges = {**_RANGES, "leaky_factor": at_least(1)}
    example_options: dict[str, Any] = {"window": 4, "leaky_factor": 3.0}

    def __init__(
        self,
        head_dim: int | None = None,
        *,
        window: int,
        leaky_factor: float,
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
            window: ``w``; pairs at distance below it keep RoPE's positions.
            leaky_factor: ``k >= 1``; a pair at distance ``d >= w`` sits at ``w + (d - w) / k``
                (the patch's ``scaling_factor``; 1 is plain RoPE).
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
        self.window, self.leaky_factor = window, float(leaky_factor)
