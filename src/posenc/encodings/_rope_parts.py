"""What the piecewise-RoPE families share (ReRoPE and Leaky ReRoPE, Self-Extend, Dual Chunk Attention).

Each of these methods scores a (query, key) pair with plain RoPE logits ``⟨R(a) q_i, R(b) k_j⟩ · scale``,
at a pair of positions ``(a, b)`` that depends on which *part* the pair belongs to: near or far
(ReRoPE, Self-Extend), same chunk, the chunk before or an older one (DCA). A family names its parts
as position maps, one ``(a [B|1, Tq], b [B|1, Tk])`` per part, and the part of every pair
(``[B|1, Tq, Tk]`` integers); :class:`PiecewiseRoPE` computes each part's logits and keeps, for every
pair, those of its own part, so one softmax runs over all of them. No model class is patched: the
encodings are CONTENT kind, served by the eager and the query-blocked ``relative`` backends with their
masks and windows; the KV cache keeps the keys unrotated with their positions, and each call rotates
them again at every part's map (cached decoding equals the full pass, past any window or chunk).

RoPE's own options come along as for ``rope``: ``base``, ``pairing``, ``rotary_dim`` /
``partial_rotary_factor``, ``scaling`` with its flat options (fixed-length types only: ``dynamic``
and ``longrope`` recompute their frequencies from the current length, which a method that re-rotates
cached keys at chosen positions does not follow) and HF's ``rope_parameters``. An inner
:class:`~posenc.encodings.rope.RoPE` (``.rope``) holds the float32 tables; its ``attention_scale``
(YaRN's) multiplies both sides of every part, so every logit scales by its square, as in RoPE.

These methods are defined for causal decoders (their references mask future keys), so the families
are ``causal_only``: pairs with a future key get finite logits of the first part, which the causal
mask removes. Positions are whole numbers (``floor`` and ``mod`` of them).

**Tiles.** For square causal self-attention at consecutive positions a family also says where its
parts lie, as rectangles of the causal triangle (:class:`PartTile`, :meth:`PiecewiseRoPE.part_tiles`):
the near band and the far triangle (ReRoPE, Self-Extend), the chunks and the chunks before them
(DCA). The ``piecewise`` backend (:mod:`posenc.backends.piecewise`) runs each tile as one call of the
fused CPU flash kernel on the part's rotated queries and keys and merges the tiles by their
log-sum-exp: one softmax, no ``[Tq, Tk]`` logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ._scaling_option import scaling_group
from .base import ContentEncoding, checks_values
from .registry import Range, at_least, greater_than, options
from .rope import RoPE, apply_cos_sin
from .rope_scaling import (
    FIXED_LENGTH_OPTIONS,
    LENGTH_DEPENDENT,
    SCALING_OPTION_RANGES,
    RopeScaling,
    rope_scaling_types,
)
from .spec import format_spec, parse_spec

__all__ = [
    "LOG_SCALE_RANGE",
    "ROPE_OPTION_GROUPS",
    "ROPE_OPTION_RANGES",
    "PartTile",
    "PiecewiseRoPE",
    "as_positions",
    "chunk_tiles",
    "log_query_scale",
    "window_tiles",
]

#: The documented ranges of RoPE's options as the piecewise families take them.
ROPE_OPTION_RANGES: dict[str, Range] = {
    "head_dim": at_least(1),
    "base": greater_than(1),
    "rotary_dim": at_least(0),
    "partial_rotary_factor": Range(low=0, high=1),
    **{k: v for k, v in SCALING_OPTION_RANGES.items() if k in FIXED_LENGTH_OPTIONS},
}
#: The range of ``log_scale_length`` (the families that take the query scaling): ``log(1)`` is 0.
LOG_SCALE_RANGE = at_least(2)
#: RoPE's ``scaling`` option group, fixed-length types only (as M-RoPE's).
ROPE_OPTION_GROUPS = {"scaling": scaling_group(FIXED_LENGTH_OPTIONS)}

#: One part's position maps: query positions ``[B|1, Tq]`` and key positions ``[B|1, Tk]``.
PositionMap = tuple[Tensor, Tensor]


def log_query_scale(q_pos: Tensor, length: int | None) -> Tensor | None:
    """The query scaling ``max(1, log(i + 1) / log(length))`` ``[B|1, Tq]`` (float64) of ReRoPE's and
    Self-Extend's patches (``training_length``, ``scale_base``), or None when ``length`` is None."""
    if length is None:
        return None
    return ((q_pos.double() + 1).log() / math.log(length)).clamp(min=1.0)


