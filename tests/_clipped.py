"""The clipped split's test pieces (tests/backends/test_clipped.py,
tests/backends/parts/test_clipped_near.py): the layer size, a request, the comparison with eager (outputs
and every gradient, float64), and a split forced at every length."""

from __future__ import annotations

import torch

import posenc
from posenc.backends import AttentionRequest, clipped, get_backend

HEADS, DIM = 3, 5


def _request(enc, length, causal, dtype=torch.float64, kv_heads=None, batch=2, offset=3, **kwargs):
    q = torch.randn(batch, HEADS, length, DIM, dtype=dtype, requires_grad=True)
    kv = kv_heads or HEADS
    k, v = (torch.randn(batch, kv, length, DIM, dtype=dtype, requires_grad=True) for _ in range(2))
    pos = torch.arange(length)[None] + offset
    return AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.4, causal=causal, **kwargs
    )


def _grads(out, req, enc, seed=0):
    torch.manual_seed(seed)
    inputs = [req.q, req.k, req.v, *enc.parameters()]
    return torch.autograd.grad(out, inputs, torch.randn_like(out))


def _assert_equals_eager(out, req, enc, out_tol: dict, grad_tol: dict) -> None:
    """``out`` (the split's result for ``req``) and its gradients into q, k, v and ``enc``'s tables
    against the eager backend's."""
    ref = get_backend("eager").run(req)[0]
    torch.testing.assert_close(out, ref, **out_tol)
    for got, want in zip(_grads(out, req, enc), _grads(ref, req, enc)):
        torch.testing.assert_close(got, want, **grad_tol)


F64 = ({"rtol": 1e-10, "atol": 1e-12}, {"rtol": 1e-9, "atol": 1e-11})


def _split_at_every_length(monkeypatch, pieces: str = "whole") -> None:
    """Let ``auto`` pick the clipped split at any length; with ``pieces="tiny"``, near pieces of one block."""
    monkeypatch.setattr(clipped, "CLIPPED_MIN_LEN", 0)
    monkeypatch.setattr(clipped, "CLIPPED_MIN_BLOCKS", 0)
    if pieces == "tiny":
        monkeypatch.setattr(clipped, "NEAR_PIECE_BYTES", 1)


def _assert_layer_equals_eager(layer, x: torch.Tensor, out: torch.Tensor, inputs: list) -> None:
    """``out = layer(x)`` (taken on the split) and its gradients into ``inputs`` against the eager
    backend's, float64 tolerances."""
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    with posenc.use_backend("eager"):
        ref = layer(x)
    want = torch.autograd.grad(ref, inputs, grad, allow_unused=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)
