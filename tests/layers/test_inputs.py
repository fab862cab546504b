"""The layer's inputs (posenc.layers.inputs)."""

from __future__ import annotations

import pytest
import torch

import posenc


@pytest.mark.parametrize("projection", ["k_proj", "v_proj", "out_proj"])
def test_one_projection_of_another_dtype_names_it(projection):
    attn = posenc.MultiheadAttention(32, 2, encoding="rope")
    getattr(attn, projection).to(torch.float64)
    with pytest.raises(
        ValueError, match=rf"{projection}\.weight is torch.float64 .* q_proj.weight is torch.float32"
    ):
        attn(torch.randn(1, 4, 32))
