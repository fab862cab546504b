"""posenc.kernels.rope (the fused rotary kernel and ``RotaryTables``, the one cos/sin cache of every rotary
encoding) against the rotation written out (float64) and HF's rotate_half."""

from __future__ import annotations

import pytest
import torch

import posenc
from _contract import make_encoding
from posenc.kernels.rope import MAX_CACHED_ROWS, RotaryTables, apply_rotary, rotary_reference


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("inplace", [False, True])
def test_differentiable_fused_rotary_equals_the_reference_and_its_gradient(pairing, inplace):
    """posenc.kernels.rope.rotary under autograd (the fused kernel; backward rotates by -angle) against
    the plain expression, values and gradients in float64, partial width, in place on a fresh
    intermediate (as the layer's projections are)."""
    from posenc.kernels.rope import rotary, rotary_cos_sin, rotary_reference

    inv_freq = torch.rand(3, dtype=torch.float64)
    cos, sin = rotary_cos_sin(torch.arange(7)[None], inv_freq)
    base = torch.randn(2, 3, 7, 10, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 3, 7, 10, dtype=torch.float64)
    got = rotary(base * 1.0, cos, sin, pairing=pairing, inplace=inplace)
    (grad_got,) = torch.autograd.grad((got * weight).sum(), base)
    want = rotary_reference(base, cos, sin, pairing)
    (grad_want,) = torch.autograd.grad((want * weight).sum(), base)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "projection_view", "odd_offset"])
@pytest.mark.parametrize("tables", ["shared", "per_batch"])
@pytest.mark.parametrize("mode", ["inplace", "out_of_place", "out"])
def test_fused_rotary_on_every_layout_equals_the_reference(dtype, layout, tables, mode):
    """apply_rotary against the plain expression for both pairings: the complex multiply (interleaved
    float32/64 whose pairs are adjacent), the generic path (bfloat16, an odd storage offset), the
    layer's transposed projection views, per-batch tables, partial width, ``out=`` and in place."""
    from posenc.kernels.rope import apply_rotary, rotary_cos_sin, rotary_reference

    batch, heads, length, dim = 2, 3, 37, 10
    positions = torch.randint(0, 500, (batch if tables == "per_batch" else 1, length))
    cos, sin = rotary_cos_sin(positions, torch.rand(4, dtype=torch.float64) + 0.01)  # 8 of 10 channels turn
    base = torch.randn(batch, length, heads * dim + 1, dtype=torch.float64).to(dtype)
    if layout == "odd_offset":  # pairs start at an odd element: no complex view
        x = base[..., 1:].unflatten(-1, (heads, dim)).transpose(1, 2)
    else:
        x = base[..., :-1].unflatten(-1, (heads, dim)).transpose(1, 2)
        if layout == "contiguous":
            x = x.contiguous()
    for pairing in ("half", "interleaved"):
        want = rotary_reference(x.double(), cos.double(), sin.double(), pairing)
        source = x.clone()
        if mode == "inplace":
            got = apply_rotary(source, cos, sin, pairing=pairing, inplace=True)
            assert got.data_ptr() == source.data_ptr()
        elif mode == "out":
            out = torch.empty_like(x)
            got = apply_rotary(source, cos, sin, pairing=pairing, out=out)
            assert got.data_ptr() == out.data_ptr()
        else:
            got = apply_rotary(source, cos, sin, pairing=pairing)
            torch.testing.assert_close(source, x, rtol=0, atol=0)  # the input is left alone
        tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-2, "atol": 2e-2}
        if dtype == torch.float32:
            tol = {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m, p=pairing: f"{p}: {m}")


# ---------------------------------------------------------------------------- RoPE kernel


def _hf_rotate(x, cos_half, sin_half):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = torch.cat((cos_half, cos_half), -1), torch.cat((sin_half, sin_half), -1)
    out, _ = apply_rotary_pos_emb(x, x, cos.to(x.dtype), sin.to(x.dtype))
    return out


@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rotary_half_matches_hf(inplace, monkeypatch):
    monkeypatch.setattr("posenc.kernels.rope.CHUNK_BYTES", 256)  # many chunks
    x = torch.randn(2, 3, 7, 16, dtype=torch.float64)
    tables = RotaryTables(1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [9, 3, 100, 4, 0, 7, 5]])
    cos, sin = tables.tables(positions)
    want = _hf_rotate(x, cos, sin)
    got = apply_rotary(x.clone(), cos, sin, inplace=inplace)
    torch.testing.assert_close(got, want)


def test_apply_rotary_interleaved_partial_and_grad():
    x = torch.randn(1, 2, 5, 12, dtype=torch.float64, requires_grad=True)
    angles = torch.arange(5, dtype=torch.float64)[:, None] * torch.tensor(
        [1.0, 0.1, 0.01], dtype=torch.float64
    )
    cos, sin = angles.cos(), angles.sin()
    # Pairs (0,1), (2,3), (4,5) rotate by the angles; channels 6..11 pass through.
    x1, x2 = x[..., 0:6:2], x[..., 1:6:2]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    want = torch.cat((rotated, x[..., 6:]), -1)
    got = apply_rotary(x, cos, sin, pairing="interleaved")
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        apply_rotary(x.detach().clone(), cos, sin, pairing="interleaved", inplace=True), want.detach()
    )
    g = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])
    with pytest.raises(ValueError, match="inplace"):
        apply_rotary(x, cos, sin, inplace=True)
    with pytest.raises(ValueError, match="pairing"):
        rotary_reference(x, cos, sin, pairing="diagonal")


# ----------------------------------------------------------------------------
# One contract per kind: the kind bases checked by ``@register``, the LayerContext a layer hands its
# encoding, derived float32 buffers that survive casts, ``to_empty()`` and meta-device construction, the one
# RoPE cos/sin cache, the scaling registry's examples and the parsed :class:`Spec`.


NAMES = posenc.available()


# ---------------------------------------------------------------------------- the RoPE cache


def _rotate_half_float32(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]`` rotated with rotate_half pairing, angles in float32 (as the cache does)."""
    angles = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def test_far_positions_do_not_grow_the_cache():
    enc = posenc.build("rope", head_dim=8, cache_size=16)
    x = torch.randn(1, 2, 3, 8)
    positions = torch.tensor([[3, 100, 10**7]])
    got, _ = enc.rotate(x, x, positions, positions)
    assert enc.cos_cached.shape[0] <= max(16, MAX_CACHED_ROWS)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    torch.testing.assert_close(got, _rotate_half_float32(x, positions, inv_freq))


def test_rotary_tables_are_the_cache_of_every_rotary_encoding():
    rotary = [n for n in NAMES if posenc.get_class(n).kind is posenc.Kind.ROTARY]
    assert {"rope", "xpos", "axial_rope", "mrope"} <= set(rotary)
    for name in rotary:
        enc = make_encoding(name)
        if any(param.requires_grad for param in enc.parameters()):
            continue  # learned frequencies (rope_mixed) change every step: nothing to cache
        assert isinstance(enc.tables, RotaryTables), name


def test_rotary_tables_serve_cached_and_far_positions_alike():
    inv_freq = torch.tensor([1.0, 0.1, 0.01])
    tables = RotaryTables(inv_freq, attention_scale=0.5, cache_size=4)
    positions = torch.tensor([[0, 3, 7], [MAX_CACHED_ROWS + 5, 1, 2]])
    cos, sin = tables.tables(positions)
    angles = positions.float()[..., None] * inv_freq
    torch.testing.assert_close(cos, 0.5 * angles.cos())
    torch.testing.assert_close(sin, 0.5 * angles.sin())
