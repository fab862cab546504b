"""The GPU benchmark's error measures (posenc.benchmarks.gpu._gpu_timing): a gradient that is zero in exact
arithmetic is not divided by its rounding."""

from __future__ import annotations

import pytest
import torch

from posenc.benchmarks.gpu import _gpu_timing

pytestmark = pytest.mark.hf  # the generate section drives an HF Llama


def test_a_gradient_zero_in_exact_arithmetic_is_not_divided_by_its_rounding():
    """The key projection's bias gets no gradient under softmax (it shifts a row's logits alike):
    float64 gives ~1e-16, float32 ~1e-7; against the largest gradient that is no error."""
    ref = [torch.tensor([10.0], dtype=torch.float64), torch.tensor([1e-16], dtype=torch.float64)]
    got = [torch.tensor([10.0]), torch.tensor([2e-7])]
    assert _gpu_timing.relative_error(got[1], ref[1]) > 1e8  # what dividing by the noise gave
    assert _gpu_timing.gradients_error(got, ref) < 1e-5
