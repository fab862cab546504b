"""The four kinds of positional encoding and the base class every encoding derives from.

Every encoding acts on attention in exactly one place (docs/architecture.md §1):

========  ==============================================================  =====================
kind      hook                                                            examples
========  ==============================================================  =====================
ABSOLUTE  ``embed(x [B,T,D], positions [B,T]) -> [B,T,D]`` at the input    sinusoidal, learned
ROTARY    ``rotate(q, k, q_pos, k_pos) -> (q, k)`` before the kernel       RoPE, xPos
BIAS      ``bias_at(h, q_pos, k_pos)``: a scalar added to each logit       T5, ALiBi, Kerple
CONTENT   ``logits(q, k, ...)`` and ``attend(probs, v, ...)``             Shaw, DeBERTa, CoPE
========  ==============================================================  =====================

Shapes used throughout: ``B`` batch, ``H`` query heads, ``Tq``/``Tk`` query/key lengths,
``D`` per-head dimension. Positions are integer tensors of shape ``[B, T]`` (the attention layer
normalises ``[T]`` to ``[1, T]``); derived quantities (angles, distances, buckets) are computed in
float32 or integer arithmetic whatever the model dtype.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..kernels.position_ranges import known_start
from .offers import (
    ClippedRelative,
    FiniteMark,
    InputBias,
    InputTransform,
    NearFar,
    SeparableBias,
    TokenStates,
)
from .spec import format_spec

__all__ = [
    "AbsoluteEncoding",
    "BiasEncoding",
    "ContentEncoding",
    "FiniteMark",
    "InputBias",
    "InputTransform",
    "Kind",
    "LayerContext",
    "NearFar",
    "PositionalEncoding",
    "RotaryEncoding",
    "SeparableBias",
    "TokenStates",
    "check_positions",
    "checks_values",
    "token_states_function",
]


class Kind(str, enum.Enum):
    """Where an encoding acts on attention."""

    ABSOLUTE = "absolute"
    ROTARY = "rotary"
    BIAS = "bias"
    CONTENT = "content"


#: The largest table an option may ask for: past it, building would exhaust memory or swap for minutes.
MAX_TABLE_BYTES = 4 << 30


def check_table_size(encoding: str, option: str, value: int, numel: int, itemsize: int = 4) -> None:
    """Refuse up front a table of ``numel`` elements that ``option=value`` asks for, naming the memory."""
    needed = numel * itemsize
    if needed > MAX_TABLE_BYTES:
        raise ValueError(
            f"{encoding}: {option}={value} needs a table of {needed / 2**30:.1f} GiB "
            f"(limit {MAX_TABLE_BYTES / 2**30:.0f} GiB); use a smaller {option}"
        )


def checks_values() -> bool:
    """Whether checks that read tensor values (signs, ranges, nan) run: always in eager mode, never
    while ``torch.compile`` traces (a data-dependent branch breaks a ``fullgraph=True`` graph).

    Shapes, dtypes and devices are checked in both; compiled code trusts its inputs' values, as
    PyTorch's own kernels do.
    """
    return not torch.compiler.is_compiling()


def check_positions(
    positions: Tensor,
    *,
    name: str = "positions",
    allow_negative: bool = False,
    allow_float: bool = False,
    integer_reason: str = "",
) -> Tensor:
    """Validate a position tensor and return it with a batch axis ``[B, T]``: int64, or, where
    ``allow_float``, real-valued positions as they are (float32 or float64; half precision is
    widened to float32).

    Raises:
        ValueError: if ``positions`` is not a tensor of integers (or of reals where ``allow_float``),
            has more than two dimensions, holds non-finite values, or holds negative values while
            ``allow_negative`` is False. A real-valued tensor where only integers are defined is
            refused with ``integer_reason``.
    """
    if not isinstance(positions, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of integers, got {type(positions).__name__}")
    if positions.dtype.is_complex or positions.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {positions.dtype}")
    real = positions.dtype.is_floating_point
    if real and not allow_float:
        why = f" ({integer_reason})" if integer_reason else ""
        raise ValueError(
            f"{name} must be an integer tensor, got dtype {positions.dtype}: this encoding is defined on whole "
            f"positions only{why}; round them (.round().long()) or use a rotary encoding, which takes real positions"
        )
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.dim() != 2:
        raise ValueError(f"{name} must have shape [T] or [B, T], got {tuple(positions.shape)}")
    if real and positions.numel() > 0 and checks_values() and not bool(torch.isfinite(positions).all()):
        raise ValueError(f"{name} must be finite, got a nan or inf position")
    if (
        not allow_negative
        and positions.numel() > 0
        and checks_values()
        and known_start(positions) is None  # posenc's own arange: non-negative by construction
        and bool((positions < 0).any())
    ):
        low = positions.min()
        raise ValueError(f"{name} must be non-negative, got minimum {float(low) if real else int(low)}")
    if real:
        return positions if positions.dtype in (torch.float32, torch.float64) else positions.float()
    return positions.long()


@dataclass(frozen=True)
class LayerContext:
    """What an attention layer (or a model) tells the encoding it builds.

    The encoding reads the fields it needs through its own declarations (:attr:`PositionalEncoding.layer_sizes`
    and :meth:`PositionalEncoding.layer_defaults`); nothing is filled in by parameter name.

    Attributes:
        num_heads: query heads ``H`` of the layer.
        head_dim: per-head size ``D``.
        dim: model width ``E = H·D``.
        causal: whether the layer masks future keys.
        max_len: the model's maximum length (size of position tables), or None when unknown
            (a single attention layer does not know it).
        device, dtype: where the layer's parameters live; the encoding's parameters follow them
            (derived tables stay float32 or integer).
    """

    num_heads: int
    head_dim: int
    dim: int
    causal: bool = False
    max_len: int | None = None
    device: torch.device | str | None = None
    dtype: torch.dtype | None = None

    #: The fields that are the layer's sizes (what :attr:`PositionalEncoding.layer_sizes` may name).
    SIZES: ClassVar[tuple[str, ...]] = ("num_heads", "head_dim", "dim")


class PositionalEncoding(nn.Module):
    """The common root of every encoding; an encoding derives from one of the four kind bases.

    :class:`AbsoluteEncoding`, :class:`RotaryEncoding`, :class:`BiasEncoding` and
    :class:`ContentEncoding` each set :attr:`kind` and declare the one hook of that kind;
    ``@register`` refuses a class that does not derive from one of them or leaves its hook out.
    The registry sets :attr:`name`, :attr:`description` and records the options the instance was
    built with (:meth:`config`).

    Class attributes a subclass may set:

    * ``shift_invariant``: True when adding a constant to every position leaves attention unchanged
      (relative encodings). The contract tests check it.
    * ``shared_across_layers``: True when one instance serves every layer of a stack (T5 shares its
      bias table across the layers of a stack; DeBERTa shares its relative embedding table).
    * ``causal_only``: True when the encoding is only defined for causal attention (Kerple, FIRE);
      an instance may set it from its options (ALiBi's causal mode). Cross-attention is never
      causal, so the layer refuses such encodings there.
    * ``noncausal_options``: options that lift ``causal_only`` (ALiBi: ``mode="symmetric"``).
    * ``self_attention_only``: True when queries and keys must come from one sequence (FoX's forget
      gates accumulate along it); the layer refuses cross-attention.
    * ``input_dependent``: True when the bias depends on the layer input; set by
      :class:`BiasEncoding` for a class that declares :meth:`BiasEncoding.input_bias` (FoX), and by
      :class:`ContentEncoding` for one that declares :meth:`ContentEncoding.input_transform` (PaTH),
      read by the layer, the cache and the request before any backend runs.
    * ``shifts_by_rotation``: True when the rotation of a position composes, ``R(p + Δ) = R(Δ) R(p)``,
      so cached rotated keys move to new positions by rotating them by ``Δ`` alone
      (``KVCache.shift_keys``; RoPE with fixed frequencies).
    * ``example_options``: options for the contract tests' small layer (head size 16).
    * ``option_ranges``: the documented range of each numeric option, checked at build time.
    * ``layer_sizes`` / :meth:`layer_defaults`: the options a layer supplies (:class:`LayerContext`).
    * ``derived_buffers`` / :meth:`reset_buffers`: tables computed from the options (float32 or
      integer whatever the model dtype), rebuilt after ``.to()``, ``to_empty()`` and meta-device
      construction. Names may reach into a submodule (``"tables.cos"`` of a :class:`~posenc.kernels.rope.RotaryTables`).
    * ``max_positions``: an instance attribute, the largest supported position + 1, or None.
    """

    kind: ClassVar[Kind]
    #: The method a subclass of this kind must implement (set by the four kind bases).
    hook: ClassVar[str] = ""
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    shift_invariant: ClassVar[bool] = False
    shared_across_layers: ClassVar[bool] = False
    causal_only: ClassVar[bool] = False
    allows_negative_positions: ClassVar[bool] = False
    #: True when real-valued positions are defined (rotary families: an angle ``p·θ`` for any real
    #: ``p``; random float positions in training, fractional video time steps). Encodings that
    #: leave it False refuse them, with :attr:`integer_positions_reason`.
    float_positions: ClassVar[bool] = False
    #: Why this encoding takes whole positions only (shown when real-valued ones are refused).
    integer_positions_reason: ClassVar[str] = ""
    self_attention_only: ClassVar[bool] = False
    shifts_by_rotation: ClassVar[bool] = False
    #: True when the bias depends on the layer input, not on positions alone: derived from a BIAS
    #: class's :meth:`BiasEncoding.input_bias` declaration (FoX) or a CONTENT class's
    #: :meth:`ContentEncoding.input_transform` (PaTH), never set by hand.
    input_dependent: ClassVar[bool] = False
    #: Options used when the encoding is built for the registry contract tests and ``posenc show``
    #: (e.g. M-RoPE's ``mrope_section`` must fit the small test head size of 16).
    example_options: ClassVar[dict[str, Any]] = {}
    #: The documented numeric range of each option that has one (``{"base": greater_than(1)}``,
    #: :class:`posenc.encodings.registry.Range`): the registry refuses a value outside it before ``__init__``
    #: runs, with a ``ValueError`` naming the option and the range.
    option_ranges: ClassVar[dict[str, Any]] = {}
    #: ``__init__`` arguments that spec strings give as several flat options
    #: (:class:`posenc.encodings.registry.OptionGroup`; RoPE's ``scaling``): the registry gathers and flattens them.
    option_groups: ClassVar[dict[str, Any]] = {}
    #: Options that make a causal-only encoding correct without a causal mask (ALiBi's symmetric
    #: mode); models apply them to bidirectional layers when the spec leaves them unset.
    noncausal_options: ClassVar[dict[str, Any]] = {}
    #: ``__init__`` options that are the layer's own sizes (names of :attr:`LayerContext.SIZES`):
    #: taken from the :class:`LayerContext` when the spec leaves them out; a spec value that
    #: disagrees with the layer is an error.
    layer_sizes: ClassVar[tuple[str, ...]] = ()
    #: Non-persistent buffers computed from the options (never trained, never saved): kept float32
    #: or integer and recomputed by :meth:`reset_buffers` whenever the module is moved or cast.
    derived_buffers: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        super().__init__()
        self._config: dict[str, Any] = {}
        self.max_positions: int | None = None

    # ------------------------------------------------------------------ bookkeeping
    def config(self) -> dict[str, Any]:
        """The options this instance was built with (round-trips through :func:`posenc.build`)."""
        return dict(self._config)

    def spec(self) -> str:
        """A spec string that rebuilds this encoding, e.g. ``"rope:base=500000.0"``."""
        return format_spec(self.name, self._config)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self._config.items())

    def check_positions(self, positions: Tensor, name: str = "positions") -> Tensor:
        """Validate positions for this encoding (dtype, rank, sign and ``max_positions``)."""
        positions = check_positions(
            positions,
            name=name,
            allow_negative=self.allows_negative_positions,
            allow_float=self.float_positions,
            integer_reason=self.integer_positions_reason or f"{self.name} is defined on whole positions",
        )
        if self.max_positions is not None and positions.numel() > 0 and checks_values():
            start = known_start(positions)
            if start is not None:
                top = start + positions.shape[-1] - 1
            else:
                top = positions.max()
                top = math.ceil(float(top)) if top.is_floating_point() else int(top)
            if top >= self.max_positions:
                raise ValueError(
                    f"{self.name}: position {top} is outside the table (max_positions={self.max_positions}); "
                    f"{self._limit_hint()}"
                )
        return positions

    def _limit_hint(self) -> str:
        return "use a larger table or an encoding that extrapolates"

    def preview(self) -> str:
        """A small text view of the encoding's numbers, shown by ``posenc show``."""
        return ""

    # ------------------------------------------------------------------ the layer
    @classmethod
    def layer_defaults(cls, ctx: LayerContext) -> dict[str, Any]:
        """Options the layer suggests when the spec leaves them out (a spec value wins).

        E.g. a learned table takes its size from ``ctx.max_len``, T5 its bucket layout from
        ``ctx.causal``. The default suggests nothing.
        """
        return {}

    @classmethod
    def options_for_layer(cls, ctx: LayerContext, given: dict[str, Any]) -> dict[str, Any]:
        """``given`` completed for the layer ``ctx``: :attr:`layer_sizes` and :meth:`layer_defaults`.

        Raises:
            ValueError: ``given`` sets a layer size to another value than the layer's.
        """
        options = {k: v for k, v in cls.layer_defaults(ctx).items() if k not in given}
        for key in cls.layer_sizes:
            have = getattr(ctx, key)
            if key in given and given[key] != have:
                raise ValueError(f"{cls.name}: spec sets {key}={given[key]} but the layer has {key}={have}")
            options[key] = have
        return {**options, **given}

    def check_layer(self, ctx: LayerContext) -> None:
        """Check that this (already built) encoding fits the layer ``ctx``: its layer sizes agree.

        Raises:
            ValueError: naming the size that differs.
        """
        config = self.config()
        for key in self.layer_sizes:
            have = config.get(key)
            if have is not None and have != getattr(ctx, key):
                raise ValueError(
                    f"{self.name}: encoding was built with {key}={have} but the layer has {key}={getattr(ctx, key)}"
                )

    def init_layer(self, layer: nn.Module) -> None:
        """Called once by every attention layer that uses this encoding.

        CONTENT encodings that need per-layer parameters (DeBERTa's position projections) register
        them on ``layer`` here, so that a shared encoding still gets one set per layer.
        """

    def logit_scale(self, head_dim: int) -> float:
        """The default logit scale for this encoding (1/sqrt(head_dim); DeBERTa overrides it)."""
        return head_dim**-0.5

    # ------------------------------------------------------------------ derived buffers
    def reset_buffers(self) -> None:
        """Recompute every buffer of :attr:`derived_buffers` from the options, in float32 (or integer).

        Encodings that declare derived buffers implement it with :meth:`set_derived`; it runs
        at construction and after every ``.to()``, ``to_empty()`` or other move of the module.
        """
        if self.derived_buffers:
            raise NotImplementedError(
                f"{type(self).__name__} declares derived_buffers: implement reset_buffers()"
            )

    def set_derived(self, name: str, value: Tensor) -> None:
        """Store derived buffer ``name`` (non-persistent) on :attr:`buffer_device`.

        Raises:
            TypeError: ``name`` is not declared in :attr:`derived_buffers`, or ``value`` is a
                floating tensor other than float32.
        """
        if name not in self.derived_buffers:
            raise TypeError(f"{type(self).__name__}: {name!r} is not listed in derived_buffers")
        if value.is_floating_point() and value.dtype != torch.float32:
            raise TypeError(
                f"{type(self).__name__}: derived buffer {name!r} must be float32, got {value.dtype}"
            )
        self.register_buffer(name, value.to(self.buffer_device), persistent=False)

    @property
    def buffer_device(self) -> torch.device:
        """Where derived buffers live: the device of the first one already set, else the default device."""
        for name in self.derived_buffers:
            try:
                return self.get_buffer(name).device
            except AttributeError:  # not set yet (during __init__)
                continue
        return torch.get_default_device()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> PositionalEncoding:
        # ``.to(bf16)`` would round derived tables and ``to_empty()`` (meta-device construction)
        # leaves them uninitialised: let nn.Module move everything, then recompute them in place.
        super()._apply(fn, recurse)
        if self.derived_buffers:
            with torch.device(self.buffer_device):  # tables are computed where they will live
                self.reset_buffers()
            self._check_derived()
        return self

    def _check_derived(self) -> None:
        for name in self.derived_buffers:
            buffer = self.get_buffer(name)
            if buffer.is_floating_point() and buffer.dtype != torch.float32:
                raise TypeError(
                    f"{type(self).__name__}.reset_buffers() left derived buffer {name!r} in {buffer.dtype}, not float32"
                )


class AbsoluteEncoding(PositionalEncoding):
    """ABSOLUTE: position vectors added to the layer input; implement :meth:`encode`."""

    kind = Kind.ABSOLUTE
    hook = "encode"

    def encode(self, positions: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """The position vectors ``[B, T, dim]`` for integer ``positions [B, T]``."""
        raise NotImplementedError(f"{type(self).__name__} must implement encode()")

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """``x [B, T, dim]`` plus the position vectors of ``positions [B, T]``."""
        return x + self.encode(positions, dtype=x.dtype)


class RotaryEncoding(PositionalEncoding):
    """ROTARY: rotates queries and keys before the kernel; implement :meth:`rotate`."""

    kind = Kind.ROTARY
    hook = "rotate"

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate ``q [B, H, Tq, D]`` and ``k [B, Hkv, Tk, D]`` by their positions ``[B, T]``."""
        raise NotImplementedError(f"{type(self).__name__} must implement rotate()")

    def rotate_fresh(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`rotate` for q and k that are fresh projections the caller hands over: an encoding
        may rotate them in place (RoPE does). Default: :meth:`rotate`."""
        return self.rotate(q, k, q_pos, k_pos)


class BiasEncoding(PositionalEncoding):
    """BIAS: a scalar added to each logit; implement :meth:`bias_at` (every backend serves it).

    A fast path that needs more of the encoding reads one declaration: :meth:`near_far`
    (:class:`NearFar`, the near/far split) and, for a bias that depends on the layer input,
    :meth:`input_bias` (:class:`InputBias`; it sets ``input_dependent``, and ``bias_at`` is then a
    position-only view for plots, the bias at zero input, never used for attention).
    """

    kind = Kind.BIAS
    hook = "bias_at"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.input_dependent = cls.input_bias is not BiasEncoding.input_bias

    def near_far(self) -> NearFar | None:
        """What makes the bias cheap far from the diagonal (:class:`NearFar`), or None (default)."""
        return None

    def input_bias(self) -> InputBias | None:
        """How an input-dependent bias is computed (:class:`InputBias`), or None (default: the bias
        depends on positions only). A class that overrides it is ``input_dependent``."""
        return None

    def bias_at(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The additive logit bias for broadcastable integer tensors ``head, q_pos, k_pos``.

        This is the single definition of the bias: the dense :meth:`bias`, the eager backend and
        the flex backend's ``score_mod`` all evaluate it. It must be elementwise in its arguments.
        Returns float32, or the parameters' dtype when that is wider (a float64 model keeps
        float64 biases, so gradcheck sees exact gradients); never bfloat16/float16.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement bias_at()")

    def bias_for_positions(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The dense bias ``[B, H, Tq, Tk]`` (float32) for positions ``[B, Tq]`` and ``[B, Tk]``."""
        heads = torch.arange(int(self.num_heads), device=q_pos.device)
        return self.bias_at(heads[None, :, None, None], q_pos[:, None, :, None], k_pos[:, None, None, :])

    def bias(self, q_len: int, k_len: int, q_offset: int = 0) -> Tensor:
        """The dense bias ``[H, q_len, k_len]`` with queries at ``q_offset + arange(q_len)``.

        For plots and tests; attention backends never build the dense bias on their fast paths.
        """
        device = _device_of(self)
        q_pos = torch.arange(q_offset, q_offset + q_len, device=device)[None]
        k_pos = torch.arange(k_len, device=device)[None]
        return self.bias_for_positions(q_pos, k_pos)[0]

    def score_mod(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """FlexAttention ``score_mod`` for queries and keys whose positions equal their indices."""
        return score + self.bias_at(h, q_idx, kv_idx).to(score.dtype)


class ContentEncoding(PositionalEncoding):
    """CONTENT: computes the logits itself (and optionally a value term); implement :meth:`logits`.

    A transform that depends on the layer input (PaTH) declares :meth:`input_transform`
    (:class:`InputTransform`; it sets ``input_dependent``), and its :meth:`logits` then takes
    ``token_states=``.
    """

    kind = Kind.CONTENT
    hook = "logits"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.input_dependent = cls.input_transform is not ContentEncoding.input_transform

    def input_transform(self) -> InputTransform | None:
        """How an input-dependent transform is computed (:class:`InputTransform`), or None (default)."""
        return None

    def clipped_relative(self, layer: nn.Module | None, heads: int) -> ClippedRelative | None:
        """The encoding's tables when its position terms have that form (Shaw, DeBERTa), else None.

        ``layer`` is the attention layer (an encoding may project its tables with the layer's
        projections), ``heads`` its query heads."""
        return None

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
        """The full scaled logits ``[B, H, Tq, Tk]`` (content and position terms).

        ``q [B, H, Tq, D]`` and ``k [B, H, Tk, D]`` (key heads already repeated for grouped-query
        attention); ``scale`` is the layer's logit scale (1/sqrt(D) unless overridden).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement logits()")

    def attend(self, probs: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The attention output ``[B, H, Tq, D]`` from ``probs [B, H, Tq, Tk]`` and ``v`` (optional hook)."""
        return probs @ v


#: The base class of each kind.
KIND_BASES: dict[Kind, type[PositionalEncoding]] = {
    Kind.ABSOLUTE: AbsoluteEncoding,
    Kind.ROTARY: RotaryEncoding,
    Kind.BIAS: BiasEncoding,
    Kind.CONTENT: ContentEncoding,
}


def token_states_function(
    encoding: PositionalEncoding,
) -> Callable[[Tensor, Tensor | None, Tensor | None], Tensor]:
    """``token_states(x, previous, padding)`` of an input-dependent encoding: its
    :class:`InputBias`'s (BIAS) or :class:`InputTransform`'s (CONTENT)."""
    if encoding.kind is Kind.BIAS:
        return encoding.input_bias().token_states  # type: ignore[attr-defined]
    return encoding.input_transform().token_states  # type: ignore[attr-defined]


def _device_of(module: nn.Module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")
