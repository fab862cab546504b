"""The near/far split (the near_far backend) against the eager reference in float64 (dense logits, softmax):
every registered BIAS encoding that declares a far constant or separable terms, found from the registry,
so a new declaration is tested here without a new test."""

from __future__ import annotations

import pytest
import torch

import posenc
from _near_far import DECLARING, DIM, HEADS, _encoding
from posenc.backends import AttentionRequest, get_backend, near_far
from posenc.backends.near_far import near_far_attention, near_far_plan
from posenc.encodings.base import BiasEncoding, NearFar, SeparableBias
from posenc.examples import build_example


def _request(enc, length, causal, dtype, *, batch=2, sinks=False, grad=True):
    def tensor(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=grad)

    q, k, v = (tensor(batch, HEADS, length, DIM) for _ in range(3))
    pos = torch.arange(length)[None]
    return AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.4, causal=causal,
        sinks=tensor(HEADS) if sinks else None,
    )  # fmt: skip


def _out_and_grads(run, req, params):
    out = run(req)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad((out * weight).sum(), params, allow_unused=True)
    return out, [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("name", DECLARING)
def test_near_far_matches_eager(name, causal, sinks, dtype):
    enc = _encoding(name, causal, dtype)
    probe = _request(enc, 600, causal, dtype, grad=False)
    plan, why = near_far_plan(probe, block=16)
    assert plan is not None, why
    length = 2 * plan.block + 37  # odd: a partial last block, and edge blocks at both ends
    req = _request(enc, length, causal, dtype, sinks=sinks)
    params = [req.q, req.k, req.v, *enc.parameters()] + ([req.sinks] if sinks else [])
    out, grads = _out_and_grads(lambda r: near_far_attention(r, block=16), req, params)
    ref, want = _out_and_grads(lambda r: get_backend("eager").run(r)[0], req, params)
    tol = {"rtol": 1e-7, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 2e-5}
    torch.testing.assert_close(out, ref, **tol)
    for index, (g, w) in enumerate(zip(grads, want)):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, i=index: f"gradient {i}: {m}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name", DECLARING)
def test_near_far_backward_in_pieces_matches_eager(name, causal, monkeypatch):
    """The backward runs the near band's blocks in pieces of at most MAX_CALL_BYTES of logits (here one
    block per piece): the gradients stay eager's."""
    monkeypatch.setattr(near_far, "MAX_CALL_BYTES", 1)
    counts = []
    real = near_far._NearCall.pieces
    monkeypatch.setattr(near_far._NearCall, "pieces", lambda c, *a: counts.append(c.count) or real(c, *a))
    enc = _encoding(name, causal, torch.float64)
    plan, why = near_far_plan(_request(enc, 600, causal, torch.float64, grad=False), block=16)
    assert plan is not None, why
    req = _request(enc, 6 * plan.block + 5, causal, torch.float64)
    params = [req.q, req.k, req.v, *enc.parameters()]
    out, grads = _out_and_grads(lambda r: near_far_attention(r, block=16), req, params)
    ref, want = _out_and_grads(lambda r: get_backend("eager").run(r)[0], req, params)
    assert max(counts) > 1  # an inner call of several blocks was cut
    tol = {"rtol": 1e-7, "atol": 1e-9}
    torch.testing.assert_close(out, ref, **tol)
    for index, (g, w) in enumerate(zip(grads, want)):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, i=index: f"gradient {i}: {m}")


def test_t5_table_gradient_reaches_the_far_bucket():
    """The far part's constant is the last bucket: its gradient must come from the far rows."""
    enc = _encoding("t5", True, torch.float64, num_buckets=8, max_distance=16)
    req = _request(enc, 200, True, torch.float64)
    (out_grad,) = _out_and_grads(lambda r: near_far_attention(r, block=16), req, [enc.table.weight])[1]
    (ref_grad,) = _out_and_grads(lambda r: get_backend("eager").run(r)[0], req, [enc.table.weight])[1]
    last = enc.buckets(torch.tensor([-1000]))
    assert bool(ref_grad[last].abs().gt(0).all())
    torch.testing.assert_close(out_grad, ref_grad, rtol=1e-7, atol=1e-10)


def test_alibi_float32_keeps_its_precision_at_length():
    """The far part's key term is centred once for the sequence and the near band's per block; at
    L=2048 float32 stays within float32 rounding of the float64 reference."""
    enc = posenc.build("alibi", num_heads=HEADS)
    req64 = _request(enc, 2048, True, torch.float64, batch=1, grad=False)
    req32 = AttentionRequest.from_keywords(
        q=req64.q.float(), k=req64.k.float(), v=req64.v.float(), encoding=enc,
        q_pos=req64.q_pos, k_pos=req64.k_pos, scale=req64.scale, causal=True,
    )  # fmt: skip
    ref = get_backend("eager").run(req64)[0]
    torch.testing.assert_close(near_far_attention(req32).double(), ref, rtol=1e-4, atol=1e-5)


