"""xPos: RoPE with an exponential decay per frequency pair (Sun et al. 2022, "A Length-Extrapolatable Transformer").

Queries at position ``n`` are rotated by RoPE and scaled by ``ζ^(n/B)``; keys at position ``m`` are
rotated and scaled by ``ζ^(-m/B)``, with ``ζ_k = (2k + γd) / ((1 + γ)d)`` per pair ``k`` (both
members of a pair share it), ``γ = 0.4`` and ``B = scale_base = 512`` (docs/conventions.md §8, torchscale
``xpos_relative_position.py``). The score is ``Σ_k ζ_k^((n-m)/B) · [pair-k RoPE term]``: it depends
only on ``n - m`` and decays with distance because ``ζ_k < 1``.

Conventions:

* Pairs are interleaved by default (torchscale rotates every two channels); ``pairing="half"``
  is available.
* torchscale centres the scale exponent on the middle of the current sequence; the centre cancels
  in every score, so posenc uses ``(position - scale_center)/B`` with a fixed ``scale_center``
  (default 0). A fixed centre is what makes KV-cached decoding give exactly the full-pass scores.
  It bounds the usable range instead: ``ζ_0^(-m/B)`` exceeds float32 (and bf16) near
  ``m - scale_center ≈ 35 000`` for ``B = 512``; set ``scale_center`` near the middle of the
  positions you use for very long sequences (float16 overflows from about 4 500).
* Angles and scales are computed in float32 and cast to the activations' dtype.
* Only meaningful for causal attention (keys in the future are amplified), so ``causal_only``.

Backends: sdpa and eager (q and k are transformed before the kernel, which then sees plain attention).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from ..kernels.rope import RotaryTables
from .base import RotaryEncoding
from .registry import Range, at_least, greater_than, register
from .rope import apply_cos_sin, check_pairing, rope_cos_sin, rope_inv_freq

__functional__ = ["xpos_zeta", "apply_xpos"]


def xpos_zeta(head_dim: int, gamma: float = 0.4) -> Tensor:
    """Per-pair decay base ``ζ_k = (2k + γ·d) / ((1 + γ)·d)``, ``[head_dim // 2]`` float32."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"xpos: head_dim must be a positive even number, got head_dim={head_dim}")
    if gamma <= 0:
        raise ValueError(f"xpos: gamma must be positive, got gamma={gamma}")
    return (torch.arange(0, head_dim, 2, dtype=torch.float32) + gamma * head_dim) / ((1 + gamma) * head_dim)


def _xpos_cos_sin(
    positions: Tensor, inv_freq: Tensor, zeta: Tensor, scale_base: float, scale_center: int, downscale: bool
) -> tuple[Tensor, Tensor]:
    """Float32 ``cos·s`` and ``sin·s`` with ``s = ζ^(±(p - centre)/B)`` (minus for keys), shape ``[B, T, d/2]``."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    scale = _xpos_scale(positions, zeta, scale_base, scale_center, downscale)
    return cos * scale, sin * scale


def _xpos_scale(
    positions: Tensor, zeta: Tensor, scale_base: float, scale_center: int, downscale: bool
) -> Tensor:
    """Float32 ``ζ^(±(p - centre)/B)`` ``[B, T, d/2]`` (minus for keys)."""
    power = (positions.to(torch.float32) - scale_center) / scale_base
    if downscale:
        power = -power
    return zeta.to(device=positions.device, dtype=torch.float32) ** power[..., None]


def apply_xpos(
    x: Tensor,
    positions: Tensor,
    *,
    downscale: bool,
    base: float = 10000.0,
    scale_base: float = 512.0,
    gamma: float = 0.4,
    scale_center: int = 0,
    pairing: Literal["half", "interleaved"] = "interleaved",
) -> Tensor:
    """xPos-transform ``x [B, H, T, D]`` at integer ``positions [T]`` or ``[B, T]``.

    ``downscale=False`` for queries (``ζ^(n/B)``), ``True`` for keys (``ζ^(-m/B)``).
    """
    check_pairing(pairing)
    if positions.dim() == 1:
        positions = positions[None]
    inv_freq, _ = rope_inv_freq(x.shape[-1], base)
    cos, sin = _xpos_cos_sin(
        positions, inv_freq, xpos_zeta(x.shape[-1], gamma), scale_base, scale_center, downscale
    )
    return apply_cos_sin(x, cos, sin, pairing)


@register("xpos")
class XPos(RotaryEncoding):
    """xPos (Sun et al. 2022): RoPE times a per-pair decay ζ^((n-m)/B); causal attention only."""

    float_positions = True  # angles p·θ are defined for any real position

    layer_sizes = ("head_dim",)
    option_ranges = {
        "head_dim": at_least(2),
        "base": greater_than(1),
        # upper bounds where the scale still computes: a larger B or γ overflowed the exponent or
        # divided by zero instead of naming the option (the option fuzzer's finds)
        "scale_base": Range(low=0, high=1e9, low_inclusive=False),
        "gamma": Range(low=0, high=1e3, low_inclusive=False),
    }
    derived_buffers = ("zeta", "tables.inv_freq", "tables.cos", "tables.sin")
    shift_invariant = True
    causal_only = True

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        scale_base: float = 512.0,
        gamma: float = 0.4,
        scale_center: int = 0,
        pairing: Literal["half", "interleaved"] = "interleaved",
    ) -> None:
        """Args: ``head_dim`` (filled in by the layer); ``base`` (RoPE θ base); ``scale_base`` ``B``;
        ``gamma`` ``γ``; ``scale_center`` (the position whose scale is 1); ``pairing``."""
        super().__init__()
        check_pairing(pairing)
        self.head_dim, self.base, self.scale_base = head_dim, base, scale_base
        self.gamma, self.scale_center, self.pairing = gamma, scale_center, pairing
        self.tables = RotaryTables()
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """ζ ``[D/2]``, θ ``[D/2]`` and the RoPE ``cos``/``sin`` tables, in float32."""
        self.set_derived("zeta", xpos_zeta(self.head_dim, self.gamma))
        self.tables.reset(rope_inv_freq(self.head_dim, self.base)[0].to(self.buffer_device))

    @property
    def inv_freq(self) -> Tensor:
        """The RoPE frequencies θ ``[D/2]`` (float32)."""
        return self.tables.inv_freq

    def _cos_sin(self, positions: Tensor, downscale: bool) -> tuple[Tensor, Tensor]:
        cos, sin = self.tables.tables(positions)
        scale = _xpos_scale(positions, self.zeta, self.scale_base, self.scale_center, downscale)
        return cos * scale, sin * scale

    @property
    def max_offset(self) -> int:
        """The largest ``|position - scale_center|`` whose scale ``ζ^(±p/B)`` float32 still holds:
        past it the key scale overflows to inf (about 36,000 positions with the defaults)."""
        smallest = float(self.zeta.min())
        return int(self.scale_base * 88.0 / -math.log(smallest))

    def _check_range(self, q_pos: Tensor, k_pos: Tensor) -> None:
        limit = self.max_offset
        for name, pos in (("positions", q_pos), ("key positions", k_pos)):
            if pos.numel() and int((pos - self.scale_center).abs().max()) > limit:
                raise ValueError(
                    f"xpos: {name} reach {int((pos - self.scale_center).abs().max())} from scale_center="
                    f"{self.scale_center}, past the float32 range of its scale ({limit} with "
                    f"scale_base={self.scale_base}): raise scale_base or move scale_center"
                )

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"xpos: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        self._check_range(q_pos, k_pos)
        q_cos, q_sin = self._cos_sin(q_pos, downscale=False)
        k_cos, k_sin = self._cos_sin(k_pos, downscale=True)
        return apply_cos_sin(q, q_cos, q_sin, self.pairing), apply_cos_sin(k, k_cos, k_sin, self.pairing)

    def preview(self) -> str:
        zeta = ", ".join(f"{v:.4f}" for v in self.zeta[:4].tolist())
        decay = ", ".join(f"{float(self.zeta[0]) ** (d / self.scale_base):.4f}" for d in (1, 64, 512, 1024))
        return f"ζ = [{zeta}{', ...' if self.zeta.numel() > 4 else ''}]\nζ_0^(dist/B) at dist 1, 64, 512, 1024: {decay}"
