"""``relative`` backend: CONTENT encodings (Shaw, DeBERTa, ...) a block of queries at a time.

CONTENT encodings compute their own logits (``encoding.logits``) and value term
(``encoding.attend``) from explicit positions; their fast forms already avoid any ``(L, L, d)``
tensor (Shaw: ``q @ tableᵀ`` on the ``2k+1`` rows, then gathered). What remains is the dense
``[B, H, Tq, Tk]`` logits/probabilities, which is what limits the sequence length (8 heads at
L = 16384 is 8.6 GB per float32 copy). This backend calls the encoding on query blocks and, under
autograd, wraps each block in activation checkpointing, so the largest live tensor is
``[B, H, block, Tk]``; the backward pass recomputes one block at a time. Causal attention gives
each block only the keys up to its last query.

When the whole problem is small (dense logits below :data:`DENSE_LIMIT` elements) it runs as one
block without checkpointing: exactly the eager computation, at eager's speed.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..base import Kind
from . import AttentionRequest, kind_reasons, register_backend
from .eager import repeat_kv

__all__ = ["DEFAULT_BLOCK", "DENSE_LIMIT", "RelativeBackend", "relative_attention"]

#: Dense logits up to this many elements (64 MiB of float32) run as a single block.
DENSE_LIMIT = 1 << 24
DEFAULT_BLOCK = 256


def _block_output(
    req: AttentionRequest, q_blk: Tensor, k: Tensor, v: Tensor, i0: int, i1: int, k_end: int
) -> Tensor:
    """Attention output of query rows ``i0:i1`` against keys ``:k_end``, as the eager backend does."""
    q_pos = req.q_pos[:, i0:i1]
    k_pos = req.k_pos[:, :k_end]
    logits = req.encoding.logits(q_blk, k, q_pos, k_pos, scale=req.scale, layer=req.layer)
    extra = req.float_mask()
    if extra is not None:
        logits = logits + extra[..., i0:i1, :k_end].to(logits.dtype)
    disallowed = _disallowed(req, i0, i1, k_end, q_blk.device)
    if disallowed is not None:
        logits = logits.masked_fill(disallowed, torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
    return req.encoding.attend(probs, v, q_pos, k_pos)


def _disallowed(req: AttentionRequest, i0: int, i1: int, k_end: int, device) -> Tensor | None:
    masked = None
    if req.causal:
        rows = torch.arange(i0, i1, device=device)[:, None] + req.causal_offset
        future = torch.arange(k_end, device=device)[None, :] > rows
        if bool(future.any()):
            masked = future[None, None]
    if req.key_padding_mask is not None:
        pad = req.key_padding_mask[:, None, None, :k_end]
        masked = pad if masked is None else masked | pad
    if req.attn_mask is not None and req.attn_mask.dtype == torch.bool:
        block = ~req.attn_mask[..., i0:i1, :k_end]
        masked = block if masked is None else masked | block
    return masked


def _skips_future(req: AttentionRequest) -> bool:
    """Causal blocks may drop later keys unless some row sees no key (eager then averages all)."""
    from .blocked import _has_fully_masked_row

    return req.causal and not _has_fully_masked_row(req)


def relative_attention(
    req: AttentionRequest, block: int | None = None, use_checkpoint: bool | None = None
) -> Tensor:
    """Output ``[B, H, Tq, D]`` of a CONTENT request computed ``block`` queries at a time.

    ``block=None`` picks one block for small problems (eager's cost) and :data:`DEFAULT_BLOCK`
    otherwise; ``use_checkpoint=None`` checkpoints whenever gradients are needed and there is more
    than one block.
    """
    batch, heads, q_len, _ = req.q.shape
    k_len = req.k_len
    if block is None:
        block = q_len if batch * heads * q_len * k_len <= DENSE_LIMIT else DEFAULT_BLOCK
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    k = repeat_kv(req.k, heads)
    v = repeat_kv(req.v, heads)
    skip = _skips_future(req)
    if req.causal and not skip:
        # Some row sees no key, so every block would need every key; encodings may also read the
        # cache offset from Tk - Tq (CoPE). Keep the exact single-block computation.
        block = max(block, q_len)
    blocks = [(i0, min(q_len, i0 + block)) for i0 in range(0, q_len, block)] or [(0, 0)]
    if use_checkpoint is None:
        use_checkpoint = req.needs_grad and len(blocks) > 1
    outputs = []
    for i0, i1 in blocks:
        k_end = min(k_len, i1 + req.causal_offset) if skip else k_len
        args = (req, req.q[:, :, i0:i1], k[:, :, :k_end], v[:, :, :k_end], i0, i1, k_end)
        if use_checkpoint:
            outputs.append(checkpoint(_block_output, *args, use_reentrant=False))
        else:
            outputs.append(_block_output(*args))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


class RelativeBackend:
    name = "relative"

    def reasons(self, request: AttentionRequest) -> list[str]:
        reasons = kind_reasons(request, Kind.CONTENT)
        if request.dropout_p > 0:
            reasons.append("attention dropout is not implemented in the relative backend")
        if not getattr(request.encoding, "blockwise_queries", True):
            reasons.append(f"{request.encoding.name} does not support query blocks (blockwise_queries=False)")
        return reasons

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        return relative_attention(request), None


register_backend(RelativeBackend(), priority=40)
