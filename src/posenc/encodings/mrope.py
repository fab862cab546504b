"""M-RoPE: Qwen2-VL's multimodal rotary embedding (Wang et al. 2024; HF ``qwen2_vl``; docs/conventions.md §9.2).

Each token has three position ids ``(t, h, w)`` (temporal, row, column). Each of the ``d/2``
RoPE frequencies takes its angle from one of the three ids; ``mrope_section = [n_t, n_h, n_w]``
(summing to ``d/2``) says how many pairs each axis gets and ``layout`` where they are:

* ``layout="section"`` (Qwen2-VL, Qwen2.5-VL; HF ``Qwen2VLRotaryEmbedding``): contiguous bands,
  pairs ``0 … n_t−1`` turn with ``t``, the next ``n_h`` with ``h``, the last ``n_w`` with ``w``
  (HF's default ``[16, 24, 24]`` for ``d = 128``).
* ``layout="interleaved"`` (Qwen3-VL, Qwen3.5; HF ``Qwen3VLTextRotaryEmbedding``): the axes
  alternate by frequency index, pair ``k`` turns with ``h`` when ``k ≡ 1 (mod 3)`` and
  ``k < 3·n_h``, with ``w`` when ``k ≡ 2 (mod 3)`` and ``k < 3·n_w``, and with ``t`` otherwise
  (HF's default ``[24, 20, 20]`` for ``d = 128``), so every axis spans high and low frequencies.

The angles are used with ``rotate_half`` pairing (``(k, k + d/2)``), exactly as HF. With
``rotary_dim = d_r < d`` (Qwen3.5's ``partial_rotary_factor``) the frequencies are those of a
``d_r``-wide RoPE, ``mrope_section`` sums to ``d_r/2``, and only the first ``d_r`` channels turn
(pairs ``(k, k + d_r/2)``); the rest pass through, as HF Qwen3.5. Text tokens
have ``t = h = w`` and reduce exactly to 1-D RoPE in both layouts. The frequencies may be scaled
with any RoPE scaling type whose frequencies do not depend on the sequence length (``scaling=yarn``
etc., :mod:`posenc.encodings.rope_scaling`; ``attention_scale`` multiplies ``cos`` and ``sin``),
as HF's Qwen-VL rotary embeddings apply ``ROPE_INIT_FUNCTIONS[rope_type]``.

How the three axes reach the layer:

* Plain integer positions ``[B, T]`` (what :class:`~posenc.MultiheadAttention` passes) mean text
  tokens: ``t = h = w = position``. Everything that works for RoPE (KV cache, padding) works.
* For image/video tokens, set the 3-axis ids ``[3, B, T]`` (or ``[3, T]``) of the tokens of the
  next call with the :meth:`MRoPE.position_ids` context manager, e.g.
  ``with enc.position_ids(ids): out = attn(x)`` (self-attention: queries and new keys are the same
  tokens). For a KV-cached step, give the ids of the new tokens only. :func:`mrope_grid_ids` builds
  the ids of one vision block as HF's ``get_rope_index`` does.

Default ``mrope_section`` when not given: ``layout="section"``: ``[d/8, rest//2, rest - rest//2]``
with ``rest = d/2 - d/8`` (``[16, 24, 24]`` for ``d = 128``, ``[2, 3, 3]`` for ``d = 16``);
``layout="interleaved"``: ``[d/2 - 2·side, side, side]`` with ``side = 5d // 32`` (``[24, 20, 20]``
for ``d = 128``, ``[4, 2, 2]`` for ``d = 16``).

:func:`mrope_position_ids` builds the 3-axis ids of a whole text + image + video sequence as HF
Qwen2-VL / Qwen2.5-VL ``get_rope_index`` (Qwen2.5-VL's time-aligned temporal ids included).

Backends: sdpa and eager (q and k are rotated before the kernel, which then sees plain attention).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from ..base import RotaryEncoding, checks_values
from ..kernels.rope import RotaryTables
from ..registry import at_least, greater_than, register
from ..spec import format_spec
from .rope import apply_cos_sin
from .rope_scaling import (
    FIXED_LENGTH_OPTIONS,
    LENGTH_DEPENDENT,
    SCALING_OPTION_RANGES,
    resolve_scaling,
    rope_scaled_inv_freq,
    rope_scaling_types,
)

__functional__ = [
    "mrope_cos_sin",
    "mrope_grid_ids",
    "default_mrope_section",
    "mrope_axis_map",
    "mrope_position_ids",
]

Layout = Literal["section", "interleaved"]
#: ``mm_token_type_ids`` values of HF Qwen-VL processors.
TEXT, IMAGE, VIDEO = 0, 1, 2


def default_mrope_section(head_dim: int, layout: Layout = "section") -> list[int]:
    """HF's default band sizes, for any head size.

    ``"section"``: ``[d/8, rest//2, rest - rest//2]`` with ``rest = d/2 - d/8`` (``[16, 24, 24]``
    at ``d = 128``). ``"interleaved"``: ``[d/2 - 2·side, side, side]`` with ``side = 5d // 32``
    (Qwen3-VL's ``[24, 20, 20]`` at ``d = 128``).
    """
    if layout == "interleaved":
        side = 5 * head_dim // 32
        return [head_dim // 2 - 2 * side, side, side]
    temporal = head_dim // 8
    rest = head_dim // 2 - temporal
    return [temporal, rest // 2, rest - rest // 2]


def _check_layout(layout: str) -> None:
    if layout not in ("section", "interleaved"):
        raise ValueError(f"mrope: layout must be 'section' or 'interleaved', got layout={layout!r}")


def _rotary_width(head_dim: int, rotary_dim: int | None, partial: float | None) -> int:
    """``rotary_dim``, or ``int(head_dim · partial_rotary_factor)`` (HF), or ``head_dim``; even and at most ``head_dim``."""
    if rotary_dim is not None and partial is not None:
        raise ValueError("mrope: give rotary_dim or rope_parameters['partial_rotary_factor'], not both")
    width = rotary_dim if rotary_dim is not None else head_dim if partial is None else int(head_dim * partial)
    if isinstance(width, bool) or not isinstance(width, int) or width <= 0 or width % 2 or width > head_dim:
        raise ValueError(
            f"mrope: rotary_dim must be a positive even number at most head_dim={head_dim}, got {width!r} "
            f"(rotary_dim={rotary_dim}, partial_rotary_factor={partial})"
        )
    return width


def _check_section(section: list[int], width: int, layout: Layout = "section") -> None:
    pairs = width // 2
    if len(section) != 3 or any(s < 0 for s in section) or sum(section) != pairs:
        raise ValueError(
            f"mrope: mrope_section must be three non-negative band sizes summing to the rotary pairs "
            f"(rotary_dim/2, head_dim/2 unless partial) = {pairs}, "
            f"got mrope_section={section} (sum {sum(section)})"
        )
    _, height, width = section
    if layout == "interleaved" and (3 * height - 2 >= pairs or 3 * width - 1 >= pairs):
        raise ValueError(
            f"mrope: with layout='interleaved' height and width take every third pair (1, 4, 7, ... and "
            f"2, 5, 8, ...), so 3·h − 2 and 3·w − 1 must be below the rotary pairs {pairs}; got "
            f"mrope_section={section}"
        )


def mrope_axis_map(mrope_section: Sequence[int], layout: Layout = "section") -> Tensor:
    """Which id (0 = t, 1 = h, 2 = w) drives each of the ``sum(mrope_section)`` pairs, int64.

    ``"section"``: band ``s`` uses axis ``s mod 3``, e.g. ``[2, 3, 3] -> [0,0,1,1,1,2,2,2]``.
    ``"interleaved"``: pair ``k`` uses ``h`` if ``k % 3 == 1`` and ``k < 3·n_h``, ``w`` if
    ``k % 3 == 2`` and ``k < 3·n_w``, else ``t``, e.g. ``[4, 2, 2] -> [0,1,2,0,1,2,0,0]``.
    """
    _check_layout(layout)
    sizes = [int(s) for s in mrope_section]
    if layout == "section":
        axes = torch.tensor([index % 3 for index in range(len(sizes))], dtype=torch.int64)
        return axes.repeat_interleave(torch.tensor(sizes, dtype=torch.int64))
    axis = torch.zeros(sum(sizes), dtype=torch.int64)
    for which in (1, 2):
        axis[which : 3 * sizes[which] : 3] = which
    return axis


def mrope_cos_sin(
    position_ids: Tensor,
    inv_freq: Tensor,
    mrope_section: list[int],
    layout: Layout = "section",
    attention_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Float32 ``cos``/``sin`` ``[B, T, d/2]`` of ``position_ids [3, B, T]``: pair ``k`` uses the id :func:`mrope_axis_map` names.

    ``attention_scale`` multiplies both (a scaling type's, e.g. YaRN's ``0.1 ln s + 1``).
    """
    if position_ids.dim() != 3 or position_ids.shape[0] != 3:
        raise ValueError(f"mrope: position_ids must have shape [3, B, T], got {tuple(position_ids.shape)}")
    inv_freq = inv_freq.to(device=position_ids.device, dtype=torch.float32)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [3, B, T, d/2]
    mixed = _mix(angles, mrope_axis_map(mrope_section, layout).to(angles.device))
    return mixed.cos() * attention_scale, mixed.sin() * attention_scale


def _mix(per_axis: Tensor, axis_map: Tensor) -> Tensor:
    """``[3, ..., P] -> [..., P]``: entry ``p`` taken from axis ``axis_map[p]``."""
    index = axis_map.view(*([1] * (per_axis.dim() - 1)), -1).expand(1, *per_axis.shape[1:])
    return per_axis.gather(0, index)[0]


def mrope_grid_ids(start: int, grid_t: int, grid_h: int, grid_w: int, temporal_interval: float = 1) -> Tensor:
    """3-axis ids ``[3, grid_t·grid_h·grid_w]`` of one vision block starting at position ``start``.

    ``t = start + int(t_index·temporal_interval)``, ``h = start + row``, ``w = start + col``, tokens
    in (t, row, col) order; the grid is the LLM grid (after spatial merging), as in HF
    ``get_rope_index``. A fractional ``temporal_interval`` (Qwen2.5-VL's ``tokens_per_second ·
    second_per_grid_t``) is multiplied in float32 and truncated, as HF does.
    """
    steps = torch.arange(grid_t)
    if isinstance(temporal_interval, int):
        temporal = steps * temporal_interval
    else:
        temporal = (steps * float(temporal_interval)).long()
    t = temporal[:, None, None].expand(grid_t, grid_h, grid_w)
    h = torch.arange(grid_h)[None, :, None].expand(grid_t, grid_h, grid_w)
    w = torch.arange(grid_w)[None, None, :].expand(grid_t, grid_h, grid_w)
    return torch.stack([t.flatten(), h.flatten(), w.flatten()]) + start


def _grid(value: Any, name: str, index: int) -> tuple[int, int, int]:
    grid = [int(v) for v in (value.tolist() if isinstance(value, Tensor) else value)]
    if len(grid) != 3 or min(grid) <= 0:
        raise ValueError(
            f"mrope_position_ids: {name}[{index}] must be three positive sizes (t, h, w), got {grid}"
        )
    return grid[0], grid[1], grid[2]


def mrope_position_ids(
    token_types: Tensor,
    image_grid_thw: Tensor | Sequence[Sequence[int]] | None = None,
    video_grid_thw: Tensor | Sequence[Sequence[int]] | None = None,
    *,
    spatial_merge_size: int = 2,
    tokens_per_second: float | None = None,
    second_per_grid_ts: Sequence[float] | Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """3-axis position ids of text + image + video sequences, as HF Qwen2-VL / Qwen2.5-VL ``get_rope_index``.

    Args:
        token_types: ``[B, T]`` (or ``[T]``) integers, 0 text, 1 image, 2 video (HF's
            ``mm_token_type_ids``). Each run of image (video) tokens is one image (video) and takes
            the next grid, in order over the whole batch.
        image_grid_thw, video_grid_thw: ``[N, 3]`` patch grids ``(t, h, w)`` before spatial merging.
        spatial_merge_size: ``m``; a vision block has ``t · (h/m) · (w/m)`` tokens.
        tokens_per_second: None for Qwen2-VL (temporal ids step by 1); Qwen2.5-VL's
            ``vision_config.tokens_per_second``: video frames step by
            ``tokens_per_second · second_per_grid_t`` (images still by 1).
        second_per_grid_ts: seconds per temporal grid step of each video (default 1 each).
        attention_mask: ``[B, T]``, 1 for real tokens; padding gets id 0 and is skipped.

    Returns:
        ``(ids [3, B, T] int64, deltas [B])``: text runs continue ``1, 2, 3, …`` from the current
        position ``p``; a vision block starting at ``p`` gets :func:`mrope_grid_ids` and moves ``p``
        on by ``max(h, w) / m``. ``deltas = max(ids) + 1 − (number of real tokens)`` per row (HF's
        ``rope_deltas``, the offset of the positions generated after the prompt).

    Raises:
        ValueError: a run of vision tokens whose length is not its grid's token count, too few
            grids, a token type other than 0/1/2, or a grid not divisible by the merge size.
    """
    if token_types.dim() == 1:
        token_types = token_types[None]
    if token_types.dim() != 2 or token_types.dtype.is_floating_point:
        raise ValueError(
            f"mrope_position_ids: token_types must be integer [B, T], got {tuple(token_types.shape)}"
        )
    if spatial_merge_size <= 0:
        raise ValueError(f"mrope_position_ids: spatial_merge_size must be positive, got {spatial_merge_size}")
    grids = {
        IMAGE: iter(list(image_grid_thw) if image_grid_thw is not None else []),
        VIDEO: iter(list(video_grid_thw) if video_grid_thw is not None else []),
    }
    seconds = iter([float(s) for s in second_per_grid_ts] if second_per_grid_ts is not None else [])
    ids = torch.zeros(3, *token_types.shape, dtype=torch.int64)
    deltas = []
    counters = {IMAGE: 0, VIDEO: 0}
    for row, types in enumerate(token_types):
        keep = (
            attention_mask[row].bool()
            if attention_mask is not None
            else torch.ones_like(types, dtype=torch.bool)
        )
        blocks, position = [], 0
        for kind, run in itertools.groupby(types[keep].tolist()):
            length = len(list(run))
            if kind == TEXT:
                blocks.append(torch.arange(position, position + length).expand(3, -1))
                position += length
                continue
            if kind not in grids:
                raise ValueError(
                    f"mrope_position_ids: token type {kind} is not 0 (text), 1 (image) or 2 (video)"
                )
            name = "image_grid_thw" if kind == IMAGE else "video_grid_thw"
            value = next(grids[kind], None)
            if value is None:
                raise ValueError(f"mrope_position_ids: more {name[:5]} runs than {name} entries")
            grid_t, grid_h, grid_w = _grid(value, name, counters[kind])
            if grid_h % spatial_merge_size or grid_w % spatial_merge_size:
                raise ValueError(
                    f"mrope_position_ids: {name}[{counters[kind]}] = {(grid_t, grid_h, grid_w)} is not divisible "
                    f"by spatial_merge_size={spatial_merge_size}"
                )
            llm_h, llm_w = grid_h // spatial_merge_size, grid_w // spatial_merge_size
            if length != grid_t * llm_h * llm_w:
                raise ValueError(
                    f"mrope_position_ids: a run of {length} {name[:5]} tokens, but {name}[{counters[kind]}] = "
                    f"{(grid_t, grid_h, grid_w)} with spatial_merge_size={spatial_merge_size} has "
                    f"{grid_t * llm_h * llm_w}"
                )
            counters[kind] += 1
            interval: float = 1
            if kind == VIDEO and tokens_per_second is not None:
                interval = float(tokens_per_second) * next(seconds, 1.0)
            blocks.append(mrope_grid_ids(position, grid_t, llm_h, llm_w, interval))
            position += max(llm_h, llm_w)
        row_ids = torch.cat(blocks, dim=1) if blocks else torch.zeros(3, 0, dtype=torch.int64)
        ids[:, row, keep] = row_ids
        deltas.append((int(row_ids.max()) + 1 if row_ids.numel() else 0) - row_ids.shape[1])
    return ids.to(token_types.device), torch.tensor(deltas, device=token_types.device)


def _has_negative(ids: Tensor) -> bool:
    """Whether ``ids`` hold a negative value (read in eager mode only: ``base.checks_values``)."""
    return ids.numel() > 0 and checks_values() and bool((ids < 0).any())


@register("mrope")
class MRoPE(RotaryEncoding):
    """Qwen-VL M-RoPE: RoPE frequencies driven by (t, h, w) position ids, by section (Qwen2-VL) or interleaved (Qwen3-VL)."""

    layer_sizes = ("head_dim",)
    option_ranges = {
        "head_dim": at_least(2),
        "base": greater_than(1),
        "mrope_section": at_least(0),
        "rotary_dim": at_least(2),
        **{k: v for k, v in SCALING_OPTION_RANGES.items() if k in FIXED_LENGTH_OPTIONS},
    }
    derived_buffers = ("tables.inv_freq", "tables.cos", "tables.sin")
    shift_invariant = True

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        mrope_section: list[int] | None = None,
        layout: Layout = "section",
        rotary_dim: int | None = None,
        scaling: str | None = None,
        factor: float | None = None,
        alpha: float | None = None,
        original_max_position_embeddings: int | None = None,
        max_position_embeddings: int | None = None,
        beta_fast: float | None = None,
        beta_slow: float | None = None,
        mscale: float | None = None,
        mscale_all_dim: float | None = None,
        attention_factor: float | None = None,
        truncate: bool | None = None,
        low_freq_factor: float | None = None,
        high_freq_factor: float | None = None,
        rope_parameters: dict | None = None,
    ) -> None:
        """Args: ``head_dim`` (filled in by the layer; even); ``base``; ``mrope_section`` (three
        band sizes summing to ``rotary_dim/2``; default :func:`default_mrope_section`); ``layout``
        (``"section"`` or ``"interleaved"``); ``rotary_dim``: rotate only the first ``rotary_dim``
        channels (partial rotary, Qwen3.5; HF's ``partial_rotary_factor`` in ``rope_parameters``
        says the same; default all); ``scaling`` and its options (HF ``rope_parameters``
        names, as RoPE's; length-dependent types are refused); or ``rope_parameters``, an HF dict
        (``rope_type``, ``rope_theta``, ``mrope_section``, the scaling's options) used as it is."""
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"mrope: head_dim must be a positive even integer, got head_dim={head_dim!r}")
        _check_layout(layout)
        options = dict(
            factor=factor,
            alpha=alpha,
            original_max_position_embeddings=original_max_position_embeddings,
            max_position_embeddings=max_position_embeddings,
            beta_fast=beta_fast,
            beta_slow=beta_slow,
            mscale=mscale,
            mscale_all_dim=mscale_all_dim,
            attention_factor=attention_factor,
            truncate=truncate,
            low_freq_factor=low_freq_factor,
            high_freq_factor=high_freq_factor,
        )
        self.scaling, self.base, partial = resolve_scaling(base, scaling, rope_parameters, options)
        width = _rotary_width(head_dim, rotary_dim, partial)
        if self.scaling.type in LENGTH_DEPENDENT:
            fixed = sorted(set(rope_scaling_types()) - LENGTH_DEPENDENT)
            raise ValueError(
                f"mrope: scaling={self.scaling.type!r} changes its frequencies with the sequence length, which "
                f"M-RoPE does not follow; use one of {', '.join(fixed)}"
            )
        from_dict = (rope_parameters or {}).get("mrope_section")
        if mrope_section is not None and from_dict is not None and list(from_dict) != list(mrope_section):
            raise ValueError(
                f"mrope: mrope_section={list(mrope_section)} disagrees with rope_parameters['mrope_section']="
                f"{list(from_dict)}"
            )
        section = mrope_section if mrope_section is not None else from_dict
        section = list(section) if section is not None else default_mrope_section(width, layout)
        _check_section(section, width, layout)
        self.head_dim, self.rotary_dim, self.mrope_section, self.layout = head_dim, width, section, layout
        self.scaling_config = {
            "rope_theta": self.base,
            **self.scaling.config(),
            "head_dim": head_dim,
            "rotary_dim": width,
        }
        rope_scaled_inv_freq(self.scaling_config)  # validates the scaling options now
        self.attention_scale = 1.0
        self._ids: Tensor | None = None
        self.tables = RotaryTables()
        self.reset_buffers()

    def config(self) -> dict[str, Any]:
        """The options this instance was built with, leaving out those left at None."""
        return {k: v for k, v in self._config.items() if v is not None}

    def spec(self) -> str:
        """A spec string that rebuilds this encoding; an HF ``rope_parameters`` dict becomes typed options."""
        config = self.config()
        if config.pop("rope_parameters", None) is not None:
            config.update(base=self.base, mrope_section=self.mrope_section)
            if self.rotary_dim != self.head_dim:
                config["rotary_dim"] = self.rotary_dim
            if self.scaling.type != "default":
                config["scaling"] = self.scaling.type
            config.update(self.scaling.options())
        return format_spec(self.name, config)

    def reset_buffers(self) -> None:
        """The (scaled) frequencies ``[d_r/2]`` and their ``cos``/``sin`` tables, in float32."""
        inv_freq, self.attention_scale = rope_scaled_inv_freq(self.scaling_config)
        self.tables.reset(inv_freq.to(self.buffer_device), self.attention_scale)

    @property
    def inv_freq(self) -> Tensor:
        """The frequencies ``[d_r/2]`` (float32)."""
        return self.tables.inv_freq

    @property
    def axis_map(self) -> Tensor:
        """Which id (0 = t, 1 = h, 2 = w) drives each pair (:func:`mrope_axis_map`)."""
        return mrope_axis_map(self.mrope_section, self.layout)

    def _cos_sin(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``cos``/``sin`` ``[B, T, D/2]`` of 3-axis ids ``[3, B, T]`` from the cached tables."""
        cos, sin = self.tables.tables(position_ids)  # [3, B, T, D/2], attention scale included
        axis_map = self.axis_map.to(cos.device)
        return _mix(cos, axis_map), _mix(sin, axis_map)

    @contextlib.contextmanager
    def position_ids(self, ids: Tensor) -> Iterator[None]:
        """Use 3-axis ``ids [3, B, T]`` (or ``[3, T]``) for the tokens of the calls inside the block."""
        if ids.dim() == 2:
            ids = ids[:, None]
        if ids.dim() != 3 or ids.shape[0] != 3 or ids.dtype.is_floating_point:
            raise ValueError(
                f"mrope: position ids must be an integer tensor [3, B, T] or [3, T], got {tuple(ids.shape)}"
            )
        if _has_negative(ids):
            # The same rule as plain positions (base.check_positions): ids are non-negative.
            raise ValueError(f"mrope: position ids must be non-negative, got minimum {int(ids.min())}")
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
        return apply_cos_sin(q, q_cos, q_sin, "half"), apply_cos_sin(k, k_cos, k_sin, "half")

    def preview(self) -> str:
        t, h, w = self.mrope_section
        scaled = f", scaling={self.scaling.type} (attention_scale={self.attention_scale:.6g})"
        scaled = scaled if self.scaling.type != "default" else ""
        if self.layout == "interleaved":
            where = (
                f"pairs 1, 4, ... below {3 * h} turn with h, 2, 5, ... below {3 * w} with w, the rest with t"
            )
        else:
            where = f"pairs 0..{t - 1} turn with t, {t}..{t + h - 1} with h, {t + h}..{t + h + w - 1} with w"
        return (
            f"mrope_section={self.mrope_section}, layout={self.layout}{scaled}: {where} (rotate_half pairing); "
            "text tokens (t = h = w) = 1-D RoPE"
        )
