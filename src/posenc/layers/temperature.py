"""Query temperature forms, a :class:`~posenc.layers.patterns.LayerSpec`'s ``temperature``: each scales
a layer's queries by a factor of the query's position after the encoding acts. Llama 4's NoPE layers
(:class:`QueryTemperature`), Inkling's global layers and SWAN-GPT (:class:`LogQueryTemperature`), and
Mistral Large 4's learned per-head ``s_h · ln(p + 1) + b_h`` (:class:`LearnedLogTemperature`, which a
layer turns into its own :class:`LogPositionQueryScaling`). :func:`layer_temperature` is what a layer
keeps of a declared form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "LearnedLogTemperature",
    "LogPositionQueryScaling",
    "LogQueryTemperature",
    "QueryTemperature",
    "SSMaxTemperature",
    "TemperatureForm",
    "VisibleKeysScaling",
    "layer_temperature",
]


class TemperatureForm:
    """A position-dependent query scale (a layer's ``query_temperature``): queries at position ``p``
    are multiplied by :meth:`factors` after the encoding acts. Llama 4's floored form is
    :class:`QueryTemperature`, Inkling's continuous one :class:`LogQueryTemperature`.

    A form that sets :attr:`reads_visible_keys` (SSMax) scales each query by the number of keys it
    attends to, which the layer counts from the call's mask (:meth:`factors_from_counts`)."""

    #: True when the scale reads the number of keys each query sees, not its position.
    reads_visible_keys: bool = False

    def factors(self, positions: Tensor) -> Tensor:
        """The scale of each query: ``positions [B|1, T]`` (integers) -> ``[B|1, 1, T, 1]`` float32
        (``[B|1, H, T, 1]`` for a per-head form)."""
        raise NotImplementedError

    def factors_from_counts(self, counts: Tensor) -> Tensor:
        """The scale of each query from the number of keys it sees, ``counts [B|1, H|1, T]`` ->
        ``[B|1, H, T, 1]`` (forms that set :attr:`reads_visible_keys`)."""
        raise NotImplementedError

    def for_layer(self, num_heads: int, *, device=None, dtype=None) -> TemperatureForm:
        """The form a layer of ``num_heads`` query heads keeps: this one (a fixed form), or a module with
        its own parameters built from a declaration (:class:`LearnedLogTemperature`)."""
        return self

    def declared(self) -> TemperatureForm:
        """The form as a layer pattern names it (a :class:`LayerSpec`'s ``temperature``): this one, or the
        declaration a learned module was built from."""
        return self


@dataclass(frozen=True)
class QueryTemperature(TemperatureForm):
    """A position-dependent query scale: queries at position ``p`` are multiplied by
    ``log1p(floor((p + position_offset) / floor_scale)) * attn_scale + 1``.

    Llama 4's NoPE layers (HF ``attn_temperature_tuning``): the defaults, ``position_offset=1``.
    Ministral 3 / Mistral 4 (HF ``llama_4_scaling_beta``) on every layer:
    ``QueryTemperature(floor_scale=original_max_position_embeddings, attn_scale=beta, position_offset=0)``.
    """

    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    position_offset: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.floor_scale) and self.floor_scale > 0):
            raise ValueError(f"QueryTemperature: floor_scale must be finite and > 0, got {self.floor_scale}")
        if not math.isfinite(self.attn_scale):
            raise ValueError(f"QueryTemperature: attn_scale must be finite, got {self.attn_scale}")

    def factors(self, positions: Tensor) -> Tensor:
        """``log1p(floor((p + offset) / floor_scale)) * attn_scale + 1`` as ``[B|1, 1, T, 1]`` float32."""
        shifted = (positions.to(torch.float32) + self.position_offset) / self.floor_scale
        return (torch.log1p(torch.floor(shifted)) * self.attn_scale + 1.0)[:, None, :, None]


