"""Learned absolute positional embeddings (BERT, GPT-2; docs/conventions.md §2.2).

A trainable table ``P ∈ R^{max_len × D}`` (``nn.Embedding``, initialised ``N(0, 0.02²)`` like BERT's
``initializer_range``); token ``t`` at position ``p`` becomes ``x_t + P[p]``. Positions at or past
``max_len`` are undefined and raise a ``ValueError`` naming ``max_len``: there is no extrapolation.

``extend(new_max_len)`` grows the table by linear resampling over positions (the usual way to reuse
a checkpoint at a longer length): new row ``r`` is the old table linearly interpolated at
``x = r·(max_len − 1)/(new_max_len − 1)``, i.e. ``F.interpolate(P.T[None], new_max_len,
mode="linear", align_corners=True)`` computed in float64. The first and last rows are kept exactly;
every old row ``i`` is kept exactly (at new row ``i·(new_max_len − 1)/(max_len − 1)``) when
``max_len − 1`` divides ``new_max_len − 1``. Positions are therefore squeezed, not appended: a
model must be fine-tuned after extending.

Kind ABSOLUTE: added to the input, so attention itself is plain (sdpa or eager).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import AbsoluteEncoding, LayerContext, check_table_size
from .registry import at_least, register

__functional__ = ["resample_positions"]

#: Standard deviation of the initial table, as BERT's ``initializer_range``.
INIT_STD = 0.02


def resample_positions(table: Tensor, new_len: int) -> Tensor:
    """Linearly resample ``table [L, D]`` over its first axis to ``[new_len, D]`` (endpoints aligned).

    Row ``r`` of the result is the table interpolated at ``r·(L − 1)/(new_len − 1)``; computed in
    float64 and returned in the table's dtype. A one-row table is repeated.

    Raises:
        ValueError: ``table`` is not 2-D or empty, or ``new_len`` is not positive.
    """
    if table.dim() != 2 or table.shape[0] == 0:
        raise ValueError(f"table must have shape [L, D] with L >= 1, got {tuple(table.shape)}")
    if isinstance(new_len, bool) or not isinstance(new_len, int) or new_len <= 0:
        raise ValueError(f"new_len must be a positive integer, got {new_len!r}")
    if table.shape[0] == 1:
        return table.expand(new_len, -1).clone()
    channels_first = table.detach().to(torch.float64).T[None]  # [1, D, L]
    resampled = F.interpolate(channels_first, size=new_len, mode="linear", align_corners=True)
    return resampled[0].T.to(table.dtype).contiguous()


@register("learned")
class Learned(AbsoluteEncoding):
    """Trainable absolute position table added to the layer input (BERT, GPT-2)."""

    integer_positions_reason = "a learned table has one row per whole position"

    layer_sizes = ("dim",)
    option_ranges = {"dim": at_least(1), "max_len": at_least(1)}

    @classmethod
    def layer_defaults(cls, ctx: LayerContext) -> dict[str, Any]:
        """The table size ``max_len`` is the model's (when it has one)."""
        return {} if ctx.max_len is None else {"max_len": ctx.max_len}

    def __init__(self, dim: int, max_len: int = 512) -> None:
        """Args: ``dim`` the model width (filled in by the layer); ``max_len`` rows of the table."""
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"learned: dim must be a positive integer, got dim={dim!r}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len <= 0:
            raise ValueError(f"learned: max_len must be a positive integer, got max_len={max_len!r}")
        check_table_size("learned", "max_len", max_len, max_len * dim)
        self.dim, self.max_len = dim, max_len
        self.max_positions = max_len
        self.table = nn.Embedding(max_len, dim)
        nn.init.normal_(self.table.weight, mean=0.0, std=INIT_STD)

    def _limit_hint(self) -> str:
        return f"the table has max_len={self.max_len} rows: build with a larger max_len or call extend(new_max_len)"

    def encode(self, positions: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """The table rows ``[B, T, dim]`` of integer ``positions [B, T]`` (or ``[T]``), in ``dtype``.

        Raises:
            ValueError: a position is negative or ``>= max_len``.
        """
        positions = self.check_positions(positions)
        return self.table(positions.to(self.table.weight.device)).to(dtype or self.table.weight.dtype)

    @torch.no_grad()
    def extend(self, new_max_len: int) -> None:
        """Grow the table to ``new_max_len`` rows by linear resampling (see the module docstring).

        The parameter is replaced in place (same device, dtype and ``requires_grad``); rebuild any
        optimizer that held the old one. ``config()``/``spec()`` then report the new ``max_len``.

        Raises:
            ValueError: ``new_max_len`` is not larger than the current ``max_len``.
        """
        if isinstance(new_max_len, bool) or not isinstance(new_max_len, int) or new_max_len <= self.max_len:
            raise ValueError(
                f"learned: new_max_len must be an integer > max_len={self.max_len}, got {new_max_len!r}"
            )
        old = self.table.weight
        grown = resample_positions(old, new_max_len)
        self.table.weight = nn.Parameter(grown, requires_grad=old.requires_grad)
        self.table.num_embeddings = new_max_len
        self.max_len = self.max_positions = new_max_len
        self._config["max_len"] = new_max_len

    def preview(self) -> str:
        weight = self.table.weight.detach().float()
        shown = min(self.dim, 6)
        lines = [
            f"table [{self.max_len}, {self.dim}] (init N(0, {INIT_STD}²)); rows 0..2, channels 0..{shown - 1}:"
        ]
        for p in range(min(3, self.max_len)):
            lines.append(f"  p={p}: " + " ".join(f"{v:+.4f}" for v in weight[p, :shown].tolist()))
        norms = weight.norm(dim=-1)
        lines.append(f"  row norms: mean {norms.mean():.4f}, min {norms.min():.4f}, max {norms.max():.4f}")
        return "\n".join(lines)
