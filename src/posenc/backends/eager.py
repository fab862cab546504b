"""The eager reference backend: explicit logits, every kind, attention weights on request.

It materialises the ``[B, H, Tq, Tk]`` logits (and, for BIAS kinds, the dense bias), so it is the
slowest and most memory-hungry backend, and the one every other backend is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..encodings.base import Kind
from . import AttentionRequest, register_backend
from .parts.sinks import softmax_with_sinks
from .parts.softcap import soft_cap


def attention_logits(req: AttentionRequest) -> Tensor:
    """Scaled, masked logits ``[B, H, Tq, Tk]`` in the query dtype (hidden entries are ``finfo.min``):
    the q/k logits, soft-capped when the request says so (:mod:`~posenc.backends.parts.softcap`), then the
    bias, the float mask and the hidden keys."""
    q = req.q
    k, _ = req.kv_per_query_head()
    if req.kind is Kind.CONTENT:
        # an input-dependent transform (PaTH) reads the tokens' states
        extra = {} if req.token_states is None else {"token_states": req.token_states}
        logits = req.encoding.logits(q, k, req.q_pos, req.k_pos, scale=req.scale, layer=req.layer, **extra)
    else:
        logits = (q @ k.transpose(-1, -2)) * req.scale
    logits = soft_cap(logits, req.softcap)
    if req.kind is Kind.BIAS:
        logits = logits + req.dense_bias().to(logits.dtype)
    additive = req.mask.additive
    if additive is not None:
        logits = logits + additive.to(logits.dtype)
    allowed = req.mask.dense()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    return logits


def attention_probs(req: AttentionRequest) -> Tensor:
    """The attention weights ``[B, H, Tq, Tk]`` (no dropout); rows that see no key are zero.

    With sinks, each row's denominator also holds ``exp(sink_h)`` (the weights sum to less than 1).
    """
    return req.mask.zero_empty_rows(softmax_with_sinks(attention_logits(req), req.sinks))


class EagerBackend:
    name = "eager"
    serves_dropout = True
    kinds = frozenset(Kind)
    # what reasons and declines read (posenc.backends.memo.READS): the memo's key
    reads: frozenset[str] = frozenset()
    serves_input_bias = True
    serves_softcap = True

    def reasons(self, request: AttentionRequest) -> list[str]:
        return []

    def declines(self, request: AttentionRequest) -> list[str]:
        return []

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        probs = attention_probs(request)
        dropped = F.dropout(probs, request.dropout_p, training=request.dropout_p > 0)
        _, v = request.kv_per_query_head()
        if request.kind is Kind.CONTENT:
            out = request.encoding.attend(dropped, v, request.q_pos, request.k_pos)
        else:
            out = dropped @ v
        return out, probs if request.need_weights else None


register_backend(EagerBackend())