@dataclass(frozen=True)
class LogQueryTemperature(TemperatureForm):
    """The continuous log temperature: queries at position ``p`` are multiplied by
    ``1 + alpha * ln(max((p + position_offset) / n_floor, 1))``: 1 up to ``n_floor`` tokens, then
    growing with the log of the length, without Llama 4's floor steps.

    Inkling's global layers (HF ``InklingAttention``: ``log_scaling_alpha``, ``log_scaling_n_floor``,
    positions counted from 1, the defaults' ``position_offset=1``). Inkling multiplies its
    relative-projection bias by the same factor; this scale acts on the queries only.
    """

    n_floor: float
    alpha: float = 0.1
    position_offset: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.n_floor) and self.n_floor > 0):
            raise ValueError(
                f"LogQueryTemperature: n_floor must be finite and > 0 (HF log_scaling_n_floor), got {self.n_floor}"
            )
        if not math.isfinite(self.alpha):
            raise ValueError(
                f"LogQueryTemperature: alpha must be finite (HF log_scaling_alpha), got {self.alpha}"
            )
        if not math.isfinite(self.position_offset):
            raise ValueError(
                f"LogQueryTemperature: position_offset must be finite, got {self.position_offset}"
            )

    @classmethod
    def swan(cls, log_base: float) -> LogQueryTemperature:
        """SWAN-GPT's dynamic attention scaling of its NoPE layers, ``s_p = log_a(p + a)`` with ``a =
        log_base`` (> 1), tuned after training: the same form, ``1 + ln((p + a) / a) / ln a``.

        Source: SWAN-GPT (Puvvada et al. 2025, arXiv 2504.08719) as Chen, Thai et al. 2026 ("Hybrid
        Linear Attention Done Right", arXiv 2601.22156, Eq. 11), who adopt it, restate it:
        ``softmax(s_t q_t K^T / sqrt(d))``, ``s_t = log_a(t + a)``. ``t`` is taken as posenc's 0-based
        position, so the first token's factor is 1 (docs/conventions.md §11.2).
        """
        if isinstance(log_base, bool) or not isinstance(log_base, (int, float)) or not log_base > 1:
            raise ValueError(
                f"LogQueryTemperature.swan: log_base must be a number > 1 (SWAN's a), got {log_base!r}"
            )
        return cls(n_floor=float(log_base), alpha=1.0 / math.log(log_base), position_offset=float(log_base))

    def factors(self, positions: Tensor) -> Tensor:
        """``1 + alpha * ln(max((p + offset) / n_floor, 1))`` as ``[B|1, 1, T, 1]`` float32."""
        ratio = (positions.to(torch.float32) + self.position_offset) / self.n_floor
        return (1.0 + self.alpha * torch.log(ratio.clamp(min=1.0)))[:, None, :, None]


class LogPositionQueryScaling(nn.Module, TemperatureForm):
    """Mistral Large 4's learned log-position query scale: queries of head ``h`` at position ``p`` are
    multiplied by ``s_h · ln(p + 1) + b_h``.

    HF ``MistralLarge4TextSoftmaxScaling`` (applied on every layer, RoPE and NoPE, to the whole query
    after its rotation, at the call's ``position_ids``); parameter names are HF's, :attr:`scale`
    ``[H]`` (``s``) and :attr:`bias` ``[H]`` (``b``), initialised as HF's ``_init_weights`` does to
    ``s = 0``, ``b = 1``: the identity until trained or loaded. ``p`` is posenc's 0-based position,
    as HF's ``position_ids``, so a cached decoding step scales with its own position (the layer
    hands its query positions). ``ln(p + 1)`` is taken in float32, as HF does; the factors are formed
    in float32 (float64 for a float64 module) and cast to the queries' dtype (HF casts ``ln(p + 1)``, ``s`` and ``b`` to it first: the same
    numbers in float32 and float64, within a rounding in half precision) (docs/conventions.md §11.5).

    Build it through a layer: ``MultiheadAttention(..., query_temperature=LearnedLogTemperature())``
    (or a pattern's ``LayerSpec(temperature=LearnedLogTemperature())``) gives each layer its own
    module, ``layer.query_temperature``, whose parameters are in the layer's state dict.

    Args:
        num_heads: query heads ``H`` (a layer refuses a module built for another count).
    """

    def __init__(self, num_heads: int, *, device=None, dtype=None) -> None:
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"LogPositionQueryScaling: num_heads must be a positive int, got {num_heads!r}")
        self.num_heads = num_heads
        self.scale = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.ones(num_heads, device=device, dtype=dtype))

    def factors(self, positions: Tensor) -> Tensor:
        """``s_h · ln(p + 1) + b_h`` as ``[B|1, H, T, 1]`` for ``positions [B|1, T]``: float32, or float64
        for a float64 module (never a half type)."""
        dtype = torch.promote_types(self.scale.dtype, torch.float32)
        # ln(p + 1) in float32 whatever the module's dtype, as HF (``(position_ids + 1).float().log()``)
        log_pos = torch.log(positions.to(torch.float32) + 1.0).to(dtype)[:, None, :]  # [B|1, 1, T]
        scale = self.scale.to(device=positions.device, dtype=dtype)[None, :, None]
        bias = self.bias.to(device=positions.device, dtype=dtype)[None, :, None]
        return (scale * log_pos + bias)[..., None]

    def forward(self, q: Tensor, positions: Tensor) -> Tensor:
        """``q [B, H, T, D]`` scaled at ``positions [B|1, T]``."""
        return q * self.factors(positions).to(q.dtype)

    def declared(self) -> TemperatureForm:
        return LearnedLogTemperature()

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"


