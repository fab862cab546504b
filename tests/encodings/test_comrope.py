"""ComRoPE against the authors' code restated here in float64 (docs/conventions.md §7.12).

Longin-Yu/ComRoPE ``model.py``: ``RoPESelfAttentionBase.get_rotation_matrix`` forms
``lnR = Σ_i x_i A_i`` block by block (``torch.matmul(A, positions * eye)`` summed over the axes),
``R = torch.matrix_exp(lnR)``, scatters the blocks into a dense ``D × D`` matrix with
``block_diag_selector = kron(eye(D/b), ones(b, b))`` and multiplies ``Q = R @ q``, ``K = R @ k``.
``ComRoPEAPAttention``: ``A_i`` keeps ``freqs − freqsᵀ`` on the blocks ``j ≡ i (mod N)``;
``ComRoPELDAttention``: ``A_i = multiplier[i] · (freqs − freqsᵀ)``.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc import functional as F


def _authors_exponents(freqs, multiplier, variant, num_axes):
    """``get_exponent_matrix``: ``[H, N, m, b, b]`` (the code's two classes, restated)."""
    skew = freqs - freqs.transpose(-1, -2)  # [H, m, b, b]
    skew = skew[:, None]  # (num_heads, 1, blocks, b, b)
    if variant == "ld":
        return skew * multiplier[None, :, :, None, None]
    blocks = freqs.shape[1]
    mask = torch.zeros(num_axes, blocks, dtype=freqs.dtype)
    for i in range(num_axes):
        mask[i, i::num_axes] = 1.0
    return skew.expand(-1, num_axes, -1, -1, -1) * mask.view(1, num_axes, blocks, 1, 1)


def _authors_rotation(exponents, positions):
    """``get_rotation_matrix``: ``[B, T, H, D, D]`` for positions ``[B, T, N]``."""
    _, _, blocks, b, _ = exponents.shape
    dim = blocks * b
    eye = torch.eye(b, dtype=exponents.dtype)
    pos = positions[..., None, None, None] * eye  # (bs, len, N, 1, b, b)
    pos = pos.unsqueeze(2)  # (bs, len, 1, N, 1, b, b)
    ln_r = torch.matmul(exponents, pos).sum(dim=3)  # (bs, len, H, m, b, b)
    r = torch.matrix_exp(ln_r)
    selector = torch.kron(torch.eye(blocks, dtype=torch.bool), torch.ones(b, b, dtype=torch.bool))
    dense = torch.zeros(*r.shape[:3], dim, dim, dtype=exponents.dtype)
    dense[:, :, :, selector] = r.reshape(*r.shape[:3], -1)
    return dense


def _reference(x, exponents, positions):
    """``R @ x`` for ``x [B, H, T, D]`` (float64)."""
    dense = _authors_rotation(exponents.double(), positions.double()).transpose(1, 2)  # [B, H, T, D, D]
    return (dense @ x.double()[..., None])[..., 0]


@pytest.mark.parametrize("variant", ["ap", "ld"])
@pytest.mark.parametrize(
    ("num_axes", "block_size", "head_dim"), [(1, 2, 8), (2, 4, 16), (3, 2, 12), (2, 8, 16)]
)
def test_matches_the_authors_code(variant, num_axes, block_size, head_dim):
    torch.manual_seed(0)
    enc = posenc.build(
        "comrope", num_heads=3, head_dim=head_dim, variant=variant, num_axes=num_axes, block_size=block_size
    )
    q, k = torch.randn(2, 3, 5, head_dim), torch.randn(2, 3, 5, head_dim)
    coords = torch.rand(num_axes, 2, 5) * 3  # real-valued coordinates, as the authors' patch centres
    pos = torch.arange(5)[None]
    with enc.position_ids(coords):
        got_q, got_k = enc.rotate(q, k, pos, pos)
    exponents = _authors_exponents(
        enc.freqs.detach().double(),
        None if enc.multiplier is None else enc.multiplier.detach().double(),
        variant,
        num_axes,
    )
    positions = coords.permute(1, 2, 0)
    torch.testing.assert_close(got_q.double(), _reference(q, exponents, positions), rtol=0, atol=2e-5)
    torch.testing.assert_close(got_k.double(), _reference(k, exponents, positions), rtol=0, atol=2e-5)


def test_float64_parameters_give_float64_exactness():
    torch.manual_seed(1)
    enc = posenc.build("comrope", num_heads=2, head_dim=16, block_size=8, num_axes=2).double()
    x = torch.randn(1, 2, 4, 16, dtype=torch.float64)
    coords = torch.rand(2, 1, 4, dtype=torch.float64) * 5
    with enc.position_ids(coords):
        got, _ = enc.rotate(x, x, torch.arange(4)[None], torch.arange(4)[None])
    exponents = _authors_exponents(enc.freqs.detach(), None, "ap", 2)
    torch.testing.assert_close(got, _reference(x, exponents, coords.permute(1, 2, 0)), rtol=0, atol=1e-12)


def test_ap_blocks_follow_one_axis_each():
    """AP with two axes: block j turns with axis j mod 2 only; moving along axis 0 leaves blocks 1, 3 alone."""
    enc = posenc.build("comrope", num_heads=1, head_dim=16, block_size=4, num_axes=2)
    x = torch.randn(1, 1, 2, 16)
    coords = torch.tensor([[[0.0, 2.5]], [[0.0, 0.0]]])  # token 1 moves along axis 0 only
    with enc.position_ids(coords):
        got, _ = enc.rotate(x, x, torch.arange(2)[None], torch.arange(2)[None])
    still = [*range(4, 8), *range(12, 16)]  # blocks 1 and 3 belong to axis 1
    torch.testing.assert_close(got[..., still], x[..., still], rtol=0, atol=1e-6)
    assert not torch.allclose(got[0, 0, 1, :4], x[0, 0, 1, :4], atol=1e-3)


def _matrix(enc, coords):
    """The ``D × D`` map ``x -> R(x) x`` of head 0 at one point ``coords [A]`` (float64)."""
    d = enc.head_dim
    basis = torch.eye(d, dtype=torch.float64)[None, None].expand(1, enc.num_heads, d, d)
    ids = coords.double()[:, None, None].expand(-1, 1, d)
    with enc.position_ids(ids):
        rotated, _ = enc.rotate(basis, basis, torch.arange(d)[None], torch.arange(d)[None])
    return rotated[0, 0].T  # column i = R e_i


@pytest.mark.parametrize("variant", ["ap", "ld"])
def test_relative_property_holds_in_two_dimensions(variant):
    """The paper's claim (commuting angle matrices): R(a)ᵀ R(b) = R(b − a), also with large blocks."""
    torch.manual_seed(2)
    enc = posenc.build(
        "comrope", num_heads=2, head_dim=16, block_size=8, num_axes=2, variant=variant
    ).double()
    a, b = torch.tensor([0.7, -1.3], dtype=torch.float64), torch.tensor([2.2, 0.4], dtype=torch.float64)
    left = _matrix(enc, a).T @ _matrix(enc, b)
    torch.testing.assert_close(left, _matrix(enc, b - a), rtol=0, atol=1e-10)
    eye = torch.eye(16, dtype=torch.float64)
    torch.testing.assert_close(_matrix(enc, a).T @ _matrix(enc, a), eye, rtol=0, atol=1e-10)  # orthogonal
    assert not torch.allclose(_matrix(enc, b - a), eye, atol=1e-3)  # and not trivial


def test_relative_property_fails_without_commuting_generators():
    """The claim needs commuting blocks: two dense non-commuting skew generators break it (LieRE's case)."""
    torch.manual_seed(3)
    gens = F.skew_part(torch.randn(1, 2, 1, 6, 6, dtype=torch.float64))
    a, b = torch.tensor([[[0.7, -1.3]]]), torch.tensor([[[2.2, 0.4]]])
    rot = lambda x: F.block_rotations(gens, x.double())[0, 0, 0, 0]  # noqa: E731
    assert (rot(a).T @ rot(b) - rot(b - a)).abs().max() > 1e-2


def test_grid_width_is_row_and_column():
    enc = posenc.build("comrope", num_heads=2, head_dim=16, block_size=4, num_axes=2, grid_width=3)
    x = torch.randn(1, 2, 7, 16)
    pos = torch.arange(7)[None]
    got, _ = enc.rotate(x, x, pos, pos)
    coords = torch.stack([pos // 3, pos % 3]).float()
    enc.grid_width = None
    with enc.position_ids(coords):
        want, _ = enc.rotate(x, x, pos, pos)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_text_tokens_take_the_position_on_every_axis():
    enc = posenc.build("comrope", num_heads=1, head_dim=8, num_axes=2)
    x = torch.randn(1, 1, 4, 8)
    pos = torch.tensor([[0, 3, 4, 9]])
    got, _ = enc.rotate(x, x, pos, pos)
    with enc.position_ids(torch.stack([pos, pos])):
        want, _ = enc.rotate(x, x, pos, pos)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_grouped_query_heads_share_their_key_heads_rotation():
    """A key head uses the matrices of its group's first query head, so each query head's scores stay relative."""
    torch.manual_seed(4)
    enc = posenc.build("comrope", num_heads=4, head_dim=8, block_size=4).double()
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    pos = torch.tensor([[0, 5, 11]])
    rq, rk = enc.rotate(q, k, pos, pos)
    rq2, rk2 = enc.rotate(q, k, pos + 7, pos + 7)
    scores = rq @ rk.repeat_interleave(2, dim=1).transpose(-1, -2)
    shifted = rq2 @ rk2.repeat_interleave(2, dim=1).transpose(-1, -2)
    torch.testing.assert_close(shifted, scores, rtol=0, atol=1e-10)
    gens = enc.generators()
    want = F.block_rotations(gens[[0, 2]], pos[..., None].double())
    torch.testing.assert_close(rk, F.apply_block_rotation(k, want), rtol=0, atol=1e-12)


def test_initialisation_follows_the_authors():
    torch.manual_seed(5)
    enc = posenc.build(
        "comrope", num_heads=8, head_dim=64, block_size=8, init_std=1.0, variant="ld", num_axes=2
    )
    assert enc.freqs.shape == (8, 8, 8, 8) and enc.multiplier.shape == (2, 8)
    assert abs(float(enc.freqs.detach().std()) - 1.0) < 0.1
    assert posenc.build("comrope", num_heads=2, head_dim=16).multiplier is None  # AP has no multiplier
    assert {n for n, _ in enc.named_parameters()} == {"freqs", "multiplier"}


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="head_dim"):
        posenc.build("comrope", num_heads=2, head_dim=12, block_size=4, num_axes=2)  # AP needs b·A | d
    posenc.build("comrope", num_heads=2, head_dim=12, block_size=4, num_axes=2, variant="ld")  # LD: b | d
    with pytest.raises(ValueError, match="variant"):
        posenc.build("comrope", num_heads=2, head_dim=16, variant="xx")
    with pytest.raises(ValueError, match="grid_width"):
        posenc.build("comrope", num_heads=2, head_dim=16, grid_width=4)  # needs two axes
    with pytest.raises(ValueError, match="generators"):
        F.block_rotations(torch.zeros(1, 2, 3, 4, 5), torch.zeros(1, 3, 2))  # blocks not square
    with pytest.raises(ValueError, match="generators"):
        F.block_rotations(torch.zeros(2, 4, 4), torch.zeros(1, 3, 2))  # not [H, A, m, b, b]
    with pytest.raises(ValueError, match="freqs"):
        F.comrope_generators(torch.zeros(2, 3, 4), 1)
    with pytest.raises(ValueError, match="multiplier"):
        F.comrope_generators(torch.zeros(2, 3, 4, 4), 2, "ld", torch.zeros(3, 3))
    with pytest.raises(ValueError, match="raw"):
        F.skew_part(torch.zeros(3, 4))
    enc = posenc.build("comrope", num_heads=1, head_dim=8, num_axes=2)
    with pytest.raises(ValueError, match="position ids"), enc.position_ids(torch.zeros(3, 1, 4)):
        pass


def test_layer_dispatches_to_sdpa_and_trains():
    layer = posenc.MultiheadAttention(64, 4, "comrope:block_size=4", causal=True)
    x = torch.randn(2, 10, 64)
    out = layer(x)
    assert layer.last_backend == "sdpa"
    out.pow(2).sum().backward()
    assert layer.encoding.freqs.grad is not None and layer.encoding.freqs.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("name", "options"), [("comrope", {"block_size": 8}), ("liere", {"init_scale": 1.0})]
)
def test_whole_positions_by_powers_equal_the_matrix_exponential(name, options):
    """Token positions (every axis equal) take ``exp(pM) = Π exp(2^k M)^{bit_k}``: equal to one
    ``matrix_exp`` per token (the coordinates path) in float64, and closer to it in float32."""
    torch.manual_seed(6)
    enc = posenc.build(
        name, num_heads=2, head_dim=16, num_axes=2, **options
    ).double()  # float32 values, exactly
    x = torch.randn(2, 2, 6, 16, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3, 700, 4095], [5, 6, 7, 8, 9, 10]])
    fast, _ = enc.rotate(x, x, pos, pos)
    with enc.position_ids(torch.stack([pos, pos]).double()):
        direct, _ = enc.rotate(x, x, pos, pos)
    torch.testing.assert_close(fast, direct, rtol=0, atol=1e-9)
    enc32 = enc.float()
    fast32, _ = enc32.rotate(x.float(), x.float(), pos, pos)
    with enc32.position_ids(torch.stack([pos, pos]).float()):
        direct32, _ = enc32.rotate(x.float(), x.float(), pos, pos)
    assert (fast32.double() - direct).abs().max() <= (direct32.double() - direct).abs().max() + 1e-6
    assert (fast32.double() - direct).abs().max() < 2e-5


