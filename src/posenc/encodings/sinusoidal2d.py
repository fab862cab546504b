"""2-D sin-cos absolute encoding for image patches (MAE / ViT, He et al. 2021; docs/conventions.md §2.3).

A patch at grid row ``r`` and column ``c`` gets, for width ``D`` (divisible by 4) and
``ω_k = base^(-k/(D/4))``, ``k < D/4``, MAE's channel order:

``[sin(c·ω) | cos(c·ω) | sin(r·ω) | cos(r·ω)]``: the first half encodes the **column** ``w`` and the
second the **row** ``h`` (facebookresearch/mae ``get_2d_sincos_pos_embed``; HF ViTMAE swaps the
halves of its generic ``[row | column]`` builder back to this order).

Positions: the layer passes integer positions ``[B, T]``; a position ``p`` is the index of a patch
in the row-major flattened grid, ``row = p // grid_width``, ``col = p % grid_width`` (MAE flattens
patches row-major). With ``cls_token=True`` position 0 is the class token (an all-zero vector,
as MAE's table has) and patch ``p - 1`` sits at position ``p``. Rows are unbounded, so taller
images need no new table. Angles are computed in float64 and the table is float32 (then cast).

Kind ABSOLUTE: added to the input, so attention itself is plain (sdpa or eager).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import AbsoluteEncoding
from .registry import at_least, greater_than, register
from .sinusoidal import sinusoidal

__functional__ = ["sinusoidal_2d", "grid_row_col"]


def grid_row_col(positions: Tensor, grid_width: int, cls_token: bool = False) -> tuple[Tensor, Tensor]:
    """Row and column of row-major patch ``positions`` on a grid ``grid_width`` patches wide.

    With ``cls_token`` the patches start at position 1 (position 0 gets row = col = -1).
    """
    if grid_width <= 0:
        raise ValueError(f"grid_width must be positive, got grid_width={grid_width}")
    patch = positions - 1 if cls_token else positions
    return torch.div(patch, grid_width, rounding_mode="floor"), torch.remainder(patch, grid_width)


def sinusoidal_2d(rows: Tensor, cols: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """MAE's 2-D encoding ``[sin(c·ω) | cos(c·ω) | sin(r·ω) | cos(r·ω)]`` of ``rows``, ``cols`` ``[...]`` → float32 ``[..., dim]``."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 4:
        raise ValueError(f"sinusoidal2d: dim must be a positive multiple of 4, got dim={dim!r}")
    half = dim // 2  # each axis: MAE's 1-D helper on D/2 channels, [sin | cos]
    return torch.cat(
        [sinusoidal(cols, half, base, layout="concat"), sinusoidal(rows, half, base, layout="concat")], dim=-1
    )


@register("sinusoidal2d")
class Sinusoidal2D(AbsoluteEncoding):
    """2-D sin-cos patch encoding in MAE channel order (column sin, cos, then row sin, cos), added to the input."""

    integer_positions_reason = "a position is a patch index, split into a grid row and column"

    layer_sizes = ("dim",)
    option_ranges = {"dim": at_least(4), "grid_width": at_least(1), "base": greater_than(0)}
    example_options = {"grid_width": 4}

    def __init__(self, dim: int, grid_width: int, base: float = 10000.0, cls_token: bool = False) -> None:
        """Args: ``dim`` the model width (filled in by the layer; multiple of 4); ``grid_width``
        patches per row; ``base``; ``cls_token`` (position 0 is a class token with a zero vector)."""
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 4:
            raise ValueError(f"sinusoidal2d: dim must be a positive multiple of 4, got dim={dim!r}")
        self.dim, self.grid_width, self.base, self.cls_token = dim, grid_width, float(base), cls_token

    def encode(self, positions: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """The encoding ``[B, T, dim]`` of integer patch ``positions [B, T]`` (or ``[T]``)."""
        positions = self.check_positions(positions)
        rows, cols = grid_row_col(positions, self.grid_width, self.cls_token)
        table = sinusoidal_2d(rows, cols, self.dim, self.base)
        if self.cls_token:
            table = table.masked_fill((positions == 0)[..., None], 0.0)
        return table.to(dtype or torch.float32)

    def preview(self) -> str:
        first = 1 if self.cls_token else 0
        positions = torch.arange(first, first + min(2 * self.grid_width, 6))
        rows, cols = grid_row_col(positions, self.grid_width, self.cls_token)
        table = self.encode(positions)[0]
        quarter = self.dim // 4
        channels = [0, 1, quarter, quarter + 1, 2 * quarter, 2 * quarter + 1, 3 * quarter, 3 * quarter + 1]
        lines = [
            f"grid_width={self.grid_width}, cls_token={self.cls_token}; channels {channels} "
            "(sin col, cos col, sin row, cos row, first two frequencies each):"
        ]
        for p, r, c, row in zip(
            positions.tolist(), rows.tolist(), cols.tolist(), table[:, channels].tolist()
        ):
            lines.append(f"  p={p} (row {r}, col {c}): " + " ".join(f"{v:+.4f}" for v in row))
        return "\n".join(lines)