@dataclass(frozen=True)
class PartTile:
    """A rectangle of query rows ``rows = (q0, q1)`` and keys ``keys = (k0, k1)`` (indices into the
    sequence, end excluded) whose pairs belong to part ``part``, where the pair's distance
    ``i - j`` (indices) lies in ``distances = (lo, hi)`` (``hi`` None: no upper bound). ``distances``
    None: every pair of the rectangle. The tiles of a sequence cover each causal pair once."""

    part: int
    rows: tuple[int, int]
    keys: tuple[int, int]
    distances: tuple[int, int | None] | None = None


def window_tiles(length: int, window: int) -> list[PartTile]:
    """The tiles of a near/far family (ReRoPE, Self-Extend) over ``length`` queries: part 0 the band
    ``0 <= i - j < window``, part 1 the triangle ``i - j >= window`` (rows ``window:`` against keys
    ``:length - window``, top-left causal)."""
    tiles = [PartTile(0, (0, length), (0, length), (0, window - 1))]
    if length > window:
        tiles.append(PartTile(1, (window, length), (0, length - window), (window, None)))
    return tiles


def chunk_tiles(first_position: int, length: int, chunk: int) -> list[PartTile]:
    """DCA's tiles over ``length`` queries at positions ``first_position, first_position + 1, ...``,
    chunks of ``chunk`` positions counted from position 0: for each chunk, part 0 its own keys
    (causal), part 1 the chunk before (all of it), part 2 every older chunk (all of them)."""
    starts = list(range(0, length, chunk))
    offset = first_position % chunk
    if offset:  # the first chunk is cut: it ends where the next position divisible by chunk sits
        starts = [0, *range(chunk - offset, length, chunk)]
    bounds = list(zip(starts, [*starts[1:], length]))
    tiles = []
    for index, (s0, s1) in enumerate(bounds):
        tiles.append(PartTile(0, (s0, s1), (s0, s1), (0, None)))
        if index >= 1:
            tiles.append(PartTile(1, (s0, s1), bounds[index - 1]))
        if index >= 2:
            tiles.append(PartTile(2, (s0, s1), (0, bounds[index - 1][0])))
    return tiles


