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

Encodings with clipped relative tables (Shaw, DeBERTa) on long square self-attention have a faster
exact split, the ``clipped`` backend (:mod:`posenc.backends.clipped`), tried before this one.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..encodings.base import Kind
from . import AttentionRequest, kind_reasons, register_backend
from .parts.sinks import softmax_with_sinks
from .parts.softcap import soft_cap

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
    logits = soft_cap(
        req.encoding.logits(q_blk, k, q_pos, k_pos, scale=req.scale, layer=req.layer), req.softcap
    )
    additive = req.mask.additive_rows(i0, i1, 0, k_end)
    if additive is not None:
        logits = logits + additive.to(logits.dtype)
    allowed = req.mask.rows(i0, i1, 0, k_end)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    probs = softmax_with_sinks(logits, req.sinks)
    return req.encoding.attend(probs, v, q_pos, k_pos)


def relative_attention(
    req: AttentionRequest, block: int | None = None, use_checkpoint: bool | None = None
) -> Tensor:
    """Output ``[B, H, Tq, D]`` of a CONTENT request computed ``block`` queries at a time.

    ``block=None`` picks one block for small problems (eager's cost) and :data:`DEFAULT_BLOCK`
    otherwise; ``use_checkpoint=None`` checkpoints whenever gradients are needed and there is more
    than one block. Each block sees keys ``:hi`` of the mask's key range (causal attention skips the
    keys after the block's last query; the encodings read a cache offset from ``Tk - Tq``, which a
    key range that starts at 0 keeps right for every block).
    """
    batch, heads, q_len, _ = req.q.shape
    if block is None:
        block = max(q_len, 1) if batch * heads * q_len * req.k_len <= DENSE_LIMIT else DEFAULT_BLOCK
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    k, v = req.kv_per_query_head()
    blocks = [(i0, min(q_len, i0 + block)) for i0 in range(0, q_len, block)] or [(0, 0)]
    if use_checkpoint is None:
        use_checkpoint = req.needs_grad and len(blocks) > 1
    outputs = []
    for i0, i1 in blocks:
        _, k_end = req.mask.key_range(i0, i1)
        args = (req, req.q[:, :, i0:i1], k[:, :, :k_end], v[:, :, :k_end], i0, i1, k_end)
        if use_checkpoint:
            outputs.append(checkpoint(_block_output, *args, use_reentrant=False))
        else:
            outputs.append(_block_output(*args))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return req.mask.zero_empty_rows(out)


class RelativeBackend:
    name = "relative"
    kinds = frozenset({Kind.CONTENT})
    # what reasons and declines read (posenc.backends.memo.READS): the memo's key
    reads = frozenset({"kind"})
    serves_softcap = True  # the encoding's logits are explicit, a block at a time

    def reasons(self, request: AttentionRequest) -> list[str]:
        reasons = kind_reasons(request, Kind.CONTENT)
        return reasons

    def declines(self, request: AttentionRequest) -> list[str]:
        return []

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        return relative_attention(request), None


register_backend(RelativeBackend())
