"""What attention a block of queries at a time through PyTorch's CPU flash kernel cannot run, and
where ``auto`` prefers one sdpa call: the limits and costs that ``blocked`` and the splits built on
the same kernel (``near_far``, ``segments``) share. Each of those backends reads them here, so a
split declines exactly what ``blocked`` declines before adding its own costs.

To change a limit for every one of them (a test lowering :data:`MAX_DENSE_MASK_BYTES`), set it on
this module: ``posenc.backends.blocked`` re-exports the names, and a value set there is not read.
"""

from __future__ import annotations

import torch

from ...encodings.base import Kind
from ..request import AttentionRequest
from .exact import MASKED_KERNEL_COST, masked_band
from .flash import NONFINITE_REASON

__all__ = [
    "DEFAULT_BLOCK",
    "MAX_DENSE_MASK_BYTES",
    "MIN_AUTO_LOGITS",
    "query_block_declines",
    "query_block_reasons",
]

#: Queries per block: 128 rows x 4096 keys x 8 heads of float32 bias is 16 MiB.
DEFAULT_BLOCK = 128
#: Below this many logits per head ``auto`` lets sdpa take bias encodings: blocking pays off from
#: about 256x256 (benchmarks/RESULTS.md).
MIN_AUTO_LOGITS = 256 * 256
#: sdpa materialises any mask but a plain causal one as a dense ``[B|1, H|1, Tq, Tk]`` tensor; past
#: this many bytes ``auto`` prefers the blocked backend, which never builds one.
MAX_DENSE_MASK_BYTES = 256 << 20


def _dense_mask_too_big(request: AttentionRequest) -> bool:
    mask = request.mask
    if mask.is_trivial or mask.is_plain_causal:
        return False
    batch = request.q.shape[0] if mask.data_dependent else 1
    return batch * request.q_len * request.k_len * request.q.element_size() > MAX_DENSE_MASK_BYTES


def _skips_enough(request: AttentionRequest, block: int = DEFAULT_BLOCK) -> bool:
    """For kinds without a bias: whether blocks over the mask's key ranges beat one sdpa call.

    sdpa pays for every pair (half of them for a plain causal mask, the masked kernel for any other
    mask); blocked pays the masked kernel on each block's key range only.
    """
    mask = request.mask
    band = masked_band(mask, request.q_len, block)
    pairs = request.q_len * request.k_len
    sdpa = pairs * (0.5 if mask.is_plain_causal else MASKED_KERNEL_COST if mask.components else 1.0)
    return MASKED_KERNEL_COST * band < sdpa


def query_block_reasons(request: AttentionRequest) -> list[str]:
    """The limits of attention through the CPU flash kernel a block of queries at a time, with the
    bias and masks as its float mask: what this backend and the splits built on the same kernel
    cannot run (CONTENT kinds aside)."""
    reasons = []
    if request.v.shape[-1] != request.q.shape[-1]:
        reasons.append(
            f"v's head size {request.v.shape[-1]} differs from q/k's {request.q.shape[-1]}: "
            "the fused kernel takes one head size"
        )
    if request.q.device.type == "cpu" and request.has_nonfinite:
        reasons.append(NONFINITE_REASON)
    additive = request.mask.additive
    if additive is not None and additive.requires_grad and torch.is_grad_enabled():
        reasons.append(
            "a float attn_mask that requires grad is not differentiated by the blocked backend and the splits"
        )
    return reasons


def query_block_declines(request: AttentionRequest) -> list[str]:
    """Where one sdpa call is cheaper than blocks of queries (and the splits built on them)."""
    if request.q_len * request.k_len < MIN_AUTO_LOGITS:
        return [
            f"small attention (Tq*Tk = {request.q_len * request.k_len} < 256*256): the dense bias through sdpa is cheaper"
        ]
    if request.kind is not Kind.BIAS and not _skips_enough(request) and not _dense_mask_too_big(request):
        return [
            "without a bias, sdpa is cheaper unless the mask hides most keys (windows, documents, chunks)"
        ]
    return []
