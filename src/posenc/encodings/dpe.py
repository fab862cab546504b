"""DPE: dimension-wise Self-Extend (Lu et al. 2025, "Effective Length Extrapolation via Dimension-Wise
Positional Embeddings Manipulation", arXiv 2504.18857; code: LuLuLuyi/DPE ``dpe_for_llama.py``,
``dpe_flash_forward``, and ``config/dpe_config.yaml``).

Self-Extend (:mod:`~posenc.encodings.self_extend`) gives every frequency pair one group size. DPE splits
RoPE's frequency pairs into equal groups (the reference's ``dimension_groups_range``: 8 groups of 8 of
Llama's 64 pairs) and gives each group its own scale factor ``s_g``. A query at ``i`` and a key at ``j``
closer than the local window ``W`` (``i - j < W``) keep RoPE's positions in every pair; farther pairs
place, in the pairs of group ``g``, the query at ``floor(i / s_g) + W - floor(W / s_g)`` and the key at
``floor(j / s_g)``. Pairs whose effective length is short get a large factor, the others a small one
(the reference's Llama-3-8B setting: ``W = 1024``, factors ``2, 8, 2, 8, 32, 32, 32, 4`` from the
fastest pairs to the slowest). One softmax over both parts (:mod:`~posenc.encodings._rope_parts`; the
reference merges a window flash attention and a shifted one by their log-sum-exp).

Conventions:

* ``factors`` lists one factor per group, fastest pairs first; the rotary pairs split into
  ``len(factors)`` equal groups (a count that does not divide them is refused, naming ``factors``).
  ``factors=G|G|...`` is Self-Extend with ``group_size=G, neighbor_window=W``; all ones is plain RoPE.
* The shift is whole: ``W - floor(W / s_g)``, as the reference's decode step writes it; its prefill
  writes ``W - W / s_g`` (true division), which agrees when ``s_g`` divides ``W``. posenc follows the
  decode form everywhere, so a prefill and its cached decode are one computation (Self-Extend's rule).
* The reference can also keep plain positions in the far part for dimensions outside a per-layer,
  per-head top-k selection read from a file measured on the model (``select_topk_dim``, the
  ``qk_2_norm_selected_dim.pt`` files); that selection is not part of this encoding (every pair of a
  group takes its factor), as in the reference with ``select_topk_dim`` off.
* RoPE's options (``base``, ``pairing``, ``rotary_dim``, fixed-length ``scaling``, ...) are those of
  ``rope``. Causal only; not shift invariant (``floor(i / s_g)``).

Backends: eager and the query-blocked ``relative`` backend (CONTENT kind), with the KV cache
(unrotated keys and their positions); for square causal self-attention the ``piecewise`` backend
runs each part on its tiles through the CPU flash kernel (:mod:`posenc.backends.piecewise`): a far map
holds one position per group, ``[B|1, T, groups]``, and :meth:`DimensionWiseSelfExtend.cos_sin` reads
each group's pairs at its own positions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._rope_parts import (
    ROPE_OPTION_RANGES,
    PartTile,
    PiecewiseRoPE,
    PositionMap,
    window_tiles,
)
from .registry import at_least, register
from .rope import Pairing
from .rope_scaling import RopeScaling

__functional__ = ["dpe_position_maps", "dpe_group_of_pairs"]


def dpe_position_maps(
    q_pos: Tensor, k_pos: Tensor, factors: list[int], window: int
) -> tuple[Tensor, list[PositionMap]]:
    """``(part, [near, far])``: ``part [B|1, Tq, Tk]`` is 1 where ``i - j >= window``; the near map is
    ``(i, j)``, the far one holds group ``g``'s positions in its last axis: query
    ``[B|1, Tq, G]`` at ``i // s_g + W - W // s_g``, key ``[B|1, Tk, G]`` at ``j // s_g``."""
    part = (q_pos[..., :, None] - k_pos[..., None, :] >= window).long()
    s = torch.tensor(factors, dtype=torch.long, device=q_pos.device)
    q_far = q_pos[..., None] // s + (window - window // s)
    k_far = k_pos[..., None] // s
    return part, [(q_pos, k_pos), (q_far, k_far)]


