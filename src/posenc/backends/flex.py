"""``flex`` backend: FlexAttention driven by the encoding's one bias definition (BIAS kinds), and
soft-capped logits (``request.softcap``, Gemma 2) of any kind but CONTENT.

The ``score_mod`` adds ``encoding.bias_at(h, q_pos[b, q_idx], k_pos[b, kv_idx])`` to each score:
positions are looked up, not taken from the indices, so explicit positions, left padding and KV
caches work. An input-dependent bias (FoX) adds ``input_bias().bias_at_index(token_states, b, h,
q_idx, kv_idx)`` instead: its ``bias_at`` is the bias at zero input, for plots only. The request's mask supplies the ``mask_mod`` and block mask
(:meth:`posenc.masks.attention_mask.AttentionMask.block_mask`); a float ``attn_mask`` is added in the ``score_mod``. ``flex_attention`` is wrapped in ``torch.compile``
once (``dynamic=False``): dynamo compiles it once per shape and dtype and reuses it, and a fresh
``score_mod`` closure per call does not recompile. With ``softcap`` the ``score_mod`` caps the score
(``c * tanh(score / c)``) before it adds the bias, as the other backends do; that is also how an
ABSOLUTE or ROTARY request with soft-capping reaches a fused kernel (sdpa takes no logits).

What this backend refuses, with the reason stated (facts measured on torch 2.13):

* gradients on CPU: FlexAttention has no CPU backward (``NotImplementedError``); ``blocked`` trains;
* float64 on CPU (the CPU lowering takes float32, float16 and bfloat16 only);
* ``need_weights`` (FlexAttention returns no weights) and attention dropout (not supported);
* an input-dependent bias whose ``input_bias()`` declares no pointwise ``bias_at_index``;
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

from ..encodings.base import Kind
from . import AttentionRequest, kind_reasons, register_backend
from .parts.softcap import soft_cap

__all__ = ["FlexBackend", "flex_available", "flex_bias_attention"]

_COMPILED: dict[str, Callable] = {}
_SEEN_SHAPES: set[tuple] = set()
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
    (captured by the score_mod) and the mask's structure (it changes the traced functions)."""
    mask = req.mask
    # (data_dependent: a chunk mask under left padding reads a tensor, a different traced function)
    components = tuple((type(c).__name__, c.data_dependent) for c in mask.components)
    structure = (components, mask.additive is not None)
    return (
        tuple(req.q.shape),
        tuple(req.k.shape),
        req.q.dtype,
        req.q.device.type,
        id(req.encoding),
        structure,
    )


# ---------------------------------------------------------------------------- score mod


def _bias_mod(req: AttentionRequest) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None:
    """The bias of score ``(b, h, q_idx, kv_idx)``: ``bias_at`` of the positions, or, for an
    input-dependent bias, the encoding's ``bias_at_index`` of the token states (its ``bias_at`` is
    then only the bias at zero input, never the attention's); None for a kind without a bias."""
    if req.kind is not Kind.BIAS:
        return None
    states = req.token_states
    if states is not None:
        at_index = req.input_bias().bias_at_index
        return lambda b, h, q_idx, kv_idx: at_index(states, b, h, q_idx, kv_idx)
    batch = req.q.shape[0]
    q_pos = req.q_pos.long().expand(batch, -1).contiguous()
    k_pos = req.k_pos.long().expand(batch, -1).contiguous()
    encoding = req.encoding
    return lambda b, h, q_idx, kv_idx: encoding.bias_at(h, q_pos[b, q_idx], k_pos[b, kv_idx])


def _score_mod(req: AttentionRequest) -> Callable:
    """``cap(score) + bias(b, h, q, kv)`` (+ the float mask), for FlexAttention (``cap`` the request's
    soft-capping, or none)."""
    bias_of = _bias_mod(req)
    additive = req.mask.additive
    if additive is not None:
        additive = additive.expand(req.q.shape[0], req.num_heads, req.q_len, req.k_len)
    softcap = req.softcap

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        score = soft_cap(score, softcap)
        if bias_of is not None:
            score = score + bias_of(b, h, q_idx, kv_idx).to(score.dtype)
        if additive is not None:
            score = score + additive[b, h, q_idx, kv_idx].to(score.dtype)
        return score

    return score_mod


def flex_bias_attention(req: AttentionRequest, *, compiled: bool = True) -> Tensor:
    """Attention output ``[B, H, Tq, D]`` of a BIAS or soft-capped request through FlexAttention.

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
    out = run(
        q,
        k,
        v,
        score_mod=_score_mod(req),
        block_mask=req.mask.block_mask(),
        scale=req.scale,
        enable_gqa=req.q.shape[1] != req.k.shape[1],
    )
    return req.mask.zero_empty_rows(out)


class FlexBackend:
    name = "flex"
    kinds = frozenset({Kind.ABSOLUTE, Kind.ROTARY, Kind.BIAS})
    # what reasons and declines read (posenc.backends.memo.READS): the memo's key
    reads = frozenset(
        {"tensors", "kind", "encoding", "mask", "need_weights", "grad", "sinks", "softcap", "token_states"}
    )
    # An input-dependent bias (FoX) runs through its pointwise bias_at_index (the score_mod).
    serves_input_bias = True
    serves_softcap = True  # the score_mod caps each score

    def declines(self, request: AttentionRequest) -> list[str]:
        if request.q.device.type == "cpu":
            return [
                "on CPU each new shape costs a 10-15 s compile; blocked and sdpa serve without one (force flex to use it)"
            ]
        return []

    def reasons(self, request: AttentionRequest) -> list[str]:
        capped_plain = request.softcap is not None and request.kind in (Kind.ABSOLUTE, Kind.ROTARY)
        reasons = [] if capped_plain else kind_reasons(request, Kind.BIAS)
        if (
            request.kind is Kind.BIAS
            and request.token_states is not None
            and request.input_bias().bias_at_index is None
        ):
            reasons.append(
                f"{request.encoding.name} declares no pointwise bias_at_index in its input_bias(), "
                "which the score_mod evaluates"
            )
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
        if request.sinks is not None:
            reasons.append(
                "attention sinks are not wired into the flex backend (blocked and eager serve them)"
            )
        if request.q_len == 0 or request.k_len == 0:
            reasons.append("empty query or key sequence")
        if _shape_key(request) not in _SEEN_SHAPES and len(_SEEN_SHAPES) >= _recompile_limit():
            reasons.append(
                f"FlexAttention is already compiled for {len(_SEEN_SHAPES)} shapes (dynamo's recompile limit); "
                "a new shape would run uncompiled"
            )
        return reasons

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        return flex_bias_attention(request), None


register_backend(FlexBackend())
