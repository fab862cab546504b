"""M-RoPE: multimodal rotary embedding (Qwen2-VL, Wang et al. 2024; HF ``qwen2_vl``; docs/conventions.md §9.2, §9.7).

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

The general form (docs/conventions.md §9.7): any number of axes ``A`` and any map of pairs to
axes, with either pairing (``pairing="half"``, the default, or ``"interleaved"``: ``(2k, 2k+1)``):

* ``layout="section"`` with ``A`` bands: band ``s`` uses axis ``s`` (GLM-4V: ``[t, h, w]`` over a
  half-width RoPE, ``pairing="interleaved"``, ``partial_rotary_factor=0.5``; HF ``Glm4vTextRotaryEmbedding``).
* ``layout="alternating"`` (ERNIE-4.5-VL; HF ``Ernie4_5_VLMoeTextRotaryEmbedding``):
  ``mrope_section = [n_h, n_w, n_t]`` in ERNIE's order, ``n_h = n_w``; the first ``n_h + n_w``
  pairs alternate ``h, w, h, w, …`` and the last ``n_t`` use ``t``; interleaved pairing.
* ``layout="doubled"`` (HunyuanVL's XD-RoPE, 4 axes; HF ``HunYuanVLRotaryEmbedding``): bands of
  ``2·n_s`` *channels* of the doubled table ``[θ | θ]``, band ``s`` on axis ``s``. With half
  pairing the two channels of a pair ``(k, k + d/2)`` can then follow different axes: such a pair is
  ``[[cos a, −sin a], [sin b, cos b]]``, a rotation only where the two ids agree (text tokens).
* ``layout="videorope"`` (VideoRoPE, Wei et al. 2025, "VideoRoPE: What Makes for Good Video Rotary
  Position Embedding?"; its code's ``apply_m_modify_multimodal_rotary_pos_emb``): low-frequency
  temporal allocation. ``mrope_section = [n_t, n_h, n_w]`` in Qwen's order (VideoRoPE keeps
  Qwen2-VL's ``[16, 24, 24]``); the first ``n_h + n_w`` pairs (the high frequencies) alternate
  ``h, w, h, w, …`` and the last ``n_t`` (the lowest frequencies) use ``t``; rotate_half pairing.
  Its diagonal ids and temporal spacing: :func:`~posenc.encodings.mrope_ids.videorope_position_ids`.
* ``axis_map``: an explicit axis per pair (or per channel with ``"doubled"``), any map;
  ``num_axes`` the number of id axes the layer is given (default: one per band, or 3).

Position ids may be real-valued (fractional video time steps): integer ids read the cached
tables, real ones are computed directly in float32.

The Qwen layouts use ``rotate_half`` pairing (``(k, k + d/2)``), exactly as HF. With
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
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from ..kernels.rope import RotaryTables
from ._axes import check_ids_batch
from ._scaling_option import resolve_scaling, scaling_group
from .base import RotaryEncoding, checks_values
from .mrope_ids import IMAGE, TEXT, VIDEO, mrope_grid_ids, mrope_position_ids  # noqa: F401  (their old home)
from .registry import at_least, greater_than, register
from .rope import Pairing, apply_cos_sin, check_pairing
from .rope_scaling import (
    FIXED_LENGTH_OPTIONS,
    LENGTH_DEPENDENT,
    SCALING_OPTION_RANGES,
    RopeScaling,
    rope_scaled_inv_freq,
    rope_scaling_types,
)
from .spec import format_spec

__functional__ = ["mrope_cos_sin", "default_mrope_section", "mrope_axis_map", "mrope_channel_axes"]

Layout = Literal["section", "interleaved", "alternating", "doubled", "videorope"]
LAYOUTS = ("section", "interleaved", "alternating", "doubled", "videorope")


def default_mrope_section(head_dim: int, layout: Layout = "section") -> list[int]:
    """HF's default band sizes, for any head size (``head_dim`` here is the rotary width).

    ``"section"`` and ``"videorope"``: ``[d/8, rest//2, rest - rest//2]`` with ``rest = d/2 - d/8``
    (``[16, 24, 24]`` at ``d = 128``, Qwen2-VL's, which VideoRoPE keeps). ``"interleaved"``: ``[d/2 - 2·side, side, side]`` with ``side = 5d // 32``
    (Qwen3-VL's ``[24, 20, 20]`` at ``d = 128``). ``"alternating"``: ``[side, side, d/2 - 2·side]``
    with ``side = 11d // 64`` (ERNIE-4.5-VL's ``[22, 22, 20]`` at ``d = 128``, in its ``(h, w, t)``
    order). ``"doubled"`` has no default (HunyuanVL's config always gives its sections).
    """
    if layout == "interleaved":
        side = 5 * head_dim // 32
        return [head_dim // 2 - 2 * side, side, side]
    if layout == "alternating":
        side = 11 * head_dim // 64
        return [side, side, head_dim // 2 - 2 * side]
    if layout == "doubled":
        raise ValueError(
            "mrope: layout='doubled' (HunyuanVL) has no default mrope_section; give one band size per axis "
            "(summing to rotary_dim/2)"
        )
    temporal = head_dim // 8
    rest = head_dim // 2 - temporal
    return [temporal, rest // 2, rest - rest // 2]


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(
            f"mrope: layout must be one of {', '.join(map(repr, LAYOUTS))}, got layout={layout!r}"
        )


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
    three = layout in ("interleaved", "alternating", "videorope")
    if (
        (len(section) != 3 if three else len(section) < 1)
        or any(s < 0 for s in section)
        or sum(section) != pairs
    ):
        count = "three" if three else "one or more (one per axis)"
        raise ValueError(
            f"mrope: mrope_section must be {count} non-negative band sizes summing to the rotary pairs "
            f"(rotary_dim/2, head_dim/2 unless partial) = {pairs}, so that every pair has an axis; "
            f"got mrope_section={section} (sum {sum(section)}, layout={layout!r})"
        )
    if layout == "interleaved":
        _, height, width_ = section
        if 3 * height - 2 >= pairs or 3 * width_ - 1 >= pairs:
            raise ValueError(
                f"mrope: with layout='interleaved' height and width take every third pair (1, 4, 7, ... and "
                f"2, 5, 8, ...), so 3·h − 2 and 3·w − 1 must be below the rotary pairs {pairs}; got "
                f"mrope_section={section}"
            )
    if layout == "alternating" and section[0] != section[1]:
        raise ValueError(
            f"mrope: with layout='alternating' (ERNIE-4.5-VL) h and w alternate over the first pairs, so "
            f"mrope_section = [h, w, t] needs h == w; got mrope_section={section}"
        )


def mrope_axis_map(mrope_section: Sequence[int], layout: Layout = "section") -> Tensor:
    """Which id (0 = t, 1 = h, 2 = w, 3, ... further axes) drives each of the ``sum(mrope_section)`` pairs, int64.

    ``"section"``: band ``s`` uses axis ``s``, e.g. ``[2, 3, 3] -> [0,0,1,1,1,2,2,2]``.
    ``"interleaved"``: pair ``k`` uses ``h`` if ``k % 3 == 1`` and ``k < 3·n_h``, ``w`` if
    ``k % 3 == 2`` and ``k < 3·n_w``, else ``t``, e.g. ``[4, 2, 2] -> [0,1,2,0,1,2,0,0]``.
    ``"alternating"`` (ERNIE-4.5-VL, ``[n_h, n_w, n_t]``): the first ``n_h + n_w`` pairs alternate
    ``h, w, h, w, …``, the last ``n_t`` use ``t``, e.g. ``[2, 2, 4] -> [1,2,1,2,0,0,0,0]``.
    ``"videorope"`` (``[n_t, n_h, n_w]``): the first ``n_h + n_w`` pairs alternate ``h, w, h, w, …``,
    the last ``n_t`` (lowest frequencies) use ``t``, e.g. ``[2, 3, 3] -> [1,2,1,2,1,2,0,0]``.
    ``"doubled"`` maps channels, not pairs (:func:`mrope_channel_axes`); this returns the axis of
    each pair's first channel.
    """
    _check_layout(layout)
    sizes = [int(s) for s in mrope_section]
    if layout in ("section", "doubled"):
        if layout == "doubled":
            return mrope_channel_axes(sizes, layout)[0]  # the first channel of each pair
        axes = torch.arange(len(sizes), dtype=torch.int64)
        return axes.repeat_interleave(torch.tensor(sizes, dtype=torch.int64))
    if layout in ("alternating", "videorope"):
        # ERNIE lists (h, w, t), VideoRoPE (t, h, w): both put t on the last, lowest-frequency pairs.
        hw, t = (
            (sizes[0] + sizes[1], sizes[2]) if layout == "alternating" else (sizes[1] + sizes[2], sizes[0])
        )
        return torch.cat([torch.arange(hw) % 2 + 1, torch.zeros(t, dtype=torch.int64)])
    axis = torch.zeros(sum(sizes), dtype=torch.int64)
    for which in (1, 2):
        axis[which : 3 * sizes[which] : 3] = which
    return axis


def mrope_channel_axes(
    mrope_section: Sequence[int] | None = None,
    layout: Layout = "section",
    pairing: Pairing = "half",
    axis_map: Sequence[int] | None = None,
) -> Tensor:
    """The axis of each pair's two channels, ``[2, P]`` int64 (row 0: the first channel, row 1: the second).

    Every layout but ``"doubled"`` gives both channels of a pair the pair's axis
    (:func:`mrope_axis_map`). ``"doubled"`` (HunyuanVL's XD-RoPE) splits the channels of the
    doubled table ``[θ_0 … θ_{P−1}, θ_0 … θ_{P−1}]`` into bands of ``2·n_s`` channels, band ``s``
    on axis ``s``: with ``pairing="half"`` channel ``c`` belongs to pair ``c mod P``, so a pair's
    two channels ``(k, k + P)`` may follow different axes; with ``"interleaved"`` a band never
    splits a pair. An explicit ``axis_map`` names the axis of every pair (``P`` entries), or of
    every channel in channel order (``2P`` entries, ``layout="doubled"``).
    """
    _check_layout(layout)
    if axis_map is not None:
        axes = torch.tensor([int(a) for a in axis_map], dtype=torch.int64)
        if layout != "doubled":
            return torch.stack([axes, axes])
    elif layout == "doubled":
        sizes = [int(s) for s in mrope_section or ()]
        axes = torch.arange(len(sizes), dtype=torch.int64).repeat_interleave(
            torch.tensor([2 * s for s in sizes], dtype=torch.int64)
        )
    else:
        pair_axes = mrope_axis_map(mrope_section or (), layout)
        return torch.stack([pair_axes, pair_axes])
    pairs = axes.numel() // 2
    if pairing == "half":
        return torch.stack([axes[:pairs], axes[pairs:]])
    return torch.stack([axes[0::2], axes[1::2]])


def _pair_consistent(channel_axes: Tensor) -> bool:
    """Whether both channels of every pair follow one axis (then the pair is a rotation)."""
    return bool(torch.equal(channel_axes[0], channel_axes[1]))


def mrope_cos_sin(
    position_ids: Tensor,
    inv_freq: Tensor,
    mrope_section: list[int],
    layout: Layout = "section",
    attention_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Float32 ``cos``/``sin`` ``[B, T, d/2]`` of ``position_ids [A, B, T]``: pair ``k`` uses the id :func:`mrope_axis_map` names.

    ``attention_scale`` multiplies both (a scaling type's, e.g. YaRN's ``0.1 ln s + 1``). ``A`` is
    the number of axes of the layout (3, or ``len(mrope_section)`` for ``"section"``). Real-valued
    ids are allowed. ``"doubled"`` layouts whose pairs straddle two axes need two tables per pair:
    use :class:`MRoPE`.
    """
    axes = mrope_channel_axes(mrope_section, layout)
    if not _pair_consistent(axes):
        raise ValueError(
            f"mrope_cos_sin: mrope_section={list(mrope_section)} with layout={layout!r} gives some pairs two axes; "
            "one table per pair cannot hold it (MRoPE.rotate applies it)"
        )
    count = _axis_count(axes, mrope_section, layout)
    if position_ids.dim() != 3 or position_ids.shape[0] != count:
        raise ValueError(
            f"mrope: position_ids must have shape [{count}, B, T], got {tuple(position_ids.shape)}"
        )
    inv_freq = inv_freq.to(device=position_ids.device, dtype=torch.float32)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [A, B, T, d/2]
    mixed = _mix(angles, axes[0].to(angles.device))
    return mixed.cos() * attention_scale, mixed.sin() * attention_scale


def _axis_count(channel_axes: Tensor, mrope_section: Sequence[int] | None, layout: str) -> int:
    """The number of id axes a map reads: one per band (``"section"``, ``"doubled"``; an empty band
    still counts), three (``"interleaved"``, ``"alternating"``), or an explicit map's largest axis + 1."""
    if mrope_section is not None:
        return len(mrope_section) if layout in ("section", "doubled") else 3
    return int(channel_axes.max()) + 1 if channel_axes.numel() else 1


def _mix(per_axis: Tensor, axis_map: Tensor) -> Tensor:
    """``[A, ..., P] -> [..., P]``: entry ``p`` taken from axis ``axis_map[p]``."""
    index = axis_map.view(*([1] * (per_axis.dim() - 1)), -1).expand(1, *per_axis.shape[1:])
    return per_axis.gather(0, index)[0]


def apply_two_axis_pairs(
    x: Tensor, cos: tuple[Tensor, Tensor], sin: tuple[Tensor, Tensor], pairing: Pairing
) -> Tensor:
    """Rotate-like map of ``x [B, H, T, D]`` whose pair channels read separate tables.

    ``cos = (c1, c2)``, ``sin = (s1, s2)``, each ``[B|1, T, P]`` (float32): channel one of pair
    ``k`` becomes ``x1·c1 − x2·s1``, channel two ``x2·c2 + x1·s2`` (HF ``q·cos + rotate_half(q)·sin``
    with a per-channel table). With ``c1 = c2`` and ``s1 = s2`` it is the rotation.
    Channels past ``2P`` pass through.
    """
    c1, c2 = (t[:, None].to(x.dtype) for t in cos)
    s1, s2 = (t[:, None].to(x.dtype) for t in sin)
    pairs = c1.shape[-1]
    rot, rest = x[..., : 2 * pairs], x[..., 2 * pairs :]
    if pairing == "half":
        x1, x2 = rot[..., :pairs], rot[..., pairs:]
        out = torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1).flatten(-2)
    return out if not rest.shape[-1] else torch.cat((out, rest), dim=-1)


def _has_negative(ids: Tensor) -> bool:
    """Whether ``ids`` hold a negative value (read in eager mode only: ``base.checks_values``)."""
    return ids.numel() > 0 and checks_values() and bool((ids < 0).any())


@register("mrope")
class MRoPE(RotaryEncoding):
    """Multimodal RoPE: each rotary pair driven by one of several position ids (Qwen2/3-VL, GLM-4V, ERNIE-4.5-VL, HunyuanVL)."""

    float_positions = True  # angles p·θ are defined for any real position

    layer_sizes = ("head_dim",)
    option_ranges = {
        "head_dim": at_least(2),
        "base": greater_than(1),
        "mrope_section": at_least(0),
        "rotary_dim": at_least(2),
        "axis_map": at_least(0),
        "num_axes": at_least(1),
        **{k: v for k, v in SCALING_OPTION_RANGES.items() if k in FIXED_LENGTH_OPTIONS},
    }
    option_groups = {"scaling": scaling_group(FIXED_LENGTH_OPTIONS)}
    derived_buffers = ("tables.inv_freq", "tables.cos", "tables.sin")
    shift_invariant = True

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        mrope_section: list[int] | None = None,
        layout: Layout = "section",
        rotary_dim: int | None = None,
        pairing: Pairing | None = None,
        axis_map: list[int] | None = None,
        num_axes: int | None = None,
        scaling: str | RopeScaling | dict | None = None,
        rope_parameters: dict | None = None,
    ) -> None:
        """Args: ``head_dim`` (filled in by the layer; even); ``base``; ``mrope_section`` (band
        sizes summing to ``rotary_dim/2``, read as the layout's model reads them; default
        :func:`default_mrope_section`); ``layout`` (``"section"``, ``"interleaved"``,
        ``"alternating"``, ``"doubled"`` or ``"videorope"``); ``rotary_dim``: rotate only the first ``rotary_dim``
        channels (partial rotary, Qwen3.5, GLM-4V; HF's ``partial_rotary_factor`` in
        ``rope_parameters`` says the same; default all); ``pairing`` (``"half"``, the default: ``(k, k +
        d_r/2)``, Qwen, HunyuanVL; ``"interleaved"``: ``(2k, 2k+1)``, GLM-4V, ERNIE-4.5-VL);
        ``axis_map``: the axis of every pair (``d_r/2`` entries; ``d_r``, one per channel, with
        ``layout="doubled"``), any map, instead of ``mrope_section``; ``num_axes``: how many id
        axes the layer is given (default: the largest axis the map uses + 1); ``scaling``, one
        value as RoPE's (a type name, a ``RopeScaling`` or a dict of its fields; in spec strings
        flat options, ``mrope:scaling=yarn,factor=4``; length-dependent types are refused); or
        ``rope_parameters``, an HF dict (``rope_type``, ``rope_theta``, ``mrope_section``, the
        scaling's options) used as it is."""
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"mrope: head_dim must be a positive even integer, got head_dim={head_dim!r}")
        _check_layout(layout)
        pairing = "half" if pairing is None else pairing  # None: Qwen's rotate_half (kept out of the spec)
        check_pairing(pairing)
        self.scaling, self.base, partial = resolve_scaling(base, scaling, rope_parameters)
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
        if axis_map is not None:
            if section is not None:
                raise ValueError("mrope: give axis_map (any map of pairs to axes) or mrope_section, not both")
            _check_axis_map(list(axis_map), width, layout)
            section = None
        else:
            section = list(section) if section is not None else default_mrope_section(width, layout)
            _check_section(section, width, layout)
        self.head_dim, self.rotary_dim, self.mrope_section, self.layout = head_dim, width, section, layout
        self.pairing = pairing
        with torch.device("cpu"):  # a plain index map, also when the layer is built on the meta device
            self.channel_axes = mrope_channel_axes(section, layout, pairing, axis_map)
        used = _axis_count(self.channel_axes, section, layout)
        if num_axes is not None and num_axes < used:
            raise ValueError(
                f"mrope: num_axes={num_axes} but the map of pairs to axes uses axis {used - 1} "
                f"(mrope_section={section}, axis_map={axis_map}); give num_axes >= {used}"
            )
        self.num_axes = num_axes if num_axes is not None else used
        self.pair_consistent = _pair_consistent(self.channel_axes)
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
            config["base"] = self.base
            if self.mrope_section is not None:
                config["mrope_section"] = self.mrope_section
            if self.rotary_dim != self.head_dim:
                config["rotary_dim"] = self.rotary_dim
            if self.scaling.type != "default":
                config["scaling"] = self.scaling.type
            config.update(self.scaling.options())
        return format_spec(self.name, config)

    def extra_repr(self) -> str:
        """What the rotation computes with, also when given as ``rope_parameters``: the resolved base,
        bands, width and scaling (not the ``None`` of unused keywords)."""
        parts = [
            f"head_dim={self.head_dim}",
            f"base={self.base!r}",
            f"mrope_section={self.mrope_section!r}" if self.mrope_section is not None else "axis_map=given",
            f"layout={self.layout!r}",
            f"rotary_dim={self.rotary_dim}",
            f"num_axes={self.num_axes}",
        ]
        if self.scaling.type != "default":
            parts.append(f"scaling={self.scaling.type!r}")
            parts += [f"{k}={v!r}" for k, v in self.scaling.options().items()]
            parts.append(f"attention_scale={self.attention_scale:.6g}")
        return ", ".join(parts)

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
        """Which id (0 = t, 1 = h, 2 = w, ...) drives each pair (its first channel under ``"doubled"``)."""
        return self.channel_axes[0]

    def _cos_sin(self, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``cos``/``sin`` ``[B, T, d_r/2]`` of the first and of the second channel of each pair, from ids ``[A, B, T]``."""
        cos, sin = self.tables.tables(position_ids)  # [A, B, T, d_r/2], attention scale included
        axes = self.channel_axes.to(cos.device)
        first = _mix(cos, axes[0]), _mix(sin, axes[0])
        if self.pair_consistent:
            return first[0], first[1], first[0], first[1]
        return first[0], first[1], _mix(cos, axes[1]), _mix(sin, axes[1])

    def _transform(self, x: Tensor, tables: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
        c1, s1, c2, s2 = tables
        if self.pair_consistent:
            return apply_cos_sin(x, c1, s1, self.pairing)
        return apply_two_axis_pairs(x, (c1, c2), (s1, s2), self.pairing)

    @contextlib.contextmanager
    def position_ids(self, ids: Tensor) -> Iterator[None]:
        """Use ``A``-axis ``ids [A, B, T]`` (or ``[A, T]``; ``A = num_axes``) for the tokens of the calls inside the block.

        Integer or real-valued (fractional video time steps); non-negative.
        """
        if ids.dim() == 2:
            ids = ids[:, None]
        if ids.dim() != 3 or ids.shape[0] != self.num_axes or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(
                f"mrope: position ids must be a tensor [{self.num_axes}, B, T] or [{self.num_axes}, T] "
                f"(num_axes={self.num_axes}), got {tuple(ids.shape)} {ids.dtype}"
            )
        if _has_negative(ids):
            # The same rule as plain positions (base.check_positions): ids are non-negative.
            raise ValueError(
                f"mrope: position ids must be non-negative, got minimum {float(ids.min())} (adding one constant "
                "to every axis changes no attention score: videorope_position_ids(..., non_negative=True) does)"
            )
        previous, self._ids = self._ids, ids if ids.dtype.is_floating_point else ids.long()
        try:
            yield
        finally:
            self._ids = previous

    def _axes(self, positions: Tensor, tokens: Tensor, name: str) -> Tensor:
        """The ids ``[A, B|1, T]`` of the ``name`` (queries or keys) ``tokens [B, H, T, D]`` at ``positions [B|1, T]``."""
        if self._ids is None:
            return positions[None].expand(self.num_axes, *positions.shape)  # text tokens: every axis equal
        length = tokens.shape[2]
        if self._ids.shape[-1] != length:
            raise ValueError(
                f"mrope: {self.num_axes}-axis position ids cover {self._ids.shape[-1]} tokens but the {name} have "
                f"{length} (set ids for the new tokens of this call; cross-attention needs plain positions)"
            )
        check_ids_batch("mrope", self._ids, tokens.shape[0], name)
        return self._ids.to(positions.device)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"mrope: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        q_tables = self._cos_sin(self._axes(q_pos, q, "queries"))
        k_tables = self._cos_sin(self._axes(k_pos, k, "keys"))
        return self._transform(q, q_tables), self._transform(k, k_tables)

    def preview(self) -> str:
        scaled = f", scaling={self.scaling.type} (attention_scale={self.attention_scale:.6g})"
        scaled = scaled if self.scaling.type != "default" else ""
        section = self.mrope_section
        if self.layout == "interleaved" and section is not None:
            _, h, w = section
            where = (
                f"pairs 1, 4, ... below {3 * h} turn with h, 2, 5, ... below {3 * w} with w, the rest with t"
            )
        elif self.layout == "section" and section is not None and len(section) == 3:
            t, h, w = section
            where = f"pairs 0..{t - 1} turn with t, {t}..{t + h - 1} with h, {t + h}..{t + h + w - 1} with w"
        else:
            shown = self.channel_axes[0].tolist()
            where = f"axis per pair {shown[:24]}{' ...' if len(shown) > 24 else ''}"
            if not self.pair_consistent:
                where += f"; second channels {self.channel_axes[1].tolist()[:24]}"
        return (
            f"mrope_section={section}, layout={self.layout}, {self.num_axes} axes{scaled}: {where} "
            f"({'rotate_half' if self.pairing == 'half' else 'interleaved'} pairing); "
            "text tokens (all axes equal) = 1-D RoPE"
        )


def _check_axis_map(axis_map: list[int], width: int, layout: str) -> None:
    """An explicit map names one non-negative axis per pair (``width/2``), or per channel (``width``, ``"doubled"``)."""
    want = width if layout == "doubled" else width // 2
    what = "channel (rotary_dim)" if layout == "doubled" else "pair (rotary_dim/2)"
    if len(axis_map) != want or any(int(a) < 0 for a in axis_map):
        raise ValueError(
            f"mrope: axis_map must give one non-negative axis per rotary {what} = {want} entries, covering the "
            f"rotary width {width}; got axis_map={axis_map} ({len(axis_map)} entries)"
        )
