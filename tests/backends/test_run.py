"""Running a request (posenc.backends.run): a traced call (torch.compile, torch.export) runs a backend that
serves it, soft-capped requests included."""

from __future__ import annotations

import torch

import posenc
from posenc.backends import AttentionRequest
from posenc.backends.run import traced_backend

HEADS, KV_HEADS, HEAD_DIM, CAP = 4, 2, 8, 0.7


def _tensors(batch, q_len, k_len, grad=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(heads: int, n: int) -> torch.Tensor:
        return (3 * torch.randn(batch, heads, n, HEAD_DIM, generator=g, dtype=dtype)).requires_grad_(grad)

    return make(HEADS, q_len), make(KV_HEADS, k_len), make(KV_HEADS, k_len)


def test_a_traced_call_runs_a_backend_that_caps():
    """Under torch.compile the layer picks among sdpa and eager by their limits: eager, not sdpa."""
    q, k, v = _tensors(1, 5, 5, grad=False, dtype=torch.float32)
    pos = torch.arange(5)[None]
    request = AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=posenc.build("nope"), q_pos=pos, k_pos=pos, scale=0.5, causal=True, softcap=CAP
    )  # fmt: skip
    assert traced_backend(request, "auto").name == "eager"
