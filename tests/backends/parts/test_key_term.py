"""The separable key term's extra head dimension (posenc.backends.parts.exact.with_key_term): the same
numbers as the plain concatenation, in rows that start on 64-byte boundaries, and the CPU flash
kernel gives the same answer on them as on dense rows."""

from __future__ import annotations

import pytest
import torch

from posenc.backends.parts.exact import ROW_ALIGN_BYTES, pad_column, with_key_term


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
