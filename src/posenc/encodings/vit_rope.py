"""2-D RoPE for Vision Transformers: RoPE-Mixed (Heo et al. 2024) and DINOv3's RoPE (Siméoni et al. 2025).

Both take the patch positions of :mod:`posenc.encodings.axial_rope`: integer ``[B, T]`` indices of
a row-major grid ``grid_width`` patches wide, ``row = p // grid_width``, ``col = p % grid_width``.
ViTs put a class token (and registers) first: with ``prefix_tokens = n`` positions ``0 … n−1``
are those tokens and are not rotated, and patch ``p − n`` starts at position ``n`` (the default
positions ``0 … T−1`` of a ``[CLS, registers, patches]`` sequence are then right as they are).
Angles are float32 (float64 for float64 parameters) whatever the model dtype
(docs/conventions.md §9.5-§9.6).

* ``rope_mixed`` (timm ``RotaryEmbeddingMixed``, naver-ai rope-vit "RoPE-Mixed"): learned
  frequencies per head, ``freqs [2, H, D/2]``; pair ``k`` of head ``h`` turns by
  ``col · fx[h, k] + row · fy[h, k]``, interleaved pairing ``(2k, 2k+1)`` as timm. Initialised as
  the paper: magnitudes ``base^(−4j/D)`` (``j < D/4``, ``base`` = timm's ``temperature``, 10) in
  two orthogonal directions at a random angle per head. Under grouped-query attention the query
  heads of a key/value group share the frequencies of the group's first head, so scores stay
  relative; with as many key heads as query heads each head has its own.
* ``dinov3_rope`` (HF ``DINOv3ViTRopePositionEmbedding``): fixed frequencies
  ``inv_freq_j = base^(−4j/D)`` (``j < D/4``, ``base`` 100), patch centres normalised to
  ``[−1, 1]`` on a ``grid_height × grid_width`` grid, ``y = 2(row + ½)/grid_height − 1``,
  ``x = 2(col + ½)/grid_width − 1``; angles ``2π·[y·inv_freq | x·inv_freq]`` with half pairing
  (``rotate_half``). In training mode (``module.train()``) the coordinates get DINOv3's
  augmentation, drawn once per :meth:`rotate` call from the global RNG in HF's order: a shift
  ``U[−shift, shift]`` per axis, a jitter ``exp U[−ln jitter, ln jitter]`` per axis, a rescale
  ``exp U[−ln rescale, ln rescale]`` for both; HF draws one transform per model forward and shares
  it across layers, posenc one per layer call. In eval mode nothing is drawn.

Backends: sdpa and eager (q and k are rotated before the kernel, which then sees plain attention).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..kernels.rope import RotaryTables
from .base import RotaryEncoding
from .registry import Range, at_least, greater_than, register
from .rope import apply_cos_sin

__functional__ = [
    "vit_patch_row_col",
    "rope_mixed_init_freqs",
    "rope_mixed_angles",
    "dinov3_rope_inv_freq",
    "dinov3_patch_coords",
    "dinov3_augment_coords",
    "dinov3_cos_sin",
]


def _positive_int(value: object, name: str, encoding: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{encoding}: {name} must be a positive integer, got {name}={value!r}")
    return value


def vit_patch_row_col(
    positions: Tensor, grid_width: int, prefix_tokens: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """``(rows, cols, is_patch)`` of positions ``[...]``: patch ``p − prefix_tokens`` of a row-major grid.

    Prefix positions (``p < prefix_tokens``: class token, registers) get ``is_patch = False`` and
    row = col = 0.
    """
    patch = positions - prefix_tokens
    is_patch = patch >= 0
    patch = patch.clamp(min=0)
    return torch.div(patch, grid_width, rounding_mode="floor"), torch.remainder(patch, grid_width), is_patch


def _rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(2k, 2k+1)`` of ``x [B, H, T, D]`` by per-head ``cos``/``sin`` ``[B|1, H, T, D/2]``."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------- RoPE-Mixed


def rope_mixed_init_freqs(
    num_heads: int, head_dim: int, base: float = 10.0, generator: torch.Generator | None = None
) -> Tensor:
    """The paper's initial frequencies ``[2, H, D/2]`` (x then y): magnitudes ``base^(−4j/D)`` along two
    orthogonal directions at a random angle ``φ_h ~ U[0, 2π)`` per head,
    ``fx = [m cos φ | m cos(φ + π/2)]``, ``fy = [m sin φ | m sin(φ + π/2)]`` (float32)."""
    magnitude = 1.0 / base ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)
    angle = torch.rand(num_heads, 1, generator=generator) * 2 * math.pi
    fx = torch.cat([magnitude * torch.cos(angle), magnitude * torch.cos(angle + math.pi / 2)], dim=-1)
    fy = torch.cat([magnitude * torch.sin(angle), magnitude * torch.sin(angle + math.pi / 2)], dim=-1)
    return torch.stack([fx, fy])


def rope_mixed_angles(rows: Tensor, cols: Tensor, freqs: Tensor) -> Tensor:
    """Angles ``[B, H, T, D/2] = col · fx[h] + row · fy[h]`` for ``rows``/``cols`` ``[B, T]`` and ``freqs [2, H, D/2]``.

    Computed in float32, or float64 for float64 ``freqs``.
    """
    dtype = torch.promote_types(freqs.dtype, torch.float32)
    freqs = freqs.to(dtype)
    cols, rows = cols.to(dtype)[:, None, :, None], rows.to(dtype)[:, None, :, None]
    return cols * freqs[0][None, :, None, :] + rows * freqs[1][None, :, None, :]


@register("rope_mixed")
class RoPEMixed(RotaryEncoding):
    """RoPE-Mixed (Heo et al. 2024; timm RotaryEmbeddingMixed): learned per-head 2-D frequencies on image patches."""

    layer_sizes = ("num_heads", "head_dim")
    option_ranges = {
        "num_heads": at_least(1),
        "head_dim": at_least(4),
        "grid_width": at_least(1),
        "base": greater_than(0),
        "prefix_tokens": at_least(0),
    }
    example_options = {"grid_width": 4}

    def __init__(
        self, num_heads: int, head_dim: int, grid_width: int, base: float = 10.0, prefix_tokens: int = 0
    ) -> None:
        """Args: ``num_heads``, ``head_dim`` (filled in by the layer; ``head_dim`` a multiple of 4);
        ``grid_width`` patches per row; ``base`` the initial magnitudes' base (timm's
        ``temperature``); ``prefix_tokens`` leading tokens that are not rotated (class, registers)."""
        super().__init__()
        _positive_int(num_heads, "num_heads", "rope_mixed")
        if _positive_int(head_dim, "head_dim", "rope_mixed") % 4:
            raise ValueError(f"rope_mixed: head_dim must be a multiple of 4, got head_dim={head_dim}")
        _positive_int(grid_width, "grid_width", "rope_mixed")
        if not base > 0:
            raise ValueError(f"rope_mixed: base must be positive, got base={base}")
        if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) or prefix_tokens < 0:
            raise ValueError(
                f"rope_mixed: prefix_tokens must be a non-negative integer, got {prefix_tokens!r}"
            )
        self.num_heads, self.head_dim, self.grid_width = num_heads, head_dim, grid_width
        self.base, self.prefix_tokens = float(base), prefix_tokens
        self.freqs = nn.Parameter(rope_mixed_init_freqs(num_heads, head_dim, self.base))

    def _head_freqs(self, q_heads: int, kv_heads: int) -> tuple[Tensor, Tensor]:
        """Frequencies ``[2, Hq, D/2]`` and ``[2, Hkv, D/2]``: each key/value group uses its first query head's.

        ``Hq`` is ``num_heads`` in a layer; a probe with fewer query heads (one, for the figures)
        takes every ``num_heads/Hq``-th head.
        """
        if self.num_heads % q_heads or q_heads % kv_heads:
            raise ValueError(
                f"rope_mixed: {q_heads} query heads and {kv_heads} key heads do not fit num_heads={self.num_heads} "
                "(query heads must divide num_heads, key heads the query heads)"
            )
        kv = self.freqs[:, :: self.num_heads // q_heads][:, :: q_heads // kv_heads]
        return kv.repeat_interleave(q_heads // kv_heads, dim=1), kv

    def _rotate_one(self, x: Tensor, positions: Tensor, freqs: Tensor) -> Tensor:
        rows, cols, is_patch = vit_patch_row_col(positions, self.grid_width, self.prefix_tokens)
        angles = rope_mixed_angles(rows, cols, freqs) * is_patch[:, None, :, None]
        return _rotate_interleaved(x, angles.cos(), angles.sin())

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"rope_mixed: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        q_freqs, kv_freqs = self._head_freqs(q.shape[1], k.shape[1])
        return self._rotate_one(q, q_pos, q_freqs), self._rotate_one(k, k_pos, kv_freqs)

    def preview(self) -> str:
        fx, fy = self.freqs.detach()[:, 0, :4].tolist()
        return (
            f"grid_width={self.grid_width}, prefix_tokens={self.prefix_tokens}: head 0 pairs 0..3 turn by "
            f"col·fx + row·fy with fx = {[round(v, 4) for v in fx]}, fy = {[round(v, 4) for v in fy]} "
            "(learned, interleaved pairing)"
        )


# ---------------------------------------------------------------------------- DINOv3


def dinov3_rope_inv_freq(head_dim: int, base: float = 100.0) -> Tensor:
    """``base^(−4j/D)`` for ``j < D/4`` (float32): DINOv3's frequencies, shared by both axes."""
    return 1.0 / base ** (torch.arange(0, head_dim // 4, dtype=torch.float32) * 4 / head_dim)


def dinov3_patch_coords(rows: Tensor, cols: Tensor, grid_height: int, grid_width: int) -> Tensor:
    """Patch centres ``[..., 2]`` as ``(y, x)`` in ``[−1, 1]``: ``2(row + ½)/grid_height − 1``, ``2(col + ½)/grid_width − 1``."""
    y = (rows.to(torch.float32) + 0.5) / grid_height
    x = (cols.to(torch.float32) + 0.5) / grid_width
    return 2.0 * torch.stack([y, x], dim=-1) - 1.0


def dinov3_augment_coords(
    coords: Tensor,
    shift: float | None = None,
    jitter: float | None = None,
    rescale: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """DINOv3's training-time transform of ``coords [..., 2]``, one draw for all of them, in HF's order.

    Shift adds ``U[−shift, shift]`` per axis; jitter multiplies each axis by ``exp U[−ln j, ln j]``;
    rescale multiplies both by one ``exp U[−ln r, ln r]``. Options left at None draw nothing.
    """
    device, dtype = coords.device, coords.dtype
    if shift is not None:
        coords = coords + torch.empty(2, device=device, dtype=dtype).uniform_(
            -shift, shift, generator=generator
        )
    if jitter is not None:
        span = math.log(jitter)
        coords = (
            coords
            * torch.empty(2, device=device, dtype=dtype).uniform_(-span, span, generator=generator).exp()
        )
    if rescale is not None:
        span = math.log(rescale)
        coords = (
            coords
            * torch.empty(1, device=device, dtype=dtype).uniform_(-span, span, generator=generator).exp()
        )
    return coords


def dinov3_cos_sin(coords: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """``cos``/``sin`` ``[..., D/2]`` of the angles ``2π·[y·inv_freq | x·inv_freq]`` (float32), for half pairing."""
    angles = 2 * math.pi * coords.to(torch.float32)[..., None] * inv_freq.to(coords.device, torch.float32)
    angles = angles.flatten(-2)
    return angles.cos(), angles.sin()


@register("dinov3_rope")
class DINOv3RoPE(RotaryEncoding):
    """DINOv3's 2-D RoPE (HF dinov3_vit): patch centres in [−1, 1], with shift / jitter / rescale in training."""

    layer_sizes = ("head_dim",)
    option_ranges = {
        "head_dim": at_least(4),
        "grid_width": at_least(1),
        "grid_height": at_least(1),
        "base": greater_than(1),
        "prefix_tokens": at_least(0),
        "shift": Range(low=0, high=1e4),  # coordinates live in [-1, 1]; past float32's range the draw failed
        "jitter": at_least(1),
        "rescale": at_least(1),
    }
    derived_buffers = (
        "inv_freq",
        "tables.inv_freq",
        "tables.cos",
        "tables.sin",
        "col_tables.inv_freq",
        "col_tables.cos",
        "col_tables.sin",
    )
    example_options = {"grid_width": 4}

    def __init__(
        self,
        head_dim: int,
        grid_width: int,
        grid_height: int | None = None,
        base: float = 100.0,
        prefix_tokens: int = 0,
        shift: float | None = None,
        jitter: float | None = None,
        rescale: float | None = None,
    ) -> None:
        """Args: ``head_dim`` (filled in by the layer; a multiple of 4); ``grid_width`` and
        ``grid_height`` (default: square) patches; ``base`` (HF ``rope_theta``, 100);
        ``prefix_tokens`` leading tokens that are not rotated (class token + registers); ``shift``
        (≥ 0), ``jitter`` and ``rescale`` (≥ 1): the training augmentation (HF ``pos_embed_shift``,
        ``pos_embed_jitter``, ``pos_embed_rescale``; None: off)."""
        super().__init__()
        if _positive_int(head_dim, "head_dim", "dinov3_rope") % 4:
            raise ValueError(f"dinov3_rope: head_dim must be a multiple of 4, got head_dim={head_dim}")
        _positive_int(grid_width, "grid_width", "dinov3_rope")
        grid_height = (
            grid_width if grid_height is None else _positive_int(grid_height, "grid_height", "dinov3_rope")
        )
        if not base > 1:
            raise ValueError(f"dinov3_rope: base must be > 1, got base={base}")
        if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) or prefix_tokens < 0:
            raise ValueError(
                f"dinov3_rope: prefix_tokens must be a non-negative integer, got {prefix_tokens!r}"
            )
        for name, value, low in (("shift", shift, 0.0), ("jitter", jitter, 1.0), ("rescale", rescale, 1.0)):
            if value is not None and not (math.isfinite(value) and value >= low):
                raise ValueError(
                    f"dinov3_rope: {name} must be finite and >= {low:g} (or None: off), got {name}={value}"
                )
        self.head_dim, self.grid_width, self.grid_height = head_dim, grid_width, grid_height
        self.base, self.prefix_tokens = float(base), prefix_tokens
        self.shift, self.jitter, self.rescale = shift, jitter, rescale
        self.inv_freq: Tensor
        # Without augmentation a coordinate is an odd integer n = 2·row + 1 − grid_height over
        # grid_height (the same for columns), so the angles n · 2π·inv_freq/grid_height come from
        # the shared cos/sin cache at |n| (sin is odd in n).
        self.tables, self.col_tables = RotaryTables(), RotaryTables()
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """The frequencies ``[D/4]`` and the row / column ``cos``/``sin`` tables, float32."""
        inv_freq = dinov3_rope_inv_freq(self.head_dim, self.base)
        self.set_derived("inv_freq", inv_freq)
        device = self.buffer_device
        for tables, size in ((self.tables, self.grid_height), (self.col_tables, self.grid_width)):
            tables.reset((2 * math.pi * inv_freq.double() / size).float().to(device))

    def _cached_cos_sin(self, rows: Tensor, cols: Tensor) -> tuple[Tensor, Tensor]:
        """``cos``/``sin`` ``[..., D/2]`` of un-augmented patch centres from the tables."""
        parts = []
        for tables, index, size in (
            (self.tables, rows, self.grid_height),
            (self.col_tables, cols, self.grid_width),
        ):
            odd = 2 * index + 1 - size
            cos, sin = tables.tables(odd.abs())
            parts.append((cos, sin * odd.sign()[..., None]))
        return torch.cat([parts[0][0], parts[1][0]], dim=-1), torch.cat([parts[0][1], parts[1][1]], dim=-1)

    def coords(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``(coords [..., 2] (y, x), is_patch)`` of ``positions``, without augmentation."""
        rows, cols, is_patch = vit_patch_row_col(positions, self.grid_width, self.prefix_tokens)
        return dinov3_patch_coords(rows, cols, self.grid_height, self.grid_width), is_patch

    @staticmethod
    def _rotate_with(x: Tensor, cos: Tensor, sin: Tensor, is_patch: Tensor) -> Tensor:
        keep = is_patch[..., None]
        return apply_cos_sin(x, torch.where(keep, cos, 1.0), torch.where(keep, sin, 0.0), "half")

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"dinov3_rope: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        augmented = self.training and any(v is not None for v in (self.shift, self.jitter, self.rescale))
        if not augmented:
            q_rows, q_cols, q_patch = vit_patch_row_col(q_pos, self.grid_width, self.prefix_tokens)
            k_rows, k_cols, k_patch = vit_patch_row_col(k_pos, self.grid_width, self.prefix_tokens)
            return (
                self._rotate_with(q, *self._cached_cos_sin(q_rows, q_cols), q_patch),
                self._rotate_with(k, *self._cached_cos_sin(k_rows, k_cols), k_patch),
            )
        q_coords, q_patch = self.coords(q_pos)
        k_coords, k_patch = self.coords(k_pos)
        # One transform for the whole call, so queries and keys move together.
        flat = torch.cat([q_coords.reshape(-1, 2), k_coords.reshape(-1, 2)])
        flat = dinov3_augment_coords(flat, self.shift, self.jitter, self.rescale)
        q_coords, k_coords = flat[: q_pos.numel()].view_as(q_coords), flat[q_pos.numel() :].view_as(k_coords)
        return (
            self._rotate_with(q, *dinov3_cos_sin(q_coords, self.inv_freq), q_patch),
            self._rotate_with(k, *dinov3_cos_sin(k_coords, self.inv_freq), k_patch),
        )

    def preview(self) -> str:
        freqs = ", ".join(f"{v:.4g}" for v in self.inv_freq.tolist()[:4])
        augment = f"shift={self.shift}, jitter={self.jitter}, rescale={self.rescale} (training only)"
        return (
            f"grid {self.grid_height}x{self.grid_width}, prefix_tokens={self.prefix_tokens}; pairs 0..{self.head_dim // 4 - 1} "
            f"turn with y, the rest with x (patch centres in [-1, 1]); inv_freq = [{freqs}, ...]; {augment}"
        )
