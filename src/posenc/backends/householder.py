"""``householder`` backend: PaTH's chunkwise attention, memory linear in the length (plain PyTorch).

PaTH (:mod:`posenc.encodings.path`) transforms each key by the product of the Householder-like
transforms of the tokens between it and the query. The eager backend materialises that as dense
logits after carrying the keys one query token at a time; this backend runs
:func:`~posenc.encodings.path.path_attention_blocked`: the UT transform within chunks of
:data:`CHUNK` tokens, queries carried back chunk by chunk, an online softmax over key chunks, so
no ``[Tq, Tk]`` tensor exists (``O(Tq·(C + D))`` memory in inference; under autograd the queries
run in checkpointed groups, so training memory stays linear too). It equals eager to float
rounding (tests/encodings/test_path.py checks float64).

It serves PaTH (an encoding whose :class:`~posenc.encodings.base.InputTransform` it knows) under a causal
mask whose offset is the cache length, with nothing else: padding, windows, documents, a float
mask, sinks and dropout go to eager, which reads every mask.
"""

from __future__ import annotations

from torch import Tensor

from ..encodings.base import Kind
from . import AttentionRequest, register_backend

__all__ = ["CHUNK", "HouseholderBackend"]

#: Tokens per chunk of the UT transform (fla uses 32 or 64 by GPU).
CHUNK = 64


class HouseholderBackend:
    name = "householder"
    kinds = frozenset({Kind.CONTENT})
    # what reasons and declines read (posenc.backends.memo.READS): the memo's key
    reads = frozenset({"tensors", "kind", "encoding", "mask", "need_weights", "sinks"})
    serves_input_bias = True

    def reasons(self, request: AttentionRequest) -> list[str]:
        from ..encodings.path import PaTH

        if request.kind is not Kind.CONTENT or not isinstance(request.encoding, PaTH):
            return [f"serves PaTH only; {request.encoding.name} is {request.kind.value}"]
        reasons = []
        mask = request.mask
        causal = mask.causal_offset == request.k_len - request.q_len and len(mask.components) == 1
        one_query = request.q_len == 1 and not mask.components  # a decode step sees every key
        if not (causal or one_query) or mask.additive is not None:
            reasons.append(
                f"runs the causal mask only (offset = cache length), got {mask.describe()}; eager reads every mask"
            )
        if request.sinks is not None:
            reasons.append("attention sinks are not implemented in the householder backend")
        if request.k.shape[1] != request.encoding.num_kv_heads:
            reasons.append(
                f"path was built with num_kv_heads={request.encoding.num_kv_heads} but k has "
                f"{request.k.shape[1]} heads"
            )
        return reasons

    def declines(self, request: AttentionRequest) -> list[str]:
        return []

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        from ..encodings.path import path_attention_blocked

        enc = request.encoding
        w, beta = enc.householders(request.token_states, request.k.shape[1])  # type: ignore[attr-defined]
        out = path_attention_blocked(request.q, request.k, request.v, w, beta, request.scale, CHUNK)
        return out, None


register_backend(HouseholderBackend())