@pytest.mark.parametrize(
    ("spec", "invariant"), [("comrope:block_size=4", True), ("string", True), ("liere", False)]
)
def test_layer_with_2d_coordinates_cached_and_translated(spec, invariant):
    """Through a layer: 2-D real coordinates by ``position_ids``; decoding in chunks (ids for each
    call's new tokens) equals the full pass; translating every coordinate keeps the output exactly
    where the family is translation invariant (ComRoPE, STRING) and changes it where not (LieRE)."""
    torch.manual_seed(7)
    layer = posenc.MultiheadAttention(
        32, 2, spec + ("," if ":" in spec else ":") + "num_axes=2", causal=True
    ).eval()
    with torch.no_grad():
        for param in layer.encoding.parameters():  # STRING starts at P = I: move it
            param.add_(torch.randn_like(param) * 0.3)
    x = torch.randn(1, 9, 32)
    ids = torch.rand(2, 1, 9) * 3
    with layer.encoding.position_ids(ids):
        full = layer(x)
    cache, pieces, start = posenc.KVCache(), [], 0
    for size in (4, 1, 4):
        with layer.encoding.position_ids(ids[..., start : start + size]):
            pieces.append(layer(x[:, start : start + size], cache=cache))
        start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    with layer.encoding.position_ids(ids + torch.tensor([1.5, -0.75]).view(2, 1, 1)):
        moved = layer(x)
    if invariant:
        torch.testing.assert_close(moved, full, rtol=1e-4, atol=1e-5)
    else:
        assert (moved - full).abs().max() > 1e-3


