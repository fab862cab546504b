"""Multiplicative GRAPE against the authors' code and the paper's closed form, in float64
(docs/conventions.md §7.15).

model-architectures/GRAPE ``model/llama-mha-grape-m-nonctx.py``: ``MSGRAPECommuting`` keeps
``log_freq`` (initialised ``c · log θ_j``, ``θ_j = base^(−2j/D)``), ``freq = exp(log_freq / c)``,
``angles = t · freq`` and ``apply_rotary_emb``: ``y1 = x1 cos + x2 sin``, ``y2 = −x1 sin + x2 cos``
on the halves of ``x (B, T, H, D)``. The paper: ``G(n) = exp(n ω L)``, ``L = a bᵀ − b aᵀ``,
``exp(θL) = I + sin(θs)/s · L + (1 − cos(θs))/s² · L²``.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import functional as F


def _authors_rotate(x_bthd, log_freq, scale, positions):
    """``MSGRAPECommuting.forward`` with explicit positions: ``x (B, T, H, D)``, ``log_freq [D/2]`` or ``[H, D/2]``."""
    freq = torch.exp(log_freq / scale)
    if freq.dim() == 1:
        freq = freq.unsqueeze(0).expand(x_bthd.shape[2], -1)
    angles = positions[:, :, None, None] * freq[None, None]  # (B, T, H, D/2)
    cos, sin = angles.cos(), angles.sin()
    d_half = x_bthd.shape[-1] // 2
    x1, x2 = x_bthd[..., :d_half], x_bthd[..., d_half:]
    return torch.cat([x1 * cos + x2 * sin, (-x1) * sin + x2 * cos], dim=-1)


@pytest.mark.parametrize("share", [True, False])
def test_matches_the_authors_code(share):
    torch.manual_seed(0)
    enc = posenc.build("grape", num_heads=3, head_dim=16, share_across_heads=share)
    with torch.no_grad():
        enc.log_freq.add_(torch.randn_like(enc.log_freq))  # trained away from the initial spectrum
    q = torch.randn(2, 3, 5, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 100, 101, 2047, 3000]])
    got, _ = enc.rotate(q, q, pos, pos)
    log_freq = enc.log_freq.detach().double()
    log_freq = log_freq[0] if share else log_freq
    want = _authors_rotate(q.double().transpose(1, 2), log_freq, 16.0, pos.double()).transpose(1, 2)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-4)  # angles up to 3000 rad in float32
    enc64 = enc.double()
    got64, _ = enc64.rotate(q.double(), q.double(), pos, pos)
    torch.testing.assert_close(got64, want, rtol=0, atol=1e-10)


def test_initial_spectrum_is_ropes():
    enc = posenc.build("grape", num_heads=2, head_dim=16)
    theta = [10000.0 ** (-2 * j / 16) for j in range(8)]
    assert enc.freq[0].tolist() == pytest.approx(theta, rel=1e-6)
    assert enc.log_freq.detach()[0].tolist() == pytest.approx([16 * math.log(t) for t in theta], rel=1e-6)
    assert enc.log_freq.shape == (1, 8)
    assert posenc.build("grape", num_heads=2, head_dim=16, share_across_heads=False).log_freq.shape == (2, 8)


def test_closed_form_equals_the_matrix_exponential():
    torch.manual_seed(1)
    a, b = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    theta = torch.tensor([0.3, -2.0, 7.5, 40.0], dtype=torch.float64)
    L = a[:, :, None] * b[:, None, :] - b[:, :, None] * a[:, None, :]
    want = torch.linalg.matrix_exp(theta[:, None, None] * L)
    torch.testing.assert_close(F.grape_rank2_exp(a, b, theta), want, rtol=0, atol=1e-10)
    eye = torch.eye(6, dtype=torch.float64)
    torch.testing.assert_close(
        F.grape_rank2_exp(a[0], 2 * a[0], 3.0), eye, rtol=0, atol=1e-12
    )  # parallel: s = 0


def _matrix(enc, position):
    d = enc.head_dim
    basis = torch.eye(d, dtype=torch.float64)[None, None].expand(1, enc.num_heads, d, d)
    pos = torch.full((1, d), position, dtype=torch.float64)
    rotated, _ = enc.rotate(basis, basis, pos, pos)
    return rotated[0, 0].T


def test_encoding_is_the_product_of_rank2_exponentials_on_canonical_planes():
    """G(n) = Π_j exp(n ω_j L_j), L_j = e_j e_{j+D/2}ᵀ − e_{j+D/2} e_jᵀ, = matrix_exp(n Σ ω_j L_j)."""
    torch.manual_seed(2)
    enc = posenc.build("grape", num_heads=1, head_dim=8).double()
    with torch.no_grad():
        enc.log_freq.add_(torch.randn_like(enc.log_freq) * 4)
    n = 5.5
    eye = torch.eye(8, dtype=torch.float64)
    product, generator = eye.clone(), torch.zeros(8, 8, dtype=torch.float64)
    for j, w in enumerate(enc.freq.detach()[0]):
        a, b = eye[j], eye[j + 4]
        product = product @ F.grape_rank2_exp(a, b, n * w)
        generator += w * (a[:, None] * b[None] - b[:, None] * a[None])
    torch.testing.assert_close(_matrix(enc, n), product, rtol=0, atol=1e-12)
    torch.testing.assert_close(_matrix(enc, n), torch.linalg.matrix_exp(n * generator), rtol=0, atol=1e-10)


def test_relative_property_holds():
    torch.manual_seed(3)
    enc = posenc.build("grape", num_heads=1, head_dim=8).double()
    with torch.no_grad():
        enc.log_freq.add_(torch.randn_like(enc.log_freq) * 4)
    m, n = 3.25, 11.0
    torch.testing.assert_close(_matrix(enc, m).T @ _matrix(enc, n), _matrix(enc, n - m), rtol=0, atol=1e-10)


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="a and b"):
        F.grape_rank2_exp(torch.zeros(4), torch.zeros(5), 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        posenc.build("grape", num_heads=2, head_dim=7)
    with pytest.raises(ValueError, match="log_freq_scale"):
        posenc.build("grape", num_heads=2, head_dim=8, log_freq_scale=0)


def test_layer_dispatches_to_sdpa():
    layer = posenc.MultiheadAttention(64, 4, "grape", causal=True)
    layer(torch.randn(1, 6, 64)).sum().backward()
    assert layer.last_backend == "sdpa"
    assert layer.encoding.log_freq.grad.abs().sum() > 0