def dpe_group_of_pairs(pairs: int, groups: int) -> Tensor:
    """Which group each of the ``pairs`` rotary pairs belongs to (``[pairs]`` int64, fastest pair
    first): ``pairs / groups`` consecutive pairs per group. ``ValueError`` naming ``factors`` when
    ``groups`` does not divide ``pairs``."""
    if pairs % groups:
        raise ValueError(
            f"dpe: factors has {groups} entries, which do not divide the {pairs} rotary pairs into equal "
            f"groups; give a count that divides {pairs}"
        )
    return torch.arange(pairs) // (pairs // groups)


@register("dpe")
class DimensionWiseSelfExtend(PiecewiseRoPE):
    """DPE (Lu et al. 2025): Self-Extend with its own group factor per group of frequency pairs beyond a local window."""

    option_ranges = {**ROPE_OPTION_RANGES, "window": at_least(1), "factors": at_least(1)}
    example_options: dict[str, Any] = {"window": 4, "factors": [1, 2]}

    def __init__(
        self,
        head_dim: int | None = None,
        *,
        window: int,
        factors: list[int],
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
            window: ``W >= 1`` (the reference's ``local_window_size``); pairs at distance below it keep
                RoPE's positions.
            factors: one scale factor ``s_g >= 1`` per group of frequency pairs, fastest pairs first
                (the reference's ``scale_factors``); their count must divide the rotary pairs.

        ``base``, ``pairing``, ``rotary_dim``, ``partial_rotary_factor``, ``scaling`` and
        ``rope_parameters`` are RoPE's (:class:`~posenc.encodings.rope.RoPE`; fixed-length scalings only).
        """
        if not factors:
            raise ValueError("dpe: factors is empty; give one scale factor per group of frequency pairs")
        super().__init__(
            head_dim, None, base, pairing, rotary_dim, partial_rotary_factor, scaling, rope_parameters
        )
        self.window, self.factors = window, [int(f) for f in factors]
        if self.rope.head_dim is not None:
            self._groups()  # a count that does not divide the pairs fails at once

    def init_layer(self, layer: Any) -> None:
        super().init_layer(layer)
        self._groups()  # a count that does not divide the pairs fails when the layer is built

    def _groups(self) -> Tensor:
        pairs = self.rope.inv_freq.numel()
        return dpe_group_of_pairs(pairs, len(self.factors))

    def parts(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, list[PositionMap]]:
        return dpe_position_maps(q_pos, k_pos, self.factors, self.window)

    def part_tiles(self, first_position: int, length: int) -> list[PartTile]:
        return window_tiles(length, self.window)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """RoPE's float32 ``cos``/``sin`` ``[B|1, T, d_r/2]``: for a near map ``[B|1, T]`` as RoPE's,
        for a far map ``[B|1, T, G]`` each pair's columns read at its group's positions."""
        if positions.dim() == 2:
            return super().cos_sin(positions)
        group = self._groups().to(positions.device)
        tables = [self.rope.cos_sin(positions[..., g]) for g in range(positions.shape[-1])]
        cos = torch.stack([c for c, _ in tables], dim=-1)  # [B|1, T, pairs, G]
        sin = torch.stack([s for _, s in tables], dim=-1)
        pick = group.view(1, 1, -1, 1).expand(*cos.shape[:-1], 1)
        return cos.gather(-1, pick).squeeze(-1), sin.gather(-1, pick).squeeze(-1)

    def preview(self) -> str:
        w = self.window
        query = 3 * w
        rows = []
        for s in sorted(set(self.factors)):
            row = [query - j if query - j < w else query // s + w - w // s - j // s for j in range(query + 1)]
            rows.append(f"factor {s}: {row}")
        return (
            f"window={w}, factors={self.factors}: relative positions of the query at {query} to keys 0..{query}; "
            + "; ".join(rows)
        )
