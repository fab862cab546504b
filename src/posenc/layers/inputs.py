"""What :class:`~posenc.MultiheadAttention` is given, checked: its sizes, scale and attention pattern
(window, chunk, sinks, query temperature) at construction; ``x``, ``context``, devices, padding and ``attn_mask`` at each call.

Each check raises a ``ValueError`` that names the argument and what to pass instead. Checks that
read tensor values belong to :mod:`posenc.layers.positions` and the request; these read shapes, dtypes
and devices only, so they cost the same on every decode step.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..backends.parts.softcap import check_softcap
from ..cache.kv_cache import KVCacheEntry
from ..encodings.base import TokenStates
from .patterns import LayerSpec
from .temperature import TemperatureForm

__all__ = [
    "AttentionInputs",
    "check_attn_mask",
    "check_devices",
    "check_group_ids",
    "check_input",
    "check_padding",
    "check_pattern",
    "check_projections",
    "check_scale",
    "check_sizes",
    "check_span",
]


@dataclass
class AttentionInputs:
    """What one call attends with: ``q [B, H, Tq, D]``, ``k``/``v [B, Hkv, Tk, D]`` (the cached keys
    first) and their positions, with what the mask and the backend read about the keys."""

    q: Tensor
    k: Tensor
    v: Tensor
    q_pos: Tensor
    k_pos: Tensor
    #: keys cached before this call's (self-attention; the causal mask's offset)
    past: int = 0
    padding: Tensor | None = None
    documents: Tensor | None = None
    states: TokenStates | None = None
    #: this layer's self-attention entry as read before the call (None: none, or cross-attention)
    entry: KVCacheEntry | None = None


def check_sizes(embed_dim: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None = None) -> int:
    """The layer's head counts, checked: ``E`` divisible by ``H`` (unless ``head_dim`` is given, a
    positive int), ``Hkv`` dividing ``H``. Returns ``Hkv``."""
    for label, value in (
        ("embed_dim", embed_dim),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{label} must be an int, got {value!r} ({type(value).__name__})")
    if embed_dim <= 0 or num_heads <= 0:
        raise ValueError(f"embed_dim and num_heads must be positive, got {embed_dim} and {num_heads}")
    if head_dim is not None and head_dim <= 0:
        raise ValueError(f"head_dim must be positive or None (embed_dim / num_heads), got {head_dim}")
    if head_dim is None and embed_dim % num_heads:
        raise ValueError(
            f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; pass head_dim= for another head size"
        )
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must be positive and divide num_heads={num_heads}")
    return num_kv_heads


def check_scale(scale: object) -> float:
    """A layer's ``scale=`` as a float: finite and > 0, else a ValueError naming ``scale`` (a nan or
    inf scale made every row of the output the same vector; a negative one inverts the attention)."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(
            f"scale must be a number (the logit scale; None for 1/sqrt(head_dim)), got {scale!r}"
        )
    value = float(scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"scale must be finite and > 0 (the logit scale; None for 1/sqrt(head_dim)), got {scale!r}"
        )
    return value


