"""``torch.nn.functional.scaled_dot_product_attention`` backend.

Serves ABSOLUTE and ROTARY encodings (and NoPE), whose logits are plain ``q·k``, and BIAS
encodings by passing the dense bias as a float mask (correct everywhere; on CPU under autograd
PyTorch then uses its math kernel, so the blocked and flex backends come first for BIAS kinds).
A pure causal mask with ``Tq == Tk`` and no cache offset is passed as ``is_causal`` (no mask tensor).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ..base import Kind
from . import AttentionRequest, register_backend


class SdpaBackend:
    name = "sdpa"

    def reasons(self, request: AttentionRequest) -> list[str]:
        if request.kind is Kind.CONTENT:
            return [f"kind {request.kind.value} ({request.encoding.name}) adds q/k-dependent logit terms"]
        return []

    def declines(self, request: AttentionRequest) -> list[str]:
        return []

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        q, k, v = request.q, request.k, request.v
        plain_causal = request.mask.is_plain_causal and request.kind is not Kind.BIAS
        mask = None if plain_causal else request.mask.dense_additive(q.dtype)
        if request.kind is Kind.BIAS:
            bias = request.encoding.bias_for_positions(request.q_pos, request.k_pos).to(q.dtype)
            mask = bias if mask is None else mask + bias
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=request.dropout_p,
            is_causal=plain_causal,
            scale=request.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return request.mask.zero_empty_rows(out), None


register_backend(SdpaBackend())