@pytest.mark.parametrize("spec", ["comrope:block_size=4", "comrope", "liere", "string", "grape"])
def test_real_positions(spec):
    """Whole numbers given as reals equal the integers (for ComRoPE/LieRE: the per-token exponential
    against the power form), and a fractional position lies on the same one-parameter group:
    R(0.5)·R(0.5) = R(1) for these relative maps."""
    torch.manual_seed(8)
    enc = posenc.build(spec, num_heads=2, head_dim=16).double()
    with torch.no_grad():
        for param in enc.parameters():  # STRING starts at P = I: move it
            param.add_(torch.randn_like(param) * 0.3)
    x = torch.randn(1, 2, 4, 16, dtype=torch.float64)
    pos = torch.tensor([[0, 3, 17, 300]])
    as_int, _ = enc.rotate(x, x, pos, pos)
    as_real, _ = enc.rotate(x, x, pos.double(), pos.double())
    torch.testing.assert_close(as_real, as_int, rtol=0, atol=1e-9)
    half = torch.full((1, 4), 0.5, dtype=torch.float64)
    once, _ = enc.rotate(x, x, half, half)
    twice, _ = enc.rotate(once, once, half, half)
    one, _ = enc.rotate(x, x, torch.ones(1, 4, dtype=torch.float64), torch.ones(1, 4, dtype=torch.float64))
    torch.testing.assert_close(twice, one, rtol=0, atol=1e-10)
