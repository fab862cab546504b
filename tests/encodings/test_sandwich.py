"""Sandwich (Chi et al. 2023) against its formula written out here in float64 (docs/conventions.md §10.5)."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import functional as F


def paper_bias(num_heads: int, dim: int, q_positions, k_positions, base: float = 10000.0) -> torch.Tensor:
    """b_h(i, j) = (sum_{k=1}^{d'/2} cos((i - j) / base^(2k/d')) - d'/2) / (8h/H), h = 1..H, in float64."""
    out = torch.zeros(num_heads, len(q_positions), len(k_positions), dtype=torch.float64)
    for h in range(1, num_heads + 1):
        for a, i in enumerate(q_positions):
            for b, j in enumerate(k_positions):
                dot = sum(math.cos((i - j) / base ** (2 * k / dim)) for k in range(1, dim // 2 + 1))
                out[h - 1, a, b] = (dot - dim / 2) / (8 * h / num_heads)
    return out


@pytest.mark.parametrize(("num_heads", "dim", "base"), [(4, 16, 10000.0), (3, 8, 500.0), (8, 32, 10000.0)])
def test_bias_equals_the_formula(num_heads, dim, base):
    enc = posenc.build("sandwich", num_heads=num_heads, dim=dim, base=base)
    q = list(range(40, 52))
    k = list(range(0, 60, 3))
    got = enc.bias_for_positions(torch.tensor([q]), torch.tensor([k]))[0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), paper_bias(num_heads, dim, q, k, base), rtol=0, atol=2e-5)


def test_reference_numbers():
    """docs/conventions.md §10.5: H = 2, d' = 4: frequencies [0.01, 0.0001]; distance 100, head 1: (cos 1 + cos 0.01 - 2)/4."""
    enc = posenc.build("sandwich", num_heads=2, dim=4)
    torch.testing.assert_close(enc.inv_freq, torch.tensor([0.01, 0.0001]))
    torch.testing.assert_close(enc.head_factors, torch.tensor([4.0, 8.0]))
    bias = enc.bias(1, 101, q_offset=100)[:, 0]
    want = (math.cos(1.0) + math.cos(0.01) - 2) / 4
    assert want == pytest.approx(-0.114937, abs=1e-6)
    assert bias[0, 0].item() == pytest.approx(want, abs=1e-6)
    assert bias[1, 0].item() == pytest.approx(want / 2, abs=1e-6)
    assert bias[0, 100].item() == 0.0  # distance 0


def test_even_in_distance_zero_on_the_diagonal_and_never_positive():
    enc = posenc.build("sandwich", num_heads=4, dim=16)
    dense = enc.bias(50, 50)
    torch.testing.assert_close(dense, dense.transpose(1, 2))
    assert torch.all(dense.diagonal(dim1=1, dim2=2) == 0) and torch.all(dense <= 1e-6)


def test_layer_fills_dim_from_head_dim_and_spec_round_trips():
    layer = posenc.MultiheadAttention(64, 4, encoding="sandwich")
    assert layer.encoding.dim == 16 and layer.encoding.num_heads == 4
    again = posenc.build(layer.encoding.spec())
    torch.testing.assert_close(again.bias(6, 6), layer.encoding.bias(6, 6))
    wide = posenc.MultiheadAttention(64, 4, encoding="sandwich:dim=128")
    assert wide.encoding.dim == 128


def test_bad_options_name_them():
    with pytest.raises(ValueError, match="dim"):
        posenc.build("sandwich", num_heads=2, dim=7)
    with pytest.raises(ValueError, match="dim"):
        posenc.build("sandwich", num_heads=2)
    with pytest.raises(ValueError, match="base"):
        posenc.build("sandwich", num_heads=2, dim=8, base=1.0)
    with pytest.raises(ValueError, match="num_heads"):
        F.sandwich_head_factors(0)
