"""``flex`` backend: FlexAttention driven by the encoding's one bias definition (BIAS kinds).

The ``score_mod`` adds ``encoding.bias_at(h, q_pos[b, q_idx], k_pos[b, kv_idx])`` to each score:
positions are looked up, not taken from the indices, so explicit positions, left padding and KV
caches work. Causal, key-padding and boolean masks become one ``mask_mod`` and a block mask (the
causal-only block mask is cached by shape; data-dependent ones are built per call); a float
``attn_mask`` is added in the ``score_mod``. ``flex_attention`` is wrapped in ``torch.compile``
once (``dynamic=False``): dynamo compiles it once per shape and dtype and reuses it, and a fresh
``score_mod`` closure per call does not recompile.

What this backend refuses, with the reason stated (facts measured on torch 2.13):

* gradients on CPU: FlexAttention has no CPU backward (``NotImplementedError``); ``blocked`` trains;
* float64 on CPU (the CPU lowering takes float32, float16 and bfloat16 only);
* ``need_weights`` (FlexAttention returns no weights) and attention dropout (not supported);
* query rows with no visible key: FlexAttention returns zeros there, the eager reference averages
  every value (uniform weights);
* no C++ compiler on a CPU machine (inductor needs one), or a torch without FlexAttention;
* a new shape (or encoding object, or mask combination) once dynamo's recompile limit is used up
  (it would silently run uncompiled).

On a GPU it runs forward and backward, gradients into the encoding's parameters included (the
captured tables are lifted into the compiled graph). No GPU was available while writing this
backend: the CPU forward is tested against ``eager``; the GPU path is the same code.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable

import torch
from torch import Tensor

from ..base import Kind
from . import AttentionRequest, kind_reasons, register_backend

__all__ = ["FlexBackend", "flex_available", "flex_bias_attention"]

_COMPILED: dict[str, Callable] = {}
_SEEN_SHAPES: set[tuple] = set()
_BLOCK_MASKS: dict[tuple, object] = {}
_MAX_CACHED_BLOCK_MASKS = 16
_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def flex_available() -> str | None:
    """None when FlexAttention can be used, else why not."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    return None


@functools.lru_cache(maxsize=1)
def _cpu_compiler() -> str | None:
    """The C++ compiler inductor uses on CPU, or None when there is none."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:
        return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _compiled_flex() -> Callable:
    if "flex" not in _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


def _recompile_limit() -> int:
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8)))


def _shape_key(req: AttentionRequest) -> tuple:
    """What dynamo specialises the compiled call on: shapes, dtype, device, the encoding object
    (captured by the score_mod) and which masks are present (they change the traced functions)."""
    masks = (req.causal, req.key_padding_mask is not None, req.attn_mask is not None and req.attn_mask.dtype)
    return (tuple(req.q.shape), tuple(req.k.shape), req.q.dtype, req.q.device.type, id(req.encoding), masks)


def _has_fully_masked_row(req: AttentionRequest) -> bool:
    from .blocked import _has_fully_masked_row as blocked_check

    if req.attn_mask is not None and req.attn_mask.dtype == torch.bool:
        allowed = req.allowed()
        return allowed is not None and not bool(allowed.any(dim=-1).all())
    return blocked_check(req)


# ---------------------------------------------------------------------------- score and mask mods


def _score_mod(req: AttentionRequest) -> Callable:
    """``score + bias_at(h, q_pos[b, q], k_pos[b, kv])`` (+ the float mask), for FlexAttention."""
    batch = req.q.shape[0]
    q_pos = req.q_pos.long().expand(batch, -1).contiguous()
    k_pos = req.k_pos.long().expand(batch, -1).contiguous()
    encoding = req.encoding
    float_mask = req.float_mask()
    if float_mask is not None:
        float_mask = float_mask.expand(batch, req.num_heads, req.q_len, req.k_len)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        bias = encoding.bias_at(h, q_pos[b, q_idx], k_pos[b, kv_idx])
        if float_mask is not None:
            bias = bias + float_mask[b, h, q_idx, kv_idx]
        return score + bias.to(score.dtype)

    return score_mod


def _block_mask(req: AttentionRequest):
    """The FlexAttention block mask of the request's causal/padding/boolean masks, or None."""
    from torch.nn.attention.flex_attention import create_block_mask

    causal = req.causal
    # A tensor, not an int: dynamo would specialise on an int and recompile at every cache length.
    offset = torch.tensor(req.causal_offset, device=req.q.device)
    padding = req.key_padding_mask
    allowed = req.attn_mask if req.attn_mask is not None and req.attn_mask.dtype == torch.bool else None
    if not causal and padding is None and allowed is None:
        return None
    batch, heads = req.q.shape[0], req.num_heads
    if allowed is not None:
        allowed = allowed.expand(batch, heads, req.q_len, req.k_len)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        keep = kv_idx <= q_idx + offset if causal else torch.ones_like(q_idx, dtype=torch.bool)
        if padding is not None:
            keep = keep & ~padding[b, kv_idx]
        if allowed is not None:
            keep = keep & allowed[b, h, q_idx, kv_idx]
        return keep

    data_free = padding is None and allowed is None
    key = (req.q_len, req.k_len, req.causal_offset, str(req.q.device))
    if data_free and key in _BLOCK_MASKS:
        return _BLOCK_MASKS[key]
    mask = create_block_mask(
        mask_mod,
        None if data_free else batch,
        heads if allowed is not None else None,
        req.q_len,
        req.k_len,
        device=req.q.device,
    )
    if data_free:
        if len(_BLOCK_MASKS) >= _MAX_CACHED_BLOCK_MASKS:
            _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
        _BLOCK_MASKS[key] = mask
    return mask


