"""LieRE against the authors' code restated here in float64 (docs/conventions.md §7.13).

StanfordMIMI/LieRE ``models/rope_vit.py``: ``LierePositionEncoder.forward`` (``phase_type="learned"``,
given positions, no CLS token) forms ``bases = (triu(W, 1) − 0.5) − (triu(W, 1) − 0.5)ᵀ`` from the raw
parameters ``W [A, layers, heads·m, g, g]``, ``Σ_i x_i bases_i`` and ``torch.matrix_exp``;
``FlexibleAttention.apply_transforms`` views the transforms as ``[1, T, heads, m, g, g]`` and multiplies
each ``g``-channel slice of the head (``R @ x``), passing the rest through.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import functional as F


def _authors_transforms(raw, positions):
    """``LierePositionEncoder.forward``: raw ``[A, 1, heads·m, g, g]``, positions ``[1, T, A]``."""
    upper_triangle = torch.triu(raw, diagonal=1) - 0.5
    bases = upper_triangle - torch.transpose(upper_triangle, -1, -2)
    in_basis_positions = positions.reshape(list(positions.shape) + [1] * 4) * bases
    generator_pos = torch.sum(in_basis_positions, dim=-5)  # sum over dimensions
    return torch.matrix_exp(generator_pos)  # [1, T, 1, heads·m, g, g]


def _authors_apply(x, transforms, heads):
    """``FlexibleAttention.apply_transforms``, ``x [B, H, T, D]``."""
    g = transforms.shape[-1]
    batch, num_heads, tokens, _ = x.shape
    rotators = transforms.shape[-3] // heads
    width = g * rotators
    states = x[..., :width].reshape(batch, num_heads, tokens, rotators, g, 1)
    transforms = transforms.squeeze(2).view(1, tokens, heads, rotators, g, g).transpose(1, 2)
    rotated = torch.matmul(transforms, states)
    return torch.cat([rotated.flatten(start_dim=-3), x[..., width:]], dim=-1)


def _authors_raw(enc):
    """Our ``[H, A, m, g, g]`` in the authors' layout ``[A, 1, H·m, g, g]`` (head-major, as their view)."""
    raw = enc.generator_raw.detach().double()
    heads, axes, m, g, _ = raw.shape
    return raw.permute(1, 0, 2, 3, 4).reshape(axes, 1, heads * m, g, g)


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize(
    ("num_axes", "generator_dim", "head_dim"), [(2, None, 8), (3, 4, 12), (2, 3, 8), (1, 8, 8)]
)
def test_matches_the_authors_code(per_head, num_axes, generator_dim, head_dim):
    torch.manual_seed(0)
    enc = posenc.build(
        "liere",
        num_heads=2,
        head_dim=head_dim,
        num_axes=num_axes,
        generator_dim=generator_dim,
        per_head=per_head,
    )
    q, k = torch.randn(1, 2, 6, head_dim), torch.randn(1, 2, 6, head_dim)
    coords = torch.rand(num_axes, 1, 6)  # the authors' positions lie in [0, 1]
    pos = torch.arange(6)[None]
    with enc.position_ids(coords):
        got_q, got_k = enc.rotate(q, k, pos, pos)
    transforms = _authors_transforms(_authors_raw(enc), coords.permute(1, 2, 0).double())
    heads = 2 if per_head else 1
    torch.testing.assert_close(
        got_q.double(), _authors_apply(q.double(), transforms, heads), rtol=0, atol=5e-5
    )
    torch.testing.assert_close(
        got_k.double(), _authors_apply(k.double(), transforms, heads), rtol=0, atol=5e-5
    )
    if generator_dim == 3:  # 8 = 2·3 + 2: the last two channels pass through
        torch.testing.assert_close(got_q[..., 6:], q[..., 6:], rtol=0, atol=0)


def test_initialisation_follows_the_authors():
    torch.manual_seed(1)
    enc = posenc.build("liere", num_heads=4, head_dim=64, num_axes=2)
    raw = enc.generator_raw.detach()
    assert raw.shape == (4, 2, 1, 64, 64)  # dense: one 64 x 64 generator per head and axis
    assert float(raw.min()) >= 0 and float(raw.max()) <= 2 * math.pi  # U(0, 2π)
    assert abs(float(raw.mean()) - math.pi) < 0.05
    gens = enc.generators()
    torch.testing.assert_close(gens, -gens.transpose(-1, -2), rtol=0, atol=0)  # skew-symmetric
    assert posenc.build("liere", num_heads=4, head_dim=16, per_head=False).generator_raw.shape[0] == 1


