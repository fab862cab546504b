"""STRING, Cayley form: separable translationally invariant position encodings (Schenck et al., ICML
2025, "Learning the RoPEs: Better 2D and 3D Position Encodings with STRING", arXiv 2502.02562).

STRING is ``R(x) = exp(Σ_i x_i L_i)`` with pairwise commuting skew-symmetric generators ``L_i``;
the paper shows every such map is ``Pᵀ RoPE(x) P`` for an orthogonal ``P`` and a RoPE whose pair
angles are linear in the coordinates. Cayley-STRING learns ``P`` as the Cayley transform of a
learned skew-symmetric ``S``:

    ``P = (I − S)(I + S)⁻¹``  (orthogonal for every skew ``S``; ``I + S`` is always invertible),
    ``R(x) = Pᵀ RoPE(x) P``,  ``RoPE(x)``: pair ``k`` turned by ``φ_k(x) = Σ_i x_i ω_ik``.

Because ``RoPE(a)ᵀ RoPE(b) = RoPE(b − a)`` and ``PPᵀ = I``, ``R(a)ᵀ R(b) = R(b − a)`` in any
number of dimensions: exact translation invariance (docs/conventions.md §7.14). In a dot product
the leading ``Pᵀ`` cancels (``(Pᵀ u)·(Pᵀ v) = u·v``); ``left_factor=False`` leaves it out (the
scores are the same, one ``D × D`` product per token cheaper; ``R(a)ᵀR(b) = R(b − a)`` then holds
for ``R = RoPE·P`` only up to that left factor).

Conventions here: ``S = U − Uᵀ`` with ``U = triu(W, 1)`` of a trainable ``W [H|1, D, D]``
(``cayley_raw``), zero at initialisation, so STRING starts as the RoPE below (``P = I``); one ``P``
per head (``per_head=True``) or shared. Frequencies ``ω [A, D/2]`` (``freqs``) are trainable and
start axial: pair ``k`` turns with axis ``k mod A`` at RoPE's ``θ_k = base^(−2k/D)`` (one axis:
RoPE's frequencies). RoPE's pairing ``"half"`` (``(k, k + D/2)``) or ``"interleaved"``. Column
vectors, ``q' = R(x) q``. Positions as ComRoPE's (:mod:`posenc.encodings._axes`): ``position_ids``
with real coordinates, ``grid_width`` for patch indices, or the token position on every axis.
Grouped-query attention: a key head uses its group's first query head's ``P``. ``P`` is formed
by a linear solve in float32 (float64 with float64 parameters) and cast to the activations' dtype.

Backends: sdpa and eager (q and k are transformed before the kernel, which then sees plain attention).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ._axes import AxisPositions, check_axes, head_groups
from .base import RotaryEncoding
from .liere import liere_generators
from .registry import at_least, greater_than, register
from .rope import Pairing, apply_cos_sin, check_pairing, rope_inv_freq
from .spec import format_spec

__functional__ = ["cayley_orthogonal", "string_init_freqs", "apply_string"]


def cayley_orthogonal(S: Tensor) -> Tensor:
    """The Cayley transform ``P = (I − S)(I + S)⁻¹`` of skew-symmetric ``S [..., D, D]`` (orthogonal).

    Computed as ``solve(I + S, I − S)`` (the two factors commute), in the wider of float32 and ``S``'s dtype.

    Raises:
        ValueError: ``S`` is not a batch of square matrices (the message names ``S``).
    """
    if S.dim() < 2 or S.shape[-1] != S.shape[-2]:
        raise ValueError(f"cayley_orthogonal: S must be square matrices [..., D, D], got {tuple(S.shape)}")
    S = S.to(torch.promote_types(S.dtype, torch.float32))
    eye = torch.eye(S.shape[-1], dtype=S.dtype, device=S.device)
    return torch.linalg.solve(eye + S, eye - S)


def string_init_freqs(head_dim: int, num_axes: int = 1, base: float = 10000.0) -> Tensor:
    """The initial frequencies ``ω [A, D/2]`` (float32): pair ``k`` turns with axis ``k mod A`` at ``base^(−2k/D)``."""
    inv_freq, _ = rope_inv_freq(head_dim, base)
    axis = torch.arange(inv_freq.shape[0]) % num_axes
    keep = axis[None, :] == torch.arange(num_axes)[:, None]
    return torch.where(keep, inv_freq[None, :], torch.zeros(()))


def apply_string(
    x: Tensor, P: Tensor, cos: Tensor, sin: Tensor, pairing: Pairing = "half", left_factor: bool = True
) -> Tensor:
    """``Pᵀ RoPE(x) P`` applied to ``x [B, H, T, D]`` (column vectors): ``P [H|1, D, D]``; ``cos``/``sin``
    ``[B|1, T, D/2]`` of the pair angles; ``left_factor=False`` stops after ``RoPE · P``."""
    P = P.to(x.dtype)
    mixed = x @ P.transpose(-1, -2)[None]  # row-vector form of P x
    turned = apply_cos_sin(mixed, cos, sin, pairing)
    return turned @ P[None] if left_factor else turned  # row-vector form of Pᵀ y


@register("string")
class STRING(AxisPositions, RotaryEncoding):
    """Cayley-STRING (Schenck et al. 2025): R(x) = Pᵀ RoPE(x) P with a learned orthogonal P = Cayley(S)."""

    float_positions = True  # the angles Σ x_i ω_ik are defined for any real coordinate

    layer_sizes = ("num_heads", "head_dim")
    option_ranges = {
        "num_heads": at_least(1),
        "head_dim": at_least(2),
        "num_axes": at_least(1),
        "grid_width": at_least(1),
        "base": greater_than(1),
    }
    shift_invariant = True

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_axes: int = 1,
        base: float = 10000.0,
        per_head: bool = True,
        pairing: Pairing = "half",
        left_factor: bool = True,
        grid_width: int | None = None,
    ) -> None:
        """Args: ``num_heads``, ``head_dim`` (filled in by the layer; even); ``num_axes``
        (coordinates per token); ``base`` (the initial frequencies, RoPE's); ``per_head`` (one
        ``P`` per head, or shared); ``pairing`` of the RoPE factor; ``left_factor`` (apply the
        leading ``Pᵀ``, which cancels in the scores); ``grid_width`` (two axes from row-major
        patch indices)."""
        super().__init__()
        check_axes("string", num_axes, grid_width)
        check_pairing(pairing)
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"string: head_dim must be a positive even integer, got head_dim={head_dim!r}")
        self.num_heads, self.head_dim, self.num_axes, self.grid_width = (
            num_heads,
            head_dim,
            num_axes,
            grid_width,
        )
        self.pairing, self.left_factor = pairing, left_factor
        heads = num_heads if per_head else 1
        self.cayley_raw = nn.Parameter(torch.zeros(heads, head_dim, head_dim))
        self.freqs = nn.Parameter(string_init_freqs(head_dim, num_axes, base))

    def config(self) -> dict[str, Any]:
        """The options this instance was built with, leaving out those left at None."""
        return {k: v for k, v in self._config.items() if v is not None}

    def spec(self) -> str:
        """A spec string that rebuilds this encoding (options left at None left out)."""
        return format_spec(self.name, self.config())

    def orthogonal(self) -> Tensor:
        """``P [H|1, D, D]``, the Cayley transform of ``S = U − Uᵀ``."""
        return cayley_orthogonal(liere_generators(self.cayley_raw))

    def _cos_sin(self, coords: Tensor) -> tuple[Tensor, Tensor]:
        angles = coords @ self.freqs.to(coords.dtype)  # [B, T, D/2]
        return angles.cos(), angles.sin()

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"string: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        kv_heads = k.shape[1]
        if q.shape[1] % max(kv_heads, 1):
            raise ValueError(f"string: {q.shape[1]} query heads are not a multiple of {kv_heads} key heads")
        group = q.shape[1] // max(kv_heads, 1)
        dtype = torch.promote_types(self.freqs.dtype, torch.float32)
        P = head_groups(self.orthogonal(), kv_heads, "string")
        q_P = P.repeat_interleave(group, dim=0) if group > 1 and P.shape[0] > 1 else P
        k_cos, k_sin = self._cos_sin(self.axis_coords(k_pos, k.shape[2], "keys", dtype, k.shape[0]))
        if q_pos is k_pos and q.shape[2] == k.shape[2]:
            q_cos, q_sin = k_cos, k_sin
        else:
            q_cos, q_sin = self._cos_sin(self.axis_coords(q_pos, q.shape[2], "queries", dtype, q.shape[0]))
        return (
            apply_string(q, q_P, q_cos, q_sin, self.pairing, self.left_factor),
            apply_string(k, P, k_cos, k_sin, self.pairing, self.left_factor),
        )

    def preview(self) -> str:
        heads = self.cayley_raw.shape[0]
        return (
            f"{heads} learned orthogonal P (Cayley of a skew S) over {self.num_heads} heads; RoPE with trainable "
            f"frequencies [{self.num_axes}, {self.head_dim // 2}] ({self.pairing} pairing); "
            f"R(x) = {'Pᵀ ' if self.left_factor else ''}RoPE(x) P, translation invariant"
        )