@dataclass(frozen=True)
class LearnedLogTemperature(TemperatureForm):
    """The declaration of a learned log-position query scale (Mistral Large 4): each layer that takes it
    builds its own :class:`LogPositionQueryScaling` for its number of heads (``s = 0``, ``b = 1``)."""

    def for_layer(self, num_heads: int, *, device=None, dtype=None) -> TemperatureForm:
        return LogPositionQueryScaling(num_heads, device=device, dtype=dtype)

    def factors(self, positions: Tensor) -> Tensor:
        """The untrained scale, 1 at every position (``[B|1, 1, T, 1]``); a layer uses its module's."""
        return torch.ones(*positions.shape, dtype=torch.float32, device=positions.device)[:, None, :, None]


class VisibleKeysScaling(nn.Module, TemperatureForm):
    """Scalable-Softmax (SSMax, Nakanishi 2025, arXiv 2501.19399) as a query scale: each query's logits
    are multiplied by ``s_h · ln n + b_h``, where ``n`` is the number of keys the query attends to (the
    keys its mask lets through: ``p + 1`` under a causal mask, counted from each packed document's
    start, ``min(p + 1, W)`` in a window, the real keys of a padded row), and ``s_h`` (and ``b_h``,
    with ``bias``) are learned per head. The paper's form without the bias; axolotl's
    ``scaled_softmax_attn`` (``score · (s · log n + b)``) and OLMo-core's with it.

    Parameters: :attr:`scale` ``[H]`` (initialised to ``scale_init``, the paper's 0.43 by default) and,
    with ``bias``, :attr:`bias` ``[H]`` (zeros). A layer builds it from :class:`SSMaxTemperature`."""

    reads_visible_keys = True

    def __init__(
        self, num_heads: int, scale_init: float = 0.43, bias: bool = False, *, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = nn.Parameter(torch.full((num_heads,), float(scale_init), device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype)) if bias else None
        self._declaration = SSMaxTemperature(scale_init, bias)

    def factors(self, positions: Tensor) -> Tensor:
        raise ValueError(
            "SSMax scales by the number of keys each query sees, which the layer counts from its mask "
            "(factors_from_counts); it has no scale by position alone"
        )

    def factors_from_counts(self, counts: Tensor) -> Tensor:
        """``s_h · ln n + b_h`` as ``[B|1, H, T, 1]`` for ``counts [B|1, H|1, T]`` (float32, or float64
        for a float64 module). A query that sees no key gets 0 (its row is empty anyway)."""
        dtype = torch.promote_types(self.scale.dtype, torch.float32)
        log_n = torch.log(counts.to(dtype).clamp_min(1.0))
        scale = self.scale.to(device=counts.device, dtype=dtype)[None, :, None]
        out = scale * log_n
        if self.bias is not None:
            out = out + self.bias.to(device=counts.device, dtype=dtype)[None, :, None]
        return out[..., None]

    def declared(self) -> TemperatureForm:
        return self._declaration

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, bias={self.bias is not None}"


@dataclass(frozen=True)
class SSMaxTemperature(TemperatureForm):
    """The declaration of SSMax (:class:`VisibleKeysScaling`): each layer that takes it builds its own
    module for its number of heads, ``s_h = scale_init`` and, with ``bias``, ``b_h = 0``."""

    scale_init: float = 0.43
    bias: bool = False
    reads_visible_keys = True

    def __post_init__(self) -> None:
        if isinstance(self.scale_init, bool) or not isinstance(self.scale_init, (int, float)):
            raise ValueError(f"SSMaxTemperature: scale_init must be a number, got {self.scale_init!r}")
        if not math.isfinite(self.scale_init):
            raise ValueError(f"SSMaxTemperature: scale_init must be finite, got {self.scale_init}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"SSMaxTemperature: bias must be True or False, got {self.bias!r}")

    def for_layer(self, num_heads: int, *, device=None, dtype=None) -> TemperatureForm:
        return VisibleKeysScaling(num_heads, self.scale_init, self.bias, device=device, dtype=dtype)

    def factors_from_counts(self, counts: Tensor) -> Tensor:
        return VisibleKeysScaling(1, self.scale_init, self.bias, device=counts.device).factors_from_counts(
            counts
        )


def layer_temperature(
    form: TemperatureForm | None, num_heads: int, *, device=None, dtype=None
) -> TemperatureForm | None:
    """The query temperature a layer of ``num_heads`` heads keeps for ``form`` (its own module for a
    learned declaration); ``ValueError`` naming ``query_temperature`` for a per-head module built for
    another head count."""
    if form is None:
        return None
    heads = getattr(form, "num_heads", None)
    if heads is not None and heads != num_heads:
        raise ValueError(
            f"query_temperature: {type(form).__name__} has {heads} heads but the layer has num_heads="
            f"{num_heads}; build it for {num_heads} heads, or pass LearnedLogTemperature() and let the layer build it"
        )
    return form.for_layer(num_heads, device=device, dtype=dtype)
