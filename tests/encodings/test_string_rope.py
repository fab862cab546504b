"""Cayley-STRING against the paper's formula written out here in float64 (docs/conventions.md §7.14).

Schenck et al. 2025: ``R(x) = Pᵀ RoPE(x) P`` with ``P = (I − S)(I + S)⁻¹`` for a learned skew ``S``;
``RoPE(x)`` turns pair ``k`` by ``Σ_i x_i ω_ik``. The reference builds each matrix densely
(an explicit inverse, explicit 2 x 2 rotations) and multiplies ``R @ q``.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc import functional as F


def _rope_matrix(angles, pairing):
    """Dense block rotation ``[D, D]`` for pair angles ``[D/2]`` (float64)."""
    half = angles.shape[0]
    out = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    for k in range(half):
        i, j = (k, k + half) if pairing == "half" else (2 * k, 2 * k + 1)
        c, s = torch.cos(angles[k]), torch.sin(angles[k])
        out[i, i], out[i, j], out[j, i], out[j, j] = c, -s, s, c
    return out


def _reference(x, raw, freqs, coords, pairing, left=True):
    """``R(x) q`` per batch, head, token: ``x [B, H, T, D]``, ``raw [H|1, D, D]``, ``coords [B, T, A]``."""
    upper = torch.triu(raw.double(), diagonal=1)
    S = upper - upper.transpose(-1, -2)
    eye = torch.eye(S.shape[-1], dtype=torch.float64)
    P = (eye - S) @ torch.linalg.inv(eye + S)
    out = torch.empty_like(x, dtype=torch.float64)
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            p = P[h if P.shape[0] > 1 else 0]
            for t in range(x.shape[2]):
                rope = _rope_matrix(coords[b, t].double() @ freqs.double(), pairing)
                r = p.T @ rope @ p if left else rope @ p
                out[b, h, t] = r @ x[b, h, t].double()
    return out


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize(("num_axes", "per_head"), [(1, True), (2, True), (3, False)])
def test_matches_the_papers_formula(pairing, num_axes, per_head):
    torch.manual_seed(0)
    enc = posenc.build(
        "string", num_heads=2, head_dim=8, num_axes=num_axes, per_head=per_head, pairing=pairing
    )
    with torch.no_grad():
        enc.cayley_raw.normal_(0.0, 0.5)
        enc.freqs.add_(torch.randn_like(enc.freqs) * 0.3)
    q, k = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)
    coords = torch.rand(num_axes, 2, 4) * 4
    pos = torch.arange(4)[None]
    with enc.position_ids(coords):
        got_q, got_k = enc.rotate(q, k, pos, pos)
    want_q = _reference(q, enc.cayley_raw.detach(), enc.freqs.detach(), coords.permute(1, 2, 0), pairing)
    want_k = _reference(k, enc.cayley_raw.detach(), enc.freqs.detach(), coords.permute(1, 2, 0), pairing)
    torch.testing.assert_close(got_q.double(), want_q, rtol=0, atol=2e-5)
    torch.testing.assert_close(got_k.double(), want_k, rtol=0, atol=2e-5)


def test_without_the_left_factor_scores_are_the_same():
    torch.manual_seed(1)
    full = posenc.build("string", num_heads=2, head_dim=8).double()
    with torch.no_grad():
        full.cayley_raw.normal_(0.0, 0.5)
    short = posenc.build("string", num_heads=2, head_dim=8, left_factor=False).double()
    short.load_state_dict(full.state_dict())
    q, k = torch.randn(1, 2, 5, 8, dtype=torch.float64), torch.randn(1, 2, 5, 8, dtype=torch.float64)
    pos = torch.tensor([[0, 3, 4, 9, 20]])
    fq, fk = full.rotate(q, k, pos, pos)
    sq, sk = short.rotate(q, k, pos, pos)
    torch.testing.assert_close(fq @ fk.transpose(-1, -2), sq @ sk.transpose(-1, -2), rtol=0, atol=1e-12)
    want = _reference(
        q, full.cayley_raw.detach(), full.freqs.detach(), pos[..., None].double(), "half", left=False
    )
    torch.testing.assert_close(sq, want, rtol=0, atol=1e-12)
    assert not torch.allclose(fq, sq, atol=1e-3)


def test_initialisation_is_rope():
    """``S = 0`` gives ``P = I``; one axis: RoPE's frequencies; two axes: pair k on axis k mod 2."""
    enc = posenc.build("string", num_heads=2, head_dim=16)
    rope = posenc.build("rope", head_dim=16)
    q = torch.randn(1, 2, 6, 16)
    pos = torch.arange(6)[None] * 3
    torch.testing.assert_close(
        enc.rotate(q, q, pos, pos)[0], rope.rotate(q, q, pos, pos)[0], rtol=1e-6, atol=1e-6
    )
    freqs = F.string_init_freqs(16, 2)
    theta = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    assert freqs[0].tolist() == pytest.approx([theta[k].item() if k % 2 == 0 else 0.0 for k in range(8)])
    assert freqs[1].tolist() == pytest.approx([theta[k].item() if k % 2 == 1 else 0.0 for k in range(8)])


def _matrix(enc, coords):
    d = enc.head_dim
    basis = torch.eye(d, dtype=torch.float64)[None, None].expand(1, enc.num_heads, d, d)
    with enc.position_ids(coords[:, None, None].expand(-1, 1, d)):
        rotated, _ = enc.rotate(basis, basis, torch.arange(d)[None], torch.arange(d)[None])
    return rotated[0, 0].T


def test_relative_property_holds_in_three_dimensions():
    torch.manual_seed(2)
    enc = posenc.build("string", num_heads=1, head_dim=8, num_axes=3).double()
    with torch.no_grad():
        enc.cayley_raw.normal_(0.0, 0.7)
        enc.freqs.normal_(0.0, 1.0)  # every pair on every axis
    a = torch.tensor([0.7, -1.3, 2.0], dtype=torch.float64)
    b = torch.tensor([2.2, 0.4, -0.6], dtype=torch.float64)
    torch.testing.assert_close(_matrix(enc, a).T @ _matrix(enc, b), _matrix(enc, b - a), rtol=0, atol=1e-10)
    P = enc.orthogonal()[0]
    torch.testing.assert_close(P.T @ P, torch.eye(8, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (P - torch.eye(8, dtype=torch.float64)).abs().max() > 0.1  # and not the identity


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="S must be square"):
        F.cayley_orthogonal(torch.zeros(2, 4, 5))
    with pytest.raises(ValueError, match="S must be square"):
        F.cayley_orthogonal(torch.zeros(4))
    with pytest.raises(ValueError, match="head_dim"):
        posenc.build("string", num_heads=2, head_dim=7)
    with pytest.raises(ValueError, match="pairing"):
        posenc.build("string", num_heads=2, head_dim=8, pairing="x")


def test_layer_dispatches_to_sdpa():
    layer = posenc.MultiheadAttention(64, 4, "string:num_axes=2", causal=True)
    layer(torch.randn(1, 6, 64)).sum().backward()
    assert layer.last_backend == "sdpa"
    assert layer.encoding.cayley_raw.grad.abs().sum() > 0 and layer.encoding.freqs.grad.abs().sum() > 0
