"""M-RoPE: Qwen2-VL's multimodal rotary embedding (Wang et al. 2024; HF ``qwen2_vl``; docs/conventions.md §9.2).

Each token has three position ids ``(t, h, w)`` (temporal, row, column). The standard RoPE
frequencies ``θ_k = base^(-2k/d)`` (``d/2`` of them) are split into contiguous bands of sizes
``mrope_section`` (summing to ``d/2``; HF's default ``[16, 24, 24]`` for ``d = 128``); band ``s``
takes its angles from position set ``s mod 3``. The angles are used with ``rotate_half`` pairing
(``(k, k + d/2)``), exactly as HF's ``Qwen2VLRotaryEmbedding`` + ``apply_multimodal_rotary_pos_emb``.
Text tokens have ``t = h = w`` and reduce exactly to 1-D RoPE.

How the three axes reach the layer:

* Plain integer positions ``[B, T]`` (what :class:`~posenc.MultiheadAttention` passes) mean text
  tokens: ``t = h = w = position``. Everything that works for RoPE (KV cache, padding) works.
* For image/video tokens, set the 3-axis ids ``[3, B, T]`` (or ``[3, T]``) of the tokens of the
  next call with the :meth:`MRoPE.position_ids` context manager, e.g.
  ``with enc.position_ids(ids): out = attn(x)`` (self-attention: queries and new keys are the same
  tokens). For a KV-cached step, give the ids of the new tokens only. :func:`mrope_grid_ids` builds
  the ids of one vision block as HF's ``get_rope_index`` does.

Default ``mrope_section`` when not given: ``[d/8, rest//2, rest - rest//2]`` with
``rest = d/2 - d/8`` (``[16, 24, 24]`` for ``d = 128``, ``[2, 3, 3]`` for ``d = 16``).

Backends: sdpa and eager (q and k are rotated before the kernel, which then sees plain attention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from ..base import RotaryEncoding
from ..kernels.rope import RotaryTables
from ..registry import register
from .rope import _apply_cos_sin, rope_inv_freq

__functional__ = ["mrope_cos_sin", "mrope_grid_ids", "default_mrope_section"]


def default_mrope_section(head_dim: int) -> list[int]:
    """``[d/8, rest//2, rest - rest//2]`` with ``rest = d/2 - d/8``: HF's ``[16, 24, 24]`` at ``d = 128``."""
    temporal = head_dim // 8
    rest = head_dim // 2 - temporal
    return [temporal, rest // 2, rest - rest // 2]


def _check_section(section: list[int], head_dim: int) -> None:
    if len(section) != 3 or any(s < 0 for s in section) or sum(section) != head_dim // 2:
        raise ValueError(
            f"mrope: mrope_section must be three non-negative band sizes summing to head_dim/2 = {head_dim // 2}, "
            f"got mrope_section={section}"
        )


def mrope_cos_sin(position_ids: Tensor, inv_freq: Tensor, mrope_section: list[int]) -> tuple[Tensor, Tensor]:
    """Float32 ``cos``/``sin`` ``[B, T, d/2]``: band ``s`` of the frequencies uses axis ``s mod 3`` of ``position_ids [3, B, T]``."""
    if position_ids.dim() != 3 or position_ids.shape[0] != 3:
        raise ValueError(f"mrope: position_ids must have shape [3, B, T], got {tuple(position_ids.shape)}")
    inv_freq = inv_freq.to(device=position_ids.device, dtype=torch.float32)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [3, B, T, d/2]
    mixed = _mix_bands(angles, mrope_section)
    return mixed.cos(), mixed.sin()


def _mix_bands(per_axis: Tensor, mrope_section: list[int]) -> Tensor:
    """``[3, B, T, d/2] -> [B, T, d/2]``: band ``s`` of the last axis taken from axis ``s mod 3``."""
    bands = per_axis.split(list(mrope_section), dim=-1)
    return torch.cat([band[index % 3] for index, band in enumerate(bands)], dim=-1)


def mrope_grid_ids(start: int, grid_t: int, grid_h: int, grid_w: int, temporal_interval: int = 1) -> Tensor:
    """3-axis ids ``[3, grid_t·grid_h·grid_w]`` of one vision block starting at position ``start``.

    ``t = start + t_index·temporal_interval``, ``h = start + row``, ``w = start + col``, tokens in
    (t, row, col) order; the grid is the LLM grid (after spatial merging), as in HF ``get_rope_index``.
    """
    t = torch.arange(grid_t)[:, None, None].expand(grid_t, grid_h, grid_w) * temporal_interval
    h = torch.arange(grid_h)[None, :, None].expand(grid_t, grid_h, grid_w)
    w = torch.arange(grid_w)[None, None, :].expand(grid_t, grid_h, grid_w)
    return torch.stack([t.flatten(), h.flatten(), w.flatten()]) + start


@register("mrope")
class MRoPE(RotaryEncoding):
    """Qwen2-VL M-RoPE: RoPE frequency bands driven by (t, h, w) position ids; text tokens get 1-D RoPE."""

    layer_sizes = ("head_dim",)
    derived_buffers = ("tables.inv_freq", "tables.cos", "tables.sin")
    shift_invariant = True

    def __init__(self, head_dim: int, base: float = 10000.0, mrope_section: list[int] | None = None) -> None:
        """Args: ``head_dim`` (filled in by the layer; even); ``base``; ``mrope_section`` (three
        band sizes summing to ``head_dim/2``; default :func:`default_mrope_section`)."""
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"mrope: head_dim must be a positive even integer, got head_dim={head_dim!r}")
        section = list(mrope_section) if mrope_section is not None else default_mrope_section(head_dim)
        _check_section(section, head_dim)
        self.head_dim, self.base, self.mrope_section = head_dim, float(base), section
        self._ids: Tensor | None = None
        self.tables = RotaryTables()
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """The frequencies ``[D/2]`` and their ``cos``/``sin`` tables, in float32."""
        self.tables.reset(rope_inv_freq(self.head_dim, self.base)[0].to(self.buffer_device))

    @property
    def inv_freq(self) -> Tensor:
        """The frequencies ``[D/2]`` (float32)."""
        return self.tables.inv_freq

    def _cos_sin(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``cos``/``sin`` ``[B, T, D/2]`` of 3-axis ids ``[3, B, T]`` from the cached tables."""
        cos, sin = self.tables.tables(position_ids)  # [3, B, T, D/2]
        return _mix_bands(cos, self.mrope_section), _mix_bands(sin, self.mrope_section)

    @contextlib.contextmanager
    def position_ids(self, ids: Tensor) -> Iterator[None]:
        """Use 3-axis ``ids [3, B, T]`` (or ``[3, T]``) for the tokens of the calls inside the block."""
        if ids.dim() == 2:
            ids = ids[:, None]
        if ids.dim() != 3 or ids.shape[0] != 3 or ids.dtype.is_floating_point:
            raise ValueError(
                f"mrope: position ids must be an integer tensor [3, B, T] or [3, T], got {tuple(ids.shape)}"
            )
        previous, self._ids = self._ids, ids.long()
        try:
            yield
        finally:
            self._ids = previous

    def _axes(self, positions: Tensor, length: int, name: str) -> Tensor:
        if self._ids is None:
            return positions[None].expand(3, *positions.shape)  # text tokens: t = h = w
        if self._ids.shape[-1] != length:
            raise ValueError(
                f"mrope: 3-axis position ids cover {self._ids.shape[-1]} tokens but the {name} have {length} "
                "(set ids for the new tokens of this call; cross-attention needs plain positions)"
            )
        return self._ids.to(positions.device)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"mrope: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        q_cos, q_sin = self._cos_sin(self._axes(q_pos, q.shape[2], "queries"))
        k_cos, k_sin = self._cos_sin(self._axes(k_pos, k.shape[2], "keys"))
        return _apply_cos_sin(q, q_cos, q_sin, "half"), _apply_cos_sin(k, k_cos, k_sin, "half")

    def preview(self) -> str:
        t, h, w = self.mrope_section
        return (
            f"mrope_section={self.mrope_section}: pairs 0..{t - 1} turn with t, {t}..{t + h - 1} with h, "
            f"{t + h}..{t + h + w - 1} with w (rotate_half pairing); text tokens (t = h = w) = 1-D RoPE"
        )
