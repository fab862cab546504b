"""posenc inside HF transformers models: an attention implementation, ``attn_implementation="posenc"``.

:func:`register` adds posenc's attention to HF's ``AttentionInterface`` (and its mask builder to
``AttentionMaskInterface``) under the name ``"posenc"``. A model loaded or switched to it
(``model.set_attn_implementation("posenc")``) then runs every attention call through posenc's
backends (:mod:`posenc.backends`): the dispatcher picks the fastest one that can serve the call, and
attention sinks (gpt-oss's ``s_aux``) are served exactly.

What HF hands the attention function: ``query [B, H, Tq, D]`` and ``key``/``value [B, Hkv, Tk, D]``,
already rotated by the model's own rotary embedding (so posenc adds no position term: the request's
encoding is NoPE), and the mask HF's ``sdpa_mask`` builds from the model's own mask functions (causal,
sliding window, chunks, packed sequences, padding), a bool ``[B, 1, Tq, Tk]`` (True = attend) or None for
a plain causal mask. The rules for None follow HF's sdpa implementation: causal when ``Tq > 1`` (keys
past the first ``Tq`` are empty static-cache slots), no mask for a single query.

transformers is optional (``pip install posenc[hf]``): importing this module does not import it;
:func:`register` does, and says how to install it when it is missing.

Not served (each a ValueError naming it): logit soft-capping (Gemma 2's ``softcap``) and HF's paged
cache (continuous batching).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor, nn

from .attention import run_attention
from .backends import AttentionRequest, get_backend
from .registry import build

__all__ = ["ATTN_IMPLEMENTATION", "attention_forward", "register"]

#: The name posenc's attention is registered under in HF's ``AttentionInterface``.
ATTN_IMPLEMENTATION = "posenc"

_state = threading.local()
_nope = build("nope")
_backend = {"name": "auto"}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - transformers is installed for the tests
        raise ImportError("posenc.hf needs HF transformers: pip install 'posenc[hf]'") from err
    return transformers


def register(backend: str = "auto") -> str:
    """Register posenc's attention in HF transformers as ``attn_implementation="posenc"``.

    Args:
        backend: the posenc backend every call uses (``"auto"``: the dispatcher's choice per call).

    Returns:
        The implementation name to pass to ``from_pretrained(..., attn_implementation=...)`` or
        ``model.set_attn_implementation(...)``.
    """
    if backend != "auto":
        get_backend(backend)  # an unknown name fails here, naming the available ones
    transformers = _transformers()
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _backend["name"] = backend
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def _check_supported(kwargs: dict[str, Any]) -> None:
    if kwargs.get("softcap") is not None:
        raise ValueError(
            "posenc attention does not serve logit soft-capping (softcap, Gemma 2); use "
            "attn_implementation='eager' for this model"
        )
    if kwargs.get("cache") is not None:
        raise ValueError("posenc attention does not serve HF's paged cache (continuous batching)")


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    s_aux: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """HF's attention-function signature, served by posenc's backends.

    Shapes: ``query [B, H, Tq, D]``, ``key``/``value [B, Hkv, Tk, D]``; ``attention_mask`` bool or float
    ``[B, 1, Tq, Tk]`` or None; ``s_aux [H]`` attention sinks. Returns ``(out [B, Tq, H, D], weights)``
    with weights ``[B, H, Tq, Tk]`` only when HF asks for them (``output_attentions``).
    """
    _check_supported(kwargs)
    q_len = query.shape[2]
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    causal = causal and attention_mask is None and q_len > 1
    if causal and key.shape[2] > q_len:  # empty static-cache slots after the prompt (HF's sdpa rule)
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    request = AttentionRequest(
        q=query,
        k=key,
        v=value,
        encoding=_nope,
        q_pos=torch.arange(q_len, device=query.device)[None],
        k_pos=torch.arange(key.shape[2], device=query.device)[None],
        scale=scale,
        causal=causal,
        attn_mask=attention_mask,
        dropout_p=float(dropout),
        need_weights=bool(kwargs.get("output_attentions", False)),
        sinks=s_aux,
    )
    name, out, weights = run_attention(request, _backend["name"])
    _state.last_backend = name
    return out.transpose(1, 2).contiguous(), weights


def last_backend() -> str | None:
    """The posenc backend that served the last HF attention call in this thread (None before any)."""
    return getattr(_state, "last_backend", None)
