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
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

__all__ = ["Kind", "PositionalEncoding", "check_positions"]


class Kind(str, enum.Enum):
    """Where an encoding acts on attention."""

    ABSOLUTE = "absolute"
    ROTARY = "rotary"
    BIAS = "bias"
    CONTENT = "content"


def check_positions(positions: Tensor, *, name: str = "positions", allow_negative: bool = False) -> Tensor:
    """Validate an integer position tensor and return it as int64 with a batch axis ``[B, T]``.

    Raises:
        ValueError: if ``positions`` is not an integer tensor, has more than two dimensions, or
            holds negative values while ``allow_negative`` is False.
    """
    if not isinstance(positions, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of integers, got {type(positions).__name__}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {positions.dtype}")
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.dim() != 2:
        raise ValueError(f"{name} must have shape [T] or [B, T], got {tuple(positions.shape)}")
    if not allow_negative and positions.numel() > 0 and bool((positions < 0).any()):
        raise ValueError(f"{name} must be non-negative, got minimum {int(positions.min())}")
    return positions.long()


class PositionalEncoding(nn.Module):
    """Base class of every registered encoding.

    Subclasses set :attr:`kind` and implement the hook of that kind. The registry sets
    :attr:`name`, :attr:`description` and records the options the instance was built with
    (:meth:`config`).

    Class attributes a subclass may set:

    * ``kind``: the :class:`Kind`.
    * ``shift_invariant``: True when adding a constant to every position leaves attention unchanged
      (relative encodings). The contract tests check it.
    * ``shared_across_layers``: True when one instance serves every layer of a stack (T5 shares its
      bias table across the layers of a stack; DeBERTa shares its relative embedding table).
    * ``causal_only``: True when the encoding is only defined for causal attention (Kerple, FIRE);
      an instance may set it from its options (ALiBi's causal mode). Cross-attention is never
      causal, so the layer refuses such encodings there.
    * ``noncausal_options``: options that lift ``causal_only`` (ALiBi: ``mode="symmetric"``).
    * ``example_options``: options for the contract tests' small layer (head size 16).
    * ``max_positions``: an instance attribute, the largest supported position + 1, or None.
    """

    kind: ClassVar[Kind]
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    shift_invariant: ClassVar[bool] = False
    shared_across_layers: ClassVar[bool] = False
    causal_only: ClassVar[bool] = False
    allows_negative_positions: ClassVar[bool] = False
    #: Options used when the encoding is built for the registry contract tests and ``posenc show``
    #: (e.g. M-RoPE's ``mrope_section`` must fit the small test head size of 16).
    example_options: ClassVar[dict[str, Any]] = {}
    #: Options that make a causal-only encoding correct without a causal mask (ALiBi's symmetric
    #: mode); models apply them to bidirectional layers when the spec leaves them unset.
    noncausal_options: ClassVar[dict[str, Any]] = {}

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
        from .registry import format_spec

        return format_spec(self.name, self._config)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self._config.items())

    def check_positions(self, positions: Tensor, name: str = "positions") -> Tensor:
        """Validate positions for this encoding (dtype, rank, sign and ``max_positions``)."""
        positions = check_positions(positions, name=name, allow_negative=self.allows_negative_positions)
        if self.max_positions is not None and positions.numel() > 0:
            top = int(positions.max())
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

    def init_layer(self, layer: nn.Module) -> None:
        """Called once by every attention layer that uses this encoding.

        CONTENT encodings that need per-layer parameters (DeBERTa's position projections) register
        them on ``layer`` here, so that a shared encoding still gets one set per layer.
        """

    # ------------------------------------------------------------------ ABSOLUTE
    def encode(self, positions: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """ABSOLUTE: the position vectors ``[B, T, dim]`` for integer ``positions [B, T]``."""
        raise NotImplementedError(f"{type(self).__name__} is {self.kind.value}, not absolute")

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """ABSOLUTE: ``x [B, T, dim]`` plus the position vectors of ``positions [B, T]``."""
        return x + self.encode(positions, dtype=x.dtype)

    # ------------------------------------------------------------------ ROTARY
    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """ROTARY: rotate ``q [B, H, Tq, D]`` and ``k [B, Hkv, Tk, D]`` by their positions ``[B, T]``."""
        raise NotImplementedError(f"{type(self).__name__} is {self.kind.value}, not rotary")

    # ------------------------------------------------------------------ BIAS
    def bias_at(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """BIAS: the additive logit bias for broadcastable integer tensors ``head, q_pos, k_pos``.

        This is the single definition of the bias: the dense :meth:`bias`, the eager backend and
        the flex backend's ``score_mod`` all evaluate it. It must be elementwise in its arguments.
        Returns float32, or the parameters' dtype when that is wider (a float64 model keeps
        float64 biases, so gradcheck sees exact gradients); never bfloat16/float16.
        """
        raise NotImplementedError(f"{type(self).__name__} is {self.kind.value}, not bias")

    @property
    def num_bias_heads(self) -> int:
        """BIAS: number of heads the bias is defined for."""
        return int(self.num_heads)

    def bias_for_positions(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """BIAS: the dense bias ``[B, H, Tq, Tk]`` (float32) for positions ``[B, Tq]`` and ``[B, Tk]``."""
        heads = torch.arange(self.num_bias_heads, device=q_pos.device)
        return self.bias_at(heads[None, :, None, None], q_pos[:, None, :, None], k_pos[:, None, None, :])

    def bias(self, q_len: int, k_len: int, q_offset: int = 0) -> Tensor:
        """BIAS: the dense bias ``[H, q_len, k_len]`` with queries at ``q_offset + arange(q_len)``.

        For plots and tests; attention backends never build the dense bias on their fast paths.
        """
        device = _device_of(self)
        q_pos = torch.arange(q_offset, q_offset + q_len, device=device)[None]
        k_pos = torch.arange(k_len, device=device)[None]
        return self.bias_for_positions(q_pos, k_pos)[0]

    def score_mod(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """BIAS: FlexAttention ``score_mod`` for queries and keys whose positions equal their indices."""
        return score + self.bias_at(h, q_idx, kv_idx).to(score.dtype)

    # ------------------------------------------------------------------ CONTENT
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
        """CONTENT: the full scaled logits ``[B, H, Tq, Tk]`` (content and position terms).

        ``q [B, H, Tq, D]`` and ``k [B, H, Tk, D]`` (key heads already repeated for grouped-query
        attention); ``scale`` is the layer's logit scale (1/sqrt(D) unless overridden).
        """
        raise NotImplementedError(f"{type(self).__name__} is {self.kind.value}, not content")

    def attend(self, probs: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """CONTENT: the attention output ``[B, H, Tq, D]`` from ``probs [B, H, Tq, Tk]`` and ``v``."""
        return probs @ v

    def logit_scale(self, head_dim: int) -> float:
        """The default logit scale for this encoding (1/sqrt(head_dim); DeBERTa overrides it)."""
        return head_dim**-0.5


def _device_of(module: nn.Module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")
