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
        reasons = []
        if request.kind is Kind.CONTENT:
            reasons.append(
                f"kind {request.kind.value} ({request.encoding.name}) adds q/k-dependent logit terms"
            )
        return reasons

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        q, k, v = request.q, request.k, request.v
        plain_causal = (
            request.causal
            and request.causal_offset == 0
            and request.q_len == request.k_len
            and request.key_padding_mask is None
            and request.attn_mask is None
            and request.kind is not Kind.BIAS
        )
        mask = None if plain_causal else request.additive_mask(q.dtype)
        if request.kind is Kind.BIAS:
            bias = request.encoding.bias_for_positions(request.q_pos, request.k_pos).to(q.dtype)
            mask = bias if mask is None else mask + bias
        allowed = None if plain_causal else request.allowed()
        if allowed is not None:
            empty = ~allowed.any(dim=-1, keepdim=True)  # [B or 1, 1 or H, Tq, 1]: rows that see no key
            if bool(empty.any()):
                # Eager gives such rows the uniform average of v, with no gradient into q, k or the
                # bias (their logits are constants). Zeroing their query and mask does the same here.
                q = q.masked_fill(empty, 0.0)
                mask = mask.masked_fill(empty, 0.0)
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
        return out, None


register_backend(SdpaBackend(), priority=50)
