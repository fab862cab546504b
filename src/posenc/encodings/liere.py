"""LieRE: Lie group relative position encodings (Ostmeier et al., ICML 2025, "LieRE: Lie Rotational
Positional Encodings", arXiv 2406.10322; code: github.com/StanfordMIMI/LieRE, ``models/rope_vit.py``).

A token at the point ``x ∈ R^A`` (``A = num_axes``) has its query and key multiplied by

    ``R(x) = exp(x_1 G_1 + … + x_A G_A)``,

with one dense, learned, skew-symmetric generator ``G_i`` per axis. The authors'
``LierePositionEncoder`` (``phase_type="learned"``) and ``FlexibleAttention.apply_transforms``:

* the generators are ``generator_dim × generator_dim`` (``g``; the authors' default 64, the head
  size: dense), ``m = ⌊d/g⌋`` of them per axis side by side on the channels ``r·g … (r+1)·g − 1``;
  channels past ``m·g`` pass through;
* from raw parameters ``W`` drawn ``U(0, 2π)`` (``init_scale``; RoPE-Mixed's angle range), the
  generator is ``U − Uᵀ`` with ``U = triu(W, 1)`` (the code subtracts 0.5 from ``triu(W, 1)``
  before antisymmetrising, which cancels);
* one set per head (``per_head=True``, the authors' CIFAR and ImageNet runs) or shared by the
  heads; each layer its own (one encoding per layer, ``rotary_embedding_per_layer``);
* ``R = torch.matrix_exp(Σ_i x_i G_i)`` in float32 and ``q' = R q`` (column vectors).

The generators of different axes do not commute, so in 2-D and more ``R(a)ᵀ R(b) ≠ R(b − a)``:
attention depends on the absolute coordinates, not only on their difference (the test shows it).
Along one axis (``num_axes=1``, or every axis equal to the token position) ``R(p) = exp(p G)`` is
a one-parameter group and the scores are relative again, which is what ``shift_invariant`` states
for the layer's 1-D positions (docs/conventions.md §7.13).

Positions as ComRoPE's (:mod:`posenc.encodings._axes`): ``position_ids`` with real coordinates
(the authors use ``linspace(0, 1)`` per axis), ``grid_width`` for patch indices, or the token
position on every axis. Grouped-query attention: a key head uses its group's first query head's
generators. ``R`` is formed in float32 (float64 with float64 parameters) and cast to the
activations' dtype; whole token positions on every axis take ComRoPE's power form
(:func:`~posenc.encodings.comrope.apply_power_rotation`, one ``matrix_exp`` per bit of the largest
position, not per token).

Backends: sdpa and eager (q and k are rotated before the kernel, which then sees plain attention).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ._axes import AxisPositions, check_axes, head_groups
from .base import RotaryEncoding
from .comrope import block_rotations, rotate_grouped
from .registry import at_least, register
from .spec import format_spec

__functional__ = ["liere_generators"]

#: The largest ``init_scale``: the raw entries are angles per unit coordinate, and float32
#: ``matrix_exp`` of ``x·G`` stops being a rotation as ``|x·G|`` grows (``RᵀR − I`` reaches 5e-4 at
#: coordinate 1 with init_scale 1e3, 0.07 at 1e5, inf at 1e8, nan past it); the authors use 2π.
MAX_INIT_SCALE = 1000.0


def liere_generators(raw: Tensor) -> Tensor:
    """The skew-symmetric generators ``U − Uᵀ``, ``U = triu(raw, 1)``, of raw parameters ``[..., g, g]``.

    Raises:
        ValueError: ``raw`` is not a batch of square matrices (the message names it).
    """
    if raw.dim() < 2 or raw.shape[-1] != raw.shape[-2]:
        raise ValueError(
            f"liere: generator parameters raw must be square [..., g, g], got {tuple(raw.shape)}"
        )
    upper = torch.triu(raw, diagonal=1)
    return upper - upper.transpose(-1, -2)


def _check_init_scale(init_scale: float) -> None:
    """``init_scale`` a number in ``[0, MAX_INIT_SCALE]``: larger angles give no rotation in float32."""
    if (
        isinstance(init_scale, bool)
        or not isinstance(init_scale, (int, float))
        or not (0 <= init_scale <= MAX_INIT_SCALE)
    ):
        raise ValueError(
            f"liere: init_scale must be in [0, {MAX_INIT_SCALE:g}], got init_scale={init_scale!r}: the raw "
            "generator entries are angles per unit coordinate (the authors' 2π), and float32 matrix_exp of "
            "larger ones is no rotation (its error grows with the angle: inf/nan past 1e8)"
        )


@register("liere")
class LieRE(AxisPositions, RotaryEncoding):
    """LieRE (Ostmeier et al. 2025): R(x) = matrix_exp(Σ x_i G_i) with dense learned skew generators."""

    float_positions = True  # exp(x·G) is defined for any real coordinate

    layer_sizes = ("num_heads", "head_dim")
    option_ranges = {
        "num_heads": at_least(1),
        "head_dim": at_least(2),
        "generator_dim": at_least(2),
        "num_axes": at_least(1),
        "grid_width": at_least(1),
        "init_scale": at_least(0),
    }
    shift_invariant = True  # along the token axis; not in 2-D or more (docs/conventions.md §7.13)
    example_options = {"init_scale": 0.5}

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_axes: int = 1,
        generator_dim: int | None = None,
        per_head: bool = True,
        grid_width: int | None = None,
        init_scale: float = 2 * math.pi,
    ) -> None:
        """Args: ``num_heads``, ``head_dim`` (filled in by the layer); ``num_axes`` (coordinates
        per token); ``generator_dim`` (``g``; default ``head_dim``: one dense generator per axis);
        ``per_head`` (a generator set per head, or one shared); ``grid_width`` (two axes from
        row-major patch indices); ``init_scale`` (raw parameters ``U(0, init_scale)``, the
        authors' ``2π``)."""
        super().__init__()
        check_axes("liere", num_axes, grid_width)
        _check_init_scale(init_scale)
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2:
            raise ValueError(f"liere: head_dim must be an int >= 2, got head_dim={head_dim!r}")
        size = head_dim if generator_dim is None else generator_dim
        if isinstance(size, bool) or not isinstance(size, int) or not 2 <= size <= head_dim:
            raise ValueError(
                f"liere: generator_dim must be an int in [2, head_dim={head_dim}], got generator_dim={generator_dim!r}"
            )
        self.num_heads, self.head_dim, self.num_axes, self.grid_width = (
            num_heads,
            head_dim,
            num_axes,
            grid_width,
        )
        self.generator_dim = size
        heads = num_heads if per_head else 1
        raw = torch.rand(heads, num_axes, head_dim // size, size, size) * init_scale
        self.generator_raw = nn.Parameter(raw)

    def config(self) -> dict[str, Any]:
        """The options this instance was built with, leaving out those left at None."""
        return {k: v for k, v in self._config.items() if v is not None}

    def spec(self) -> str:
        """A spec string that rebuilds this encoding (options left at None left out)."""
        return format_spec(self.name, self.config())

    def generators(self, dtype: torch.dtype | None = None) -> Tensor:
        """The skew generators ``[H|1, A, m, g, g]``: ``m`` side-by-side ``g × g`` blocks per axis,
        from the parameters cast to ``dtype`` (default: theirs)."""
        return liere_generators(self.generator_raw if dtype is None else self.generator_raw.to(dtype))

    @property
    def block_width(self) -> int:
        """``g``, the size of a generator block."""
        return self.generator_dim

    def rotations(self, coords: Tensor, heads: int | None = None) -> Tensor:
        """``R(x) [B, H|1, T, m, g, g]`` at coordinates ``coords [B, T, A]`` (``heads`` key/value heads under GQA)."""
        generators = self.generators()
        if heads is not None:
            generators = head_groups(generators, heads, "liere")
        return block_rotations(generators, coords)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"liere: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        return rotate_grouped(self, q, k, q_pos, k_pos)

    def preview(self) -> str:
        m = self.head_dim // self.generator_dim
        rest = self.head_dim - m * self.generator_dim
        heads = self.generator_raw.shape[0]
        return (
            f"{self.num_axes} axis generator(s) of {m} dense {self.generator_dim}x{self.generator_dim} skew block(s)"
            f"{f', {rest} channels pass through' if rest else ''}; {heads} generator set(s) over "
            f"{self.num_heads} heads; R(x) = matrix_exp(Σ x_i G_i) (relative along one axis only)"
        )