def test_near_far_states_why_it_does_not_fit():
    enc = posenc.build("alibi", num_heads=HEADS, mode="symmetric")
    req = _request(enc, 600, True, torch.float32, grad=False)
    assert near_far_plan(req)[0] is not None
    padded = AttentionRequest.from_keywords(
        q=req.q, k=req.k, v=req.v, encoding=enc, q_pos=req.q_pos, k_pos=req.k_pos, scale=0.4, causal=True,
        key_padding_mask=torch.zeros(2, 600, dtype=torch.bool),
    )  # fmt: skip
    assert "plain causal mask or none" in near_far_plan(padded)[1]
    kerple = _request(
        build_example("kerple", num_heads=HEADS, head_dim=DIM), 600, True, torch.float32, grad=False
    )
    assert "declares neither" in near_far_plan(kerple)[1]
    short = _request(enc, 100, True, torch.float32, grad=False)
    assert "too short" in near_far_plan(short)[1]
    assert "below" in " ".join(
        get_backend("near_far").declines(req)
    )  # 600 queries: the blocked path is as fast


def test_blocked_takes_the_split_at_length_and_matches_eager():
    layer = posenc.MultiheadAttention(HEADS * DIM, HEADS, encoding="t5", causal=True).double()
    x = torch.randn(1, 1100, HEADS * DIM, dtype=torch.float64)
    out = layer(x)
    assert layer.last_backend == "near_far"
    with posenc.use_backend("eager"):
        torch.testing.assert_close(out, layer(x), rtol=1e-8, atol=1e-10)


class _ForgetGates(BiasEncoding):
    """A FoX-style input-free stand-in: ``b_ij = c_i - c_j`` with ``c = cumsum(logsigmoid(gates))`` per
    head, learnable, not shift invariant, separable on the causal side (the declaration FoX will use)."""

    causal_only = True

    def __init__(self, num_heads: int = HEADS, max_len: int = 400) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.gates = torch.nn.Parameter(torch.randn(num_heads, max_len) + 2.0)

    def _c(self) -> torch.Tensor:
        return torch.cumsum(torch.nn.functional.logsigmoid(self.gates), dim=-1)

    def bias_at(self, head, q_pos, k_pos):
        c = self._c()
        return c[head, q_pos] - c[head, k_pos]

    def near_far(self):
        return NearFar(separable=self._separable)

    def _separable(self, q_pos, k_pos):
        c = self._c()
        return (SeparableBias("before", c[:, q_pos[0]][None], -c[:, k_pos[0]][None]),)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_near_far_differentiates_input_dependent_separable_terms(sinks, dtype):
    """Row and key terms that require grad (FoX's form): exact outputs and gradients, the key term's
    gradient from k''s extra head dimension, the row term's from the sinks' share."""
    enc = _ForgetGates().to(dtype)
    length = 2 * 16 + 37
    req = _request(enc, length, True, dtype, sinks=sinks)
    plan, why = near_far_plan(req, block=16)
    assert plan is not None and plan.near_separable, why
    params = [req.q, req.k, req.v, enc.gates] + ([req.sinks] if sinks else [])
    out, grads = _out_and_grads(lambda r: near_far_attention(r, block=16), req, params)
    ref, want = _out_and_grads(lambda r: get_backend("eager").run(r)[0], req, params)
    tol = {"rtol": 1e-7, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 2e-5}
    torch.testing.assert_close(out, ref, **tol)
    for index, (g, w) in enumerate(zip(grads, want)):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, i=index: f"gradient {i}: {m}")


def test_separable_without_a_causal_mask_needs_shift_invariance():
    enc = _ForgetGates()
    req = _request(enc, 300, False, torch.float32, grad=False)
    assert "not shift invariant" in near_far_plan(req, block=16)[1]


@pytest.mark.parametrize("name", ["alibi", "t5"])
def test_near_far_bfloat16_close_to_float32(name):
    enc = _encoding(name, True, torch.float32)
    req = _request(enc, 300, True, torch.float32, batch=1)
    half = AttentionRequest.from_keywords(
        q=req.q.bfloat16(), k=req.k.bfloat16(), v=req.v.bfloat16(), encoding=enc,
        q_pos=req.q_pos, k_pos=req.k_pos, scale=req.scale, causal=True,
    )  # fmt: skip
    out = near_far_attention(half, block=16)
    assert out.dtype == torch.bfloat16
    reference = near_far_attention(req, block=16)
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)
    (grad_half,) = torch.autograd.grad(out.float().sum(), req.q)  # through the bfloat16 backward
    (grad_full,) = torch.autograd.grad(reference.sum(), req.q)
    torch.testing.assert_close(grad_half, grad_full, rtol=0.1, atol=0.1)
