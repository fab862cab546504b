"""PyTorch's CPU flash kernel as the backends call it (posenc.backends.parts.flash): the limit for tensors it
cannot take has one wording, required verbatim of every backend that calls the kernel."""

from __future__ import annotations

import torch

import posenc
from posenc.backends import (
    AttentionRequest,
    get_backend,
)
from posenc.backends.parts.flash import cpu_flash_limit

HEADS, DIM, T = 2, 8, 8


def test_the_cpu_flash_limit_has_one_wording():
    """Every backend that calls PyTorch's CPU flash kernel itself states the same limit for tensors
    it cannot take (here on the meta device); sdpa says what needs the kernel (its sinks)."""
    meta = torch.device("meta")
    q = torch.empty(1, HEADS, 64, DIM, device=meta)
    pos = torch.arange(64, device=meta)[None]
    limit = cpu_flash_limit(q)
    assert limit == "PyTorch's CPU flash kernel takes CPU tensors only; q is on meta"

    def request(spec, **fields):
        enc = posenc.MultiheadAttention(HEADS * DIM, HEADS, spec, causal=True).encoding
        return AttentionRequest.from_keywords(
            q=q, k=q, v=q, encoding=enc, q_pos=pos, k_pos=pos, scale=0.3, causal=True, **fields
        )

    assert get_backend("near_far").reasons(request("alibi")) == [limit]
    assert get_backend("segments").reasons(request("rope")) == [limit]
    assert get_backend("clipped").reasons(request("shaw:k=4")) == [limit]
    sinks = torch.zeros(HEADS, device=meta)
    assert f"attention sinks need the kernel's log-sum-exp: {limit}" in get_backend("sdpa").reasons(
        request("rope", sinks=sinks)
    )
    half = torch.zeros(1, dtype=torch.float8_e4m3fn)
    assert cpu_flash_limit(half) == (
        "PyTorch's CPU flash kernel takes float32, float64, bfloat16, float16, not torch.float8_e4m3fn"
    )
    assert cpu_flash_limit(torch.zeros(1)) is None
