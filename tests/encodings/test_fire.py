"""FIRE against its formula (float64, written here) and docs/conventions.md §10."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import functional as F

# ---------------------------------------------------------------------------- FIRE


def test_fire_input_reference_numbers():
    c, threshold = torch.tensor(0.1), torch.tensor(512.0)
    got = F.fire_input(torch.tensor(10), torch.tensor(4), c, threshold)
    assert float(got) == pytest.approx(math.log(1.6) / math.log(52.2), abs=1e-6)
    assert float(got) == pytest.approx(0.118835, abs=1e-6)
    near_one = F.fire_input(torch.tensor(10), torch.tensor(0), c, torch.tensor(4.0))
    assert float(near_one) == pytest.approx(1.0, abs=1e-5)


def _fire_formula(enc, i: int, j: int, h: int) -> float:
    c = float(enc.c)
    threshold = abs(float(enc.threshold_mult) * float(enc.threshold_init))
    x = math.log(abs(c * (i - j)) + 1) / (math.log(abs(c * max(i, threshold)) + 1) + enc.eps)
    w1, b1 = enc.mlp_in.weight[:, 0].tolist(), enc.mlp_in.bias.tolist()
    hidden = [max(w * x + b, 0.0) for w, b in zip(w1, b1)]
    return sum(w * v for w, v in zip(enc.mlp_out.weight[h].tolist(), hidden)) + float(enc.mlp_out.bias[h])


def test_fire_matches_formula_and_depends_on_query_position():
    enc = posenc.build("fire", num_heads=2, threshold_init=4.0).double().requires_grad_(False)
    with torch.no_grad():
        enc.c.fill_(0.3)
        enc.threshold_mult.fill_(1.5)  # L = 6
    got = enc.bias(4, 9, q_offset=5).double()  # queries 5..8: below and above L
    for h in range(2):
        for a, i in enumerate(range(5, 9)):
            for j in range(9):
                assert float(got[h, a, j]) == pytest.approx(_fire_formula(enc, i, j, h), abs=1e-10)
    assert not torch.allclose(
        enc.bias(1, 2, q_offset=10), enc.bias(1, 2, q_offset=1000)
    )  # not shift invariant


def test_fire_threshold_and_c_are_learned():
    enc = posenc.build("fire", num_heads=2, threshold_init=64.0)
    enc.bias(5, 5, q_offset=3).square().sum().backward()
    assert enc.c.grad is not None and float(enc.c.grad) != 0.0
    assert enc.threshold_mult.grad is not None and float(enc.threshold_mult.grad) != 0.0
    assert "threshold_init" in dict(enc.named_buffers()) and not enc.threshold_init.requires_grad
