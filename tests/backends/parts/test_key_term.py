"""The separable key term in the far part (posenc.backends.parts.exact): the widened operands of
with_key_term equal the plain concatenation, in rows that start on 64-byte boundaries, and the CPU flash
kernel reads them as dense ones; far_forward and far_backward equal the written-out formula with the key
term as a broadcast mask or as the extra head dimension, and ALiBi's far calls keep the head dim."""

from __future__ import annotations

import pytest
import torch

from _near_far import DIM, _encoding
from posenc.backends import AttentionRequest, get_backend
from posenc.backends.near_far import near_far_attention
from posenc.backends.parts import exact
from posenc.backends.parts.exact import ROW_ALIGN_BYTES, far_backward, far_forward, pad_column, with_key_term


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("batch_of_term", [1, 2])
def test_the_widened_operands_are_the_concatenation_in_aligned_rows(dtype, batch_of_term):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 64).to(dtype) for _ in range(3))
    term = torch.randn(batch_of_term, 3, 37).to(dtype)
    q_w, k_w, v_w = with_key_term(q, k, v, term, q_scale=0.5)
    ones = torch.ones(2, 3, 37, 1, dtype=dtype)
    assert torch.equal(q_w, torch.cat((q * 0.5, ones), -1))
    assert torch.equal(k_w, torch.cat((k, term[..., None].expand(2, 3, 37, 1)), -1))
    assert torch.equal(v_w, torch.cat((v, torch.zeros_like(ones)), -1))
    for x in (q_w, k_w, v_w, pad_column(q)):
        assert x.shape[-1] == 65 and x.stride(-1) == 1
        assert (x.stride(-2) * x.element_size()) % ROW_ALIGN_BYTES == 0
        assert x.data_ptr() % x.element_size() == 0
    assert torch.equal(pad_column(q), torch.cat((q, torch.zeros_like(ones)), -1))


def test_the_flash_kernel_reads_aligned_rows_as_dense_ones():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 203, 64, dtype=torch.float64) for _ in range(3))
    term = torch.randn(1, 2, 203, dtype=torch.float64)
    aligned = with_key_term(q, k, v, term)
    dense = [x.contiguous() for x in aligned]
    assert dense[0].stride(-2) == 65 and aligned[0].stride(-2) != 65
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out_a, lse_a = flash(*aligned, 0.0, True, scale=0.3)
    out_d, lse_d = flash(*dense, 0.0, True, scale=0.3)
    torch.testing.assert_close(out_a, out_d, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_a, lse_d, rtol=0, atol=1e-12)


def _far_reference(q, k, v, term, scale):
    logits = scale * q @ k.transpose(-1, -2) + term[:, :, None, :]
    n = q.shape[2]
    logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(logits, -1) @ v, torch.logsumexp(logits, -1)


@pytest.mark.parametrize("term_batch", [1, 2])
@pytest.mark.parametrize("key_grad", [False, True], ids=["mask", "column"])
def test_the_far_part_with_a_key_term_is_the_formula(key_grad, term_batch):
    """far_forward and far_backward against softmax(scale·q·kᵀ + term_j) under a causal mask, written
    out here, and autograd through it: both ways of handing the kernel the key term (a broadcast mask;
    the extra head dimension whose dk column is the term's gradient)."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 3, 113, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    term = torch.randn(term_batch, 3, 113, dtype=torch.float64, requires_grad=True)
    ref, ref_lse = _far_reference(q, k, v, term, 0.3)
    grad = torch.randn_like(ref)
    want = torch.autograd.grad((ref * grad).sum(), (q, k, v, term))
    out, lse = far_forward(q.detach(), k.detach(), v.detach(), 0.3, term.detach())
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    d_q, d_k, d_v, d_term = far_backward(
        grad, out, lse, q.detach(), k.detach(), v.detach(), 0.3, term.detach(), key_grad=key_grad
    )
    for got, expected in zip((d_q, d_k, d_v), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    if key_grad:
        torch.testing.assert_close(d_term.sum(0, keepdim=True) if term_batch == 1 else d_term, want[3])
    else:
        assert d_term is None


def test_alibi_far_calls_keep_sdpa_head_dim(monkeypatch):
    """ALiBi's far part (frozen slopes: no key-term gradient) hands the CPU flash kernel q, k, v at the
    layer's head dim, forward and backward, with the key term as a mask: no D + 1 GEMM edge."""
    calls = []
    for name in ("flash_forward", "flash_backward"):
        real = getattr(exact, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            q = args[0] if _name == "flash_forward" else args[1]
            calls.append((_name, q.shape[-1], kwargs.get("attn_mask") is not None))
            return _real(*args, **kwargs)

        monkeypatch.setattr(exact, name, spy)
    enc = _encoding("alibi", True, torch.float32)
    q, k, v = (torch.randn(1, 2, 69, DIM, requires_grad=True) for _ in range(3))
    pos = torch.arange(69)[None]
    req = AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.4, causal=True
    )
    near_far_attention(req, block=16).sum().backward()
    assert sorted(calls) == [("flash_backward", DIM, True), ("flash_forward", DIM, True)]


def test_a_bfloat16_call_keeps_the_key_term_at_float32_precision():
    """In a bfloat16 call the far part's key term (ALiBi's slope times the distance to the middle key,
    up to hundreds of logits) stays float32 in its mask: rounding it to bfloat16 (8 bits) moved far
    logits by up to a unit and the output by 0.05-0.06 at L=1500. The reference is eager in float64
    on the same bfloat16 inputs; what is left is the kernel's bfloat16 arithmetic, about 0.01."""
    torch.manual_seed(0)
    length = 1500
    q, k, v = (torch.randn(1, 2, length, DIM).to(torch.bfloat16) for _ in range(3))
    pos = torch.arange(length)[None]

    def request(dtype):
        enc = _encoding("alibi", True, torch.float32 if dtype == torch.bfloat16 else dtype)
        return AttentionRequest.from_keywords(
            q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), encoding=enc, q_pos=pos, k_pos=pos, scale=0.4,
            causal=True,
        )  # fmt: skip

    ref = get_backend("eager").run(request(torch.float64))[0]
    out = near_far_attention(request(torch.bfloat16), block=16)
    assert (out.double() - ref).abs().max().item() < 0.03
