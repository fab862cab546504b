"""Axial 2-D RoPE for image patches (HF Qwen2-VL vision tower's ``axial`` rope type; docs/conventions.md §9.1).

Half of the rotary pairs turn with the patch's row, the other half with its column, using the same
frequencies on both axes: ``inv_freq_k = base^(-2k/(d/2))`` for ``k < d/4`` and, per pair,

``angles = [row · inv_freq | col · inv_freq]`` (``d/2`` angles).

With ``pairing="half"`` (the default, as HF Qwen2-VL's ``VisionRotaryEmbedding`` +
``apply_rotary_pos_emb_vision``) pair ``k`` is channels ``(k, k + d/2)``; ``"interleaved"``
pairs ``(2k, 2k+1)`` (rotary-embedding-torch's axial layout, which concatenates the axes the same
way). The score between two patches depends only on their row and column offsets.

Positions: integer ``[B, T]`` patch indices of a row-major grid ``grid_width`` patches wide:
``row = p // grid_width``, ``col = p % grid_width`` (see :func:`grid_row_col`). Angles are float32
whatever the model dtype. ``head_dim`` must be divisible by 4.

Backends: sdpa and eager (q and k are rotated before the kernel, which then sees plain attention).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ..kernels.rope import RotaryTables
from .base import RotaryEncoding
from .registry import at_least, greater_than, register
from .rope import apply_cos_sin, check_pairing, rope_inv_freq
from .sinusoidal2d import grid_row_col

__functional__ = ["axial_rope_cos_sin"]


def axial_rope_cos_sin(rows: Tensor, cols: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """Float32 ``cos``/``sin`` ``[..., T, 2·len(inv_freq)]`` of the angles ``[row·inv_freq | col·inv_freq]``."""
    inv_freq = inv_freq.to(device=rows.device, dtype=torch.float32)
    angles = torch.cat(
        [rows.to(torch.float32)[..., None] * inv_freq, cols.to(torch.float32)[..., None] * inv_freq], dim=-1
    )
    return angles.cos(), angles.sin()


@register("axial_rope")
class AxialRoPE(RotaryEncoding):
    """Axial 2-D RoPE for image patches (Qwen2-VL vision): half the pairs rotate with the row, half with the column."""

    integer_positions_reason = "a position is a patch index, split into a grid row and column"

    layer_sizes = ("head_dim",)
    option_ranges = {"head_dim": at_least(4), "grid_width": at_least(1), "base": greater_than(1)}
    derived_buffers = ("tables.inv_freq", "tables.cos", "tables.sin")
    example_options = {"grid_width": 4}

    def __init__(
        self,
        head_dim: int,
        grid_width: int,
        base: float = 10000.0,
        pairing: Literal["half", "interleaved"] = "half",
    ) -> None:
        """Args: ``head_dim`` (filled in by the layer; multiple of 4); ``grid_width`` patches per
        row; ``base``; ``pairing``."""
        super().__init__()
        check_pairing(pairing)
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 4:
            raise ValueError(
                f"axial_rope: head_dim must be a positive multiple of 4, got head_dim={head_dim!r}"
            )
        self.head_dim, self.grid_width, self.base, self.pairing = head_dim, grid_width, float(base), pairing
        self.tables = RotaryTables()
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """The per-axis frequencies ``[D/4]`` and their ``cos``/``sin`` tables, in float32."""
        self.tables.reset(rope_inv_freq(self.head_dim // 2, self.base)[0].to(self.buffer_device))

    @property
    def inv_freq(self) -> Tensor:
        """The per-axis frequencies ``[D/4]`` (float32)."""
        return self.tables.inv_freq

    def _rotate_one(self, x: Tensor, positions: Tensor) -> Tensor:
        rows, cols = grid_row_col(positions, self.grid_width)
        (row_cos, row_sin), (col_cos, col_sin) = self.tables.tables(rows), self.tables.tables(cols)
        cos, sin = torch.cat((row_cos, col_cos), dim=-1), torch.cat((row_sin, col_sin), dim=-1)
        return apply_cos_sin(x, cos, sin, self.pairing)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"axial_rope: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        return self._rotate_one(q, q_pos), self._rotate_one(k, k_pos)

    def preview(self) -> str:
        freqs = ", ".join(f"{v:.4g}" for v in self.inv_freq.tolist()[:4])
        return (
            f"grid_width={self.grid_width}, pairing={self.pairing}: pairs 0..{self.head_dim // 4 - 1} turn with the row, "
            f"pairs {self.head_dim // 4}..{self.head_dim // 2 - 1} with the column\ninv_freq per axis = [{freqs}, ...]"
        )