def check_span(name: str, value: int | None, causal: bool, needs_causal: bool = True) -> int | None:
    """A window or chunk size: None, or a positive int (on a causal layer when ``needs_causal``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int (a number of tokens) or None, got {value!r}")
    if needs_causal and not causal:
        raise ValueError(f"{name}={value} needs causal=True: the {name} is defined over past keys only")
    return value


def check_pattern(
    pattern: LayerSpec | None,
    window: int | None,
    chunk: int | None,
    sinks: bool,
    query_temperature: TemperatureForm | None,
    causal: bool,
    softcap: float | None = None,
    value_from_key: bool = False,
) -> tuple[int | None, int | None, bool, TemperatureForm | None, float | None, bool]:
    """A layer's attention pattern ``(window, chunk, sinks, query_temperature, softcap,
    value_from_key)``, checked: the six arguments, or the fields of ``pattern`` (one layer of a
    model's pattern) when given."""
    if pattern is not None:
        if (pattern.head_dim, pattern.num_kv_heads) != (None, None):
            raise ValueError(
                "pattern: head_dim and num_kv_heads are the layer's sizes: pass them as "
                "MultiheadAttention(..., head_dim=, num_kv_heads=) (a model passes its LayerSpec's so)"
            )
        if pattern.kv_shared:
            raise ValueError(
                "pattern: kv_shared=True needs a model that gives the layer its donor "
                "(TransformerLM(..., kv_shared_layers=N) or a pattern with kv_shared layers)"
            )
        given = (window, chunk, sinks, query_temperature, softcap, value_from_key)
        if given != (None, None, False, None, None, False):
            raise ValueError(
                "give either pattern or window, chunk, sinks, query_temperature, softcap and "
                "value_from_key, not both"
            )
        window, chunk, sinks, query_temperature, softcap, value_from_key = (
            pattern.window,
            pattern.chunk,
            pattern.sinks,
            pattern.temperature,
            pattern.softcap,
            pattern.value_from_key,
        )
    # a window without causal is a band (|i - j| < window); chunks are defined over past keys only
    window = check_span("window", window, causal, needs_causal=False)
    chunk = check_span("chunk", chunk, causal)
    if not isinstance(sinks, bool):
        raise ValueError(f"sinks must be True or False, got {sinks!r}")
    if not isinstance(value_from_key, bool):
        raise ValueError(f"value_from_key must be True or False (K = V, Gemma 4), got {value_from_key!r}")
    if query_temperature is not None and not isinstance(query_temperature, TemperatureForm):
        raise ValueError(
            "query_temperature must be a posenc.layers.temperature.QueryTemperature (Llama 4), LogQueryTemperature "
            f"(Inkling) or LearnedLogTemperature (Mistral Large 4), got {query_temperature!r}"
        )
    return window, chunk, sinks, query_temperature, check_softcap(softcap), value_from_key


def check_input(x: Tensor, name: str, embed_dim: int, weight: Tensor) -> None:
    """``x`` (the argument ``name``) is ``[B, T, embed_dim]``, with the dtype and device of the
    layer's parameter ``weight``."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != embed_dim:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must have shape [B, T, {embed_dim}], got {shape}")
    if x.dtype != weight.dtype:
        raise ValueError(
            f"{name} has dtype {x.dtype} but the layer's parameters are {weight.dtype}; cast one of them"
        )
    if x.device != weight.device:
        raise ValueError(
            f"{name} is on device {x.device} but the layer's parameters are on {weight.device}; "
            "move one of them (layer.to(device) or x.to(device))"
        )


def check_projections(weight: Tensor, **projections: Any) -> None:
    """Every projection (an ``nn.Linear``, or None where the layer has none) has the dtype and device
    of ``weight`` (the layer's ``q_proj.weight``, which ``x`` was checked against); a ValueError names
    the first that does not, instead of a dtype error from inside ``F.linear``."""
    for name, projection in projections.items():
        if projection is None:
            continue
        for param_name in ("weight", "bias"):
            param = getattr(projection, param_name, None)
            if param is None or not param.is_floating_point():  # integer (quantized) weights: their own rules
                continue
            if param.dtype != weight.dtype or param.device != weight.device:
                raise ValueError(
                    f"{name}.{param_name} is {param.dtype} on {param.device} but q_proj.weight is "
                    f"{weight.dtype} on {weight.device}; cast or move the whole layer (layer.to(...)), "
                    "not one projection"
                )


def check_devices(x: Tensor, **arguments: Any) -> None:
    """Every tensor argument lies on ``x``'s device; a ValueError names the first that does not."""
    for name, value in arguments.items():
        if isinstance(value, Tensor) and value.device != x.device:
            raise ValueError(
                f"{name} is on device {value.device} but x is on {x.device}; move {name} to {x.device}"
            )


def check_padding(mask: Tensor, batch: int, length: int, name: str) -> Tensor:
    """A padding mask ``[batch, length]``, bool (True = padding)."""
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor (True = padding), got dtype {mask.dtype}")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{name} must have shape [{batch}, {length}], got {tuple(mask.shape)}")
    return mask


def check_group_ids(group_ids: Tensor, batch: int, length: int) -> Tensor:
    """Group ids ``[batch, length]``, an integer tensor (``-1``: no group), checked for shape and dtype."""
    if not isinstance(group_ids, Tensor):
        raise ValueError(f"group_ids must be an integer tensor [B, T], got {type(group_ids).__name__}")
    if group_ids.dtype == torch.bool or group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(
            f"group_ids must be an integer tensor (a group id per token, -1 for none), got dtype {group_ids.dtype}"
        )
    if tuple(group_ids.shape) != (batch, length):
        raise ValueError(
            f"group_ids must have shape [B, T] = [{batch}, {length}] (this call's tokens), "
            f"got {list(group_ids.shape)}"
        )
    return group_ids


def check_attn_mask(mask: Tensor, batch: int, heads: int, q_len: int, k_len: int) -> Tensor:
    """A user's ``attn_mask`` (``[Tq, Tk]``, ``[B, Tq, Tk]`` or ``[B, H, Tq, Tk]``; bool, True = may
    attend, or float) as a 4-D tensor."""
    if mask.dim() == 2:
        mask = mask[None, None]
    elif mask.dim() == 3:
        mask = mask[:, None]
    ok = (
        mask.dim() == 4
        and mask.shape[0] in (1, batch)
        and mask.shape[1] in (1, heads)
        and tuple(mask.shape[2:]) == (q_len, k_len)
    )
    if not ok:
        raise ValueError(
            f"attn_mask must have shape [Tq, Tk], [B, Tq, Tk] or [B, H, Tq, Tk] with Tq={q_len}, Tk={k_len}, "
            f"B in (1, {batch}), H in (1, {heads}); got {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise ValueError(f"attn_mask must be bool (True = may attend) or float, got dtype {mask.dtype}")
    return mask
