"""Kerple against its formula (float64, written here) and docs/conventions.md §10; the options of the three
learnable biases (Kerple, FIRE, the dynamic MLP bias)."""

from __future__ import annotations

import math

import pytest
import torch

import posenc


def _dense(enc, length: int) -> torch.Tensor:
    return enc.bias(length, length).double()


# ---------------------------------------------------------------------------- Kerple


@pytest.mark.parametrize(
    ("variant", "p", "a", "expected"),
    [
        ("log", 1.0, 1.0, [-1.609438, -1.386294, -1.098612, -0.693147, 0.0]),
        ("power", 1.0, 1.0, [-4.0, -3.0, -2.0, -1.0, 0.0]),
        ("power", 0.5, 0.5, [-1.0, -0.866025, -0.707107, -0.5, 0.0]),
    ],
)
def test_kerple_reference_rows(variant, p, a, expected):
    enc = posenc.build("kerple", num_heads=1, variant=variant)
    with torch.no_grad():
        enc.bias_p.fill_(p)
        enc.bias_a.fill_(a)
    row = enc.bias(1, 5, q_offset=4)[0, 0]
    torch.testing.assert_close(row, torch.tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_matches_formula(variant):
    enc = posenc.build("kerple", num_heads=3, variant=variant).double().requires_grad_(False)
    with torch.no_grad():
        enc.bias_p.copy_(torch.tensor([0.005, 0.7, 2.5]))  # below, inside and above the clamp range
        enc.bias_a.copy_(torch.tensor([0.3, 0.001, 1.2]))
    got = _dense(enc, 7)
    for h in range(3):
        p = min(max(float(enc.bias_p[h]), 0.01), 2.0 if variant == "power" else math.inf)
        a = max(float(enc.bias_a[h]), 0.01)
        for i in range(7):
            for j in range(7):
                dist = max(i - j, 0)
                want = -p * math.log(1 + a * dist) if variant == "log" else -a * dist**p
                assert float(got[h, i, j]) == pytest.approx(want, abs=1e-12)


def test_kerple_gradients_finite_on_the_diagonal():
    enc = posenc.build("kerple", num_heads=2, variant="power")
    enc.bias(4, 4).sum().backward()
    assert torch.isfinite(enc.bias_p.grad).all() and torch.isfinite(enc.bias_a.grad).all()
    assert (enc.bias_p.grad != 0).any()


# ---------------------------------------------------------------------------- errors and score_mod


def test_bad_options():
    with pytest.raises(ValueError, match="variant"):
        posenc.build("kerple:variant=exp", num_heads=2)
    with pytest.raises(ValueError, match="hidden_dim"):
        posenc.build("fire", num_heads=2, hidden_dim=0)
    with pytest.raises(ValueError, match="depth"):
        posenc.build("mlp_bias", num_heads=2, dim=16, depth=0)
    for name in ("kerple", "fire"):
        with pytest.raises(ValueError, match="causal"):
            posenc.MultiheadAttention(32, 2, encoding=name, causal=False)
