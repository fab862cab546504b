"""Inputs that ended in a raw kernel error now raise a ValueError naming the input (issue 49 item 9).

Each test fails without its check: the error came from ``einsum`` (ComRoPE, LieRE), from the RoPE
kernel's ``cos/sin must be ...`` (M-RoPE, STRING), from ``math.expm1`` (``OverflowError``, GRAPE-A)
or from inside ``F.linear`` (a ``RuntimeError``, one projection of another dtype).
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc

AXIS_SPECS = ["comrope:num_axes=3", "liere:num_axes=3", "mrope", "string:num_axes=3"]


@pytest.mark.parametrize("spec", AXIS_SPECS)
def test_multi_axis_ids_of_another_batch_name_the_position_ids(spec):
    torch.manual_seed(0)
    attn = posenc.MultiheadAttention(48, 2, encoding=spec)
    x = torch.randn(2, 5, 48)
    ids = torch.zeros(3, 3, 5, dtype=torch.long)  # batch 3 for a call of batch 2
    message = r"position ids have batch 3 but the (queries|keys) have batch 2"
    with pytest.raises(ValueError, match=message), attn.encoding.position_ids(ids):
        attn(x)


@pytest.mark.parametrize("spec", AXIS_SPECS)
def test_multi_axis_ids_of_batch_one_or_the_call_batch_still_serve(spec):
    """The check refuses only a mismatch: ids ``[A, T]`` (every row) and ``[A, B, T]`` give one output."""
    torch.manual_seed(0)
    attn = posenc.MultiheadAttention(48, 2, encoding=spec)
    x = torch.randn(2, 5, 48)
    ids = torch.arange(5).expand(3, 5)
    with attn.encoding.position_ids(ids):
        shared = attn(x)
    with attn.encoding.position_ids(ids[:, None].expand(3, 2, 5)):
        per_row = attn(x)
    torch.testing.assert_close(shared, per_row)


def test_grape_a_omega_init_past_its_bound_names_the_option():
    """``omega_init=710`` overflowed ``math.expm1`` (an OverflowError)."""
    with pytest.raises(ValueError, match="omega_init"):
        posenc.build("grape_a:omega_init=710", num_heads=2)


@pytest.mark.parametrize("omega", [1e-6, 0.5, 1.0, 20.0, 100.0])
def test_grape_a_starts_at_omega_init(omega):
    """``softplus(ρ_0) = omega_init`` (softplus written here), also where ``log(expm1(ω))`` is the naive form."""
    enc = posenc.build(f"grape_a:omega_init={omega}", num_heads=1)
    rho = float(enc.omega_raw.detach()[0].double())
    softplus = rho + math.log1p(math.exp(-rho)) if rho > 0 else math.log1p(math.exp(rho))
    assert softplus == pytest.approx(omega, rel=1e-6)


@pytest.mark.parametrize("projection", ["k_proj", "v_proj", "out_proj"])
def test_one_projection_of_another_dtype_names_it(projection):
    attn = posenc.MultiheadAttention(32, 2, encoding="rope")
    getattr(attn, projection).to(torch.float64)
    with pytest.raises(
        ValueError, match=rf"{projection}\.weight is torch.float64 .* q_proj.weight is torch.float32"
    ):
        attn(torch.randn(1, 4, 32))