def flex_bias_attention(req: AttentionRequest, *, compiled: bool = True) -> Tensor:
    """Attention output ``[B, H, Tq, D]`` of a BIAS request through FlexAttention.

    ``compiled=False`` runs FlexAttention's uncompiled reference (it materialises the scores; for
    tests of the score and mask functions only).
    """
    from torch.nn.attention.flex_attention import flex_attention

    run = _compiled_flex() if compiled else flex_attention
    if compiled:
        _SEEN_SHAPES.add(_shape_key(req))
    q, k, v = req.q, req.k, req.v
    if not torch.is_grad_enabled():
        # FlexAttention refuses CPU inputs that require grad even under no_grad.
        q, k, v = q.detach(), k.detach(), v.detach()
    return run(
        q,
        k,
        v,
        score_mod=_score_mod(req),
        block_mask=_block_mask(req),
        scale=req.scale,
        enable_gqa=req.q.shape[1] != req.k.shape[1],
    )


class FlexBackend:
    name = "flex"

    def declines(self, request: AttentionRequest) -> list[str]:
        if request.q.device.type == "cpu":
            return [
                "on CPU each new shape costs a 10-15 s compile; blocked and sdpa serve without one (force flex to use it)"
            ]
        return []

    def reasons(self, request: AttentionRequest) -> list[str]:
        reasons = kind_reasons(request, Kind.BIAS)
        missing = flex_available()
        if missing:
            return [*reasons, missing]
        device = request.q.device.type
        if device == "cpu":
            if request.needs_grad:
                reasons.append(
                    "FlexAttention has no backward pass on CPU (torch raises NotImplementedError); "
                    "the blocked backend trains bias encodings on CPU"
                )
            if request.q.dtype not in _CPU_DTYPES:
                reasons.append(
                    f"compiled FlexAttention on CPU supports float32/float16/bfloat16, not {request.q.dtype}"
                )
            if _cpu_compiler() is None:
                reasons.append("torch.compile needs a C++ compiler on CPU and none was found")
        elif device not in ("cuda", "xpu"):
            reasons.append(f"FlexAttention is not compiled for device {device!r}")
        if request.need_weights:
            reasons.append("FlexAttention returns no attention weights")
        if request.dropout_p > 0:
            reasons.append("FlexAttention has no attention dropout")
        if request.q_len == 0 or request.k_len == 0:
            reasons.append("empty query or key sequence")
        elif _has_fully_masked_row(request):
            reasons.append(
                "a query row sees no key: FlexAttention returns zeros there, eager averages all values"
            )
        if _shape_key(request) not in _SEEN_SHAPES and len(_SEEN_SHAPES) >= _recompile_limit():
            reasons.append(
                f"FlexAttention is already compiled for {len(_SEEN_SHAPES)} shapes (dynamo's recompile limit); "
                "a new shape would run uncompiled"
            )
        return reasons

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        return flex_bias_attention(request), None


register_backend(FlexBackend(), priority=30)