class PiecewiseRoPE(ContentEncoding):
    """The base of the piecewise-RoPE families: an inner RoPE and the logits of their parts.

    A family implements :meth:`parts` and its own ``__init__`` (its options, then RoPE's, passed on
    to :meth:`__init__` here). Not registered itself.
    """

    layer_sizes = ("head_dim",)
    option_ranges = ROPE_OPTION_RANGES
    option_groups = ROPE_OPTION_GROUPS
    causal_only = True
    integer_positions_reason = "its position maps floor, clamp or take whole positions modulo a size"

    def __init__(
        self,
        head_dim: int | None,
        log_scale_length: int | None,
        base: float,
        pairing: str,
        rotary_dim: int | None,
        partial_rotary_factor: float | None,
        scaling: str | RopeScaling | dict | None,
        rope_parameters: dict | None,
    ) -> None:
        super().__init__()
        try:
            self.rope = RoPE(
                head_dim=head_dim,
                base=base,
                pairing=pairing,  # type: ignore[arg-type]
                rotary_dim=rotary_dim,
                partial_rotary_factor=partial_rotary_factor,
                scaling=scaling,
                rope_parameters=rope_parameters,
            )
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from None
        if self.rope.scaling.length_dependent:
            raise ValueError(
                f"{self.name}: scaling={self.rope.rope_type!r} changes its frequencies with the sequence "
                f"length, which {self.name} (keys re-rotated at its own positions) does not follow; use a "
                f"fixed-length type ({', '.join(sorted(set(rope_scaling_types()) - LENGTH_DEPENDENT))})"
            )
        self.log_scale_length = log_scale_length

    # ------------------------------------------------------------------ config
    def config(self) -> dict[str, Any]:
        """The options this instance was built with, leaving out those left at None."""
        return {k: v for k, v in self._config.items() if v is not None}

    def spec(self) -> str:
        """A spec string that rebuilds this encoding; an HF ``rope_parameters`` dict becomes RoPE's typed options."""
        config = self.config()
        if "rope_parameters" in config:
            del config["rope_parameters"]
            _, typed = parse_spec(self.rope.spec())
            accepted = options(self.name)
            config.update({k: v for k, v in typed.items() if k in accepted and k != "head_dim"})
        return format_spec(self.name, config)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config().items())

    # ------------------------------------------------------------------ the layer
    def init_layer(self, layer: nn.Module) -> None:
        self.rope.bind(layer.head_dim)

    @property
    def head_dim(self) -> int | None:
        """The per-head size (None until a layer or the first call sets it)."""
        return self.rope.head_dim

    # ------------------------------------------------------------------ the parts
    def parts(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, list[PositionMap]]:
        """``(part [B|1, Tq, Tk] int64, maps)``: the part of every pair and each part's position maps."""
        raise NotImplementedError(f"{type(self).__name__} must implement parts()")

    def position_maps(self, q_pos: Tensor, k_pos: Tensor) -> list[PositionMap]:
        """Each part's ``(query positions [B|1, Tq], key positions [B|1, Tk])``, without the
        ``[Tq, Tk]`` part index of :meth:`parts` (every family's maps are position by position, so the
        query maps are read against one key and the key maps against one query)."""
        _, q_maps = self.parts(q_pos, k_pos[..., :1])
        _, k_maps = self.parts(q_pos[..., :1], k_pos)
        return [(q_at, k_at) for (q_at, _), (_, k_at) in zip(q_maps, k_maps)]

    def part_tiles(self, first_position: int, length: int) -> list[PartTile]:
        """Where each part lies in square causal self-attention over ``length`` queries at
        consecutive positions from ``first_position``: the tiles the ``piecewise`` backend runs."""
        raise NotImplementedError(f"{type(self).__name__} must implement part_tiles()")

    def query_scale(self, q_pos: Tensor) -> Tensor | None:
        """The query scaling ``[B|1, Tq]`` (float64) of ``log_scale_length``, or None when it is off."""
        return log_query_scale(q_pos, self.log_scale_length)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Float32 ``cos``/``sin`` ``[B|1, T, d_r/2]`` of one position map (RoPE's tables; a family whose
        maps hold more than one position per token, as DPE's, reads them here)."""
        return self.rope.cos_sin(positions)

    def rotated(self, x: Tensor, positions: Tensor) -> Tensor:
        """``x [B, H, T, D]`` rotated by RoPE at the position map ``positions`` (whole or real-valued)."""
        cos, sin = self.cos_sin(positions)
        return apply_cos_sin(x, cos, sin, self.rope.pairing)

    def logits(
        self,
        q: Tensor,
        k: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        *,
        scale: float,
        layer: nn.Module | None = None,
    ) -> Tensor:
        """The scaled logits ``[B, H, Tq, Tk]``: each pair's from the position maps of its part."""
        self.rope.bind(q.shape[-1])  # a no-op once bound; an error if q's size differs
        q_pos, k_pos = q_pos.to(q.device), k_pos.to(q.device)
        factor = self.query_scale(q_pos)
        if factor is not None:
            q = q * factor[:, None, :, None].to(q.dtype)
        part, maps = self.parts(q_pos, k_pos)
        keys: dict[int, Tensor] = {}  # parts that share a key map rotate the keys once
        out: Tensor | None = None
        for index, (q_at, k_at) in enumerate(maps):
            chosen = part == index
            if out is not None and checks_values() and not bool(chosen.any()):
                continue  # no pair of this part (a short sequence): its logits are never read
            if id(k_at) not in keys:
                keys[id(k_at)] = self.rotated(k, k_at)
            logits = (self.rotated(q, q_at) @ keys[id(k_at)].transpose(-1, -2)) * scale
            out = logits if out is None else torch.where(chosen[:, None], logits, out)
        assert out is not None  # every family names at least one part
        return out


def as_positions(value: float, like: Tensor) -> Tensor:
    """A position map holding ``value`` at every position of ``like [B|1, T]`` (int64 when whole)."""
    if float(value).is_integer():
        return torch.full_like(like, int(value), dtype=torch.long)
    return torch.full_like(like, float(value), dtype=torch.float64)
