"""N-D positions for the learned rotation families (ComRoPE, LieRE, STRING): one coordinate per axis.

A token's position is a point ``x ∈ R^A`` (``A = num_axes``). Three ways to give it, in this order:

* ``with encoding.position_ids(ids):`` an ``[A, B, T]`` (or ``[A, T]``) tensor of coordinates,
  integer or real (image patch centres, video time steps), for the tokens of the calls inside the
  block, as :meth:`posenc.encodings.mrope.MRoPE.position_ids` takes its ids;
* ``grid_width`` (``A = 2``): the layer's integer positions are row-major patch indices, split into
  ``(row, col)`` as :class:`~posenc.encodings.axial_rope.AxialRoPE` splits them;
* otherwise every axis equals the token's position (text tokens: M-RoPE's convention), so the
  encoding is a 1-D one along ``A_1 + … + A_A``.

Coordinates are returned as ``[B, T, A]`` in float32 (float64 when asked, for references).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from .base import checks_values
from .sinusoidal2d import grid_row_col


def check_axes(name: str, num_axes: int, grid_width: int | None) -> None:
    """``num_axes`` a positive int; ``grid_width`` (when given) positive, with ``num_axes == 2``."""
    if isinstance(num_axes, bool) or not isinstance(num_axes, int) or num_axes < 1:
        raise ValueError(f"{name}: num_axes must be a positive int, got num_axes={num_axes!r}")
    if grid_width is not None:
        if isinstance(grid_width, bool) or not isinstance(grid_width, int) or grid_width < 1:
            raise ValueError(f"{name}: grid_width must be a positive int, got grid_width={grid_width!r}")
        if num_axes != 2:
            raise ValueError(
                f"{name}: grid_width splits a patch index into (row, col), two axes; got num_axes={num_axes}"
            )


class AxisPositions:
    """Mixin: ``position_ids`` (a context manager) and :meth:`axis_coords` for an encoding with
    ``self.name``, ``self.num_axes`` and ``self.grid_width``."""

    name: str
    num_axes: int
    grid_width: int | None
    _ids: Tensor | None = None

    @contextlib.contextmanager
    def position_ids(self, ids: Tensor) -> Iterator[None]:
        """Use ``A``-axis coordinates ``ids [A, B, T]`` (or ``[A, T]``; ``A = num_axes``) for the tokens
        of the calls inside the block; integer or real-valued, finite."""
        if not isinstance(ids, Tensor):
            raise ValueError(f"{self.name}: position ids must be a tensor, got {type(ids).__name__}")
        if ids.dim() == 2:
            ids = ids[:, None]
        if ids.dim() != 3 or ids.shape[0] != self.num_axes or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(
                f"{self.name}: position ids must be a tensor [{self.num_axes}, B, T] or [{self.num_axes}, T] "
                f"(num_axes={self.num_axes}), got {tuple(ids.shape)} {ids.dtype}"
            )
        if (
            ids.is_floating_point()
            and ids.numel()
            and checks_values()
            and not bool(torch.isfinite(ids).all())
        ):
            raise ValueError(f"{self.name}: position ids must be finite, got a nan or inf")
        previous, self._ids = self._ids, ids
        try:
            yield
        finally:
            self._ids = previous

    def axis_coords(
        self,
        positions: Tensor,
        length: int,
        what: str,
        dtype: torch.dtype = torch.float32,
        batch: int | None = None,
    ) -> Tensor:
        """The coordinates ``[B, T, A]`` of the ``length`` tokens whose layer positions are ``positions [B, T]``.

        ``batch``: the batch of the ``what`` (queries or keys) ``[B, H, T, D]``, which ids
        ``[A, B, T]`` must match (or broadcast from, ``B = 1``).
        """
        if self._ids is not None:
            if self._ids.shape[-1] != length:
                raise ValueError(
                    f"{self.name}: {self.num_axes}-axis position ids cover {self._ids.shape[-1]} tokens but the "
                    f"{what} have {length} (set ids for the new tokens of this call)"
                )
            check_ids_batch(self.name, self._ids, batch, what)
            return self._ids.to(device=positions.device, dtype=dtype).permute(1, 2, 0)
        if self.grid_width is not None:
            if positions.is_floating_point():
                raise ValueError(
                    f"{self.name}: with grid_width a position is a patch index (an integer), got {positions.dtype}; "
                    "give real coordinates through position_ids instead"
                )
            rows, cols = grid_row_col(positions, self.grid_width)
            return torch.stack([rows, cols], dim=-1).to(dtype)
        return positions.to(dtype)[..., None].expand(*positions.shape, self.num_axes)


def check_ids_batch(name: str, ids: Tensor, batch: int | None, what: str) -> None:
    """Position ids ``[A, B_ids, T]`` serve a call of batch ``batch``: ``B_ids`` is 1 (every row) or ``batch``.

    Checked here, where the ids meet the call, so the error names the ids rather than the kernel
    (an einsum or a cos/sin shape) that would fail on them; ``batch`` None: not checked.
    """
    rows = ids.shape[1]
    if batch is not None and rows not in (1, batch):
        raise ValueError(
            f"{name}: position ids have batch {rows} but the {what} have batch {batch}; give ids "
            f"[{ids.shape[0]}, {batch}, T] for this call (or [{ids.shape[0]}, T] for the same ids on every row)"
        )


def head_groups(per_head: Tensor, heads: int, name: str) -> Tensor:
    """Rows of ``per_head [Hp, ...]`` for ``heads`` heads: all of them (``Hp == heads``), the one shared
    row (``Hp == 1``), or, for the ``heads`` key/value heads of grouped-query attention, the first
    query head of each group (``(h · Hp/heads)``), so a query head and its key head share a rotation."""
    have = per_head.shape[0]
    if have == 1 or have == heads:
        return per_head
    if have % heads:
        raise ValueError(
            f"{name}: {have} per-head rotations (num_heads) cannot be grouped over {heads} heads; "
            "num_heads must be a multiple of the key/value heads"
        )
    index = torch.arange(heads, device=per_head.device) * (have // heads)
    return per_head[index]