def _matrix(enc, coords):
    """The ``D × D`` map of head 0 at one point ``coords [A]`` (float64)."""
    d = enc.head_dim
    basis = torch.eye(d, dtype=torch.float64)[None, None].expand(1, enc.num_heads, d, d)
    with enc.position_ids(coords.double()[:, None, None].expand(-1, 1, d)):
        rotated, _ = enc.rotate(basis, basis, torch.arange(d)[None], torch.arange(d)[None])
    return rotated[0, 0].T


def test_relative_property_fails_in_two_dimensions():
    """Dense generators of two axes do not commute: R(a)ᵀ R(b) ≠ R(b − a), and translating every
    coordinate changes the scores (the paper does not claim translation invariance in N-D)."""
    torch.manual_seed(2)
    enc = posenc.build("liere", num_heads=1, head_dim=8, num_axes=2, init_scale=1.0).double()
    g0, g1 = enc.generators()[0, 0, 0], enc.generators()[0, 1, 0]
    assert (g0 @ g1 - g1 @ g0).abs().max() > 0.1  # the generators do not commute
    a = torch.tensor([0.7, -1.3], dtype=torch.float64)
    b = torch.tensor([2.2, 0.4], dtype=torch.float64)
    assert (_matrix(enc, a).T @ _matrix(enc, b) - _matrix(enc, b - a)).abs().max() > 1e-2
    eye = torch.eye(8, dtype=torch.float64)
    torch.testing.assert_close(
        _matrix(enc, a).T @ _matrix(enc, a), eye, rtol=0, atol=1e-10
    )  # still orthogonal
    q, k = torch.randn(1, 1, 2, 8, dtype=torch.float64), torch.randn(1, 1, 2, 8, dtype=torch.float64)
    coords = torch.tensor([[[0.0, 1.0]], [[0.0, 0.5]]], dtype=torch.float64)
    pos = torch.arange(2)[None]

    def scores(ids):
        with enc.position_ids(ids):
            rq, rk = enc.rotate(q, k, pos, pos)
        return rq @ rk.transpose(-1, -2)

    assert (scores(coords) - scores(coords + 0.8)).abs().max() > 1e-3


def test_relative_along_one_axis():
    """One axis: R(p) = exp(p G), a one-parameter group, so R(a)ᵀ R(b) = R(b − a)."""
    torch.manual_seed(3)
    enc = posenc.build("liere", num_heads=2, head_dim=8, num_axes=1, init_scale=1.0).double()
    a, b = torch.tensor([1.25], dtype=torch.float64), torch.tensor([-0.5], dtype=torch.float64)
    torch.testing.assert_close(_matrix(enc, a).T @ _matrix(enc, b), _matrix(enc, b - a), rtol=0, atol=1e-10)


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="generator_dim"):
        posenc.build("liere", num_heads=2, head_dim=8, generator_dim=9)
    with pytest.raises(ValueError, match="raw"):
        F.liere_generators(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="generators"):
        F.block_rotations(F.liere_generators(torch.zeros(1, 2, 1, 4, 4))[..., :3], torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match="num_axes"):
        posenc.build("liere", num_heads=2, head_dim=8, num_axes=0)
    enc = posenc.build("liere", num_heads=1, head_dim=8, num_axes=2)
    with pytest.raises(ValueError, match="position ids"), enc.position_ids(torch.zeros(1, 1, 4)):
        pass


def test_layer_dispatches_to_sdpa():
    layer = posenc.MultiheadAttention(64, 4, "liere", causal=True)
    layer(torch.randn(1, 6, 64)).sum().backward()
    assert layer.last_backend == "sdpa"
    assert layer.encoding.generator_raw.grad.abs().sum() > 0


@pytest.mark.parametrize("init_scale", [1e30, float("inf"), float("nan"), 1001.0])
def test_init_scale_past_the_float32_rotation_range_is_refused(init_scale):
    """Issue 49 item 6: ``liere:init_scale=1e30`` was accepted and gave nan outputs."""
    with pytest.raises(ValueError, match="init_scale"):
        posenc.build(f"liere:init_scale={init_scale}", num_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="init_scale"):
        posenc.build("liere", num_heads=1, head_dim=8, init_scale=init_scale)


def test_init_scale_at_the_bound_gives_finite_rotations():
    """At the largest scale allowed, a layer's output is still finite (1e30 gave nan)."""
    torch.manual_seed(0)
    attn = posenc.MultiheadAttention(16, 2, encoding="liere:init_scale=1000")
    assert torch.isfinite(attn(torch.randn(1, 6, 16))).all()
