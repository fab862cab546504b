"""Additive GRAPE against the paper's unipotent lift and the authors' code, with ALiBi and FoX as its
special cases checked against posenc's ``alibi`` and ``fox`` (docs/conventions.md §7.16).

The paper: ``G(n) = I + n ω E``, ``E = e_a e_bᵀ`` in ``R^{D+2}``; ``q̃ = G(i)⁻ᵀ [q; 1; 0]``,
``k̃ = G(j) [k; 0; 1]``, ``q̃·k̃ = q·k − ω(i − j)``. The authors' ``KeyGatedAdditiveBias``
(``model/llama-mha-grape-a-keygated.py``): ``bias = −dist · softplus(ω_raw) · slopes · gate`` with
``dist = (i − j).clamp_min(0)`` and ``_get_alibi_slopes``; here with the gate at 1.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import functional as F
from posenc.encodings.base import TokenStates


def _authors_slopes(n_heads):
    """``_get_alibi_slopes`` restated."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * (start**i) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_2(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return power_of_2(closest) + _authors_slopes(2 * closest)[0::2][: n_heads - closest]


def _authors_bias(omega_raw, n_heads, length):
    """``KeyGatedAdditiveBias.forward`` with ``gate = 1``: ``[1, H, T, T]`` (float64)."""
    arange = torch.arange(length)
    dist = (arange.view(length, 1) - arange.view(1, length)).clamp_min(0).double()
    slopes = torch.tensor(_authors_slopes(n_heads), dtype=torch.float64).view(1, n_heads, 1, 1)
    omega = torch.nn.functional.softplus(omega_raw.double()).view(1, n_heads, 1, 1) * slopes
    return -dist * omega


@pytest.mark.parametrize("heads", [4, 6])
def test_matches_the_authors_bias(heads):
    torch.manual_seed(0)
    enc = posenc.build("grape_a", num_heads=heads)
    with torch.no_grad():
        enc.omega_raw.normal_(0.0, 1.0)  # trained away from ALiBi
    got = enc.bias(9, 9)
    want = _authors_bias(enc.omega_raw.detach(), heads, 9)[0]
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_initialisation_is_alibi():
    """``omega_init = 1``: ``ω_h = m_h``, ALiBi's causal bias on and before the diagonal (0 after it)."""
    enc, alibi = posenc.build("grape_a", num_heads=8), posenc.build("alibi", num_heads=8)
    got, want = enc.bias(12, 12), alibi.bias(12, 12)
    before = torch.tril(torch.ones(12, 12, dtype=torch.bool))
    torch.testing.assert_close(got[:, before], want[:, before], rtol=1e-6, atol=0)
    assert (got[:, ~before] == 0).all()
    torch.manual_seed(1)
    layer = posenc.MultiheadAttention(32, 8, "grape_a", causal=True)
    ref = posenc.MultiheadAttention(32, 8, "alibi", causal=True)
    ref.load_state_dict(layer.state_dict(), strict=False)
    x = torch.randn(2, 20, 32)
    torch.testing.assert_close(layer(x), ref(x), rtol=1e-5, atol=1e-6)


def _unipotent(n, omega, dim):
    """``G(n) = I + n ω E``, ``E = e_a e_bᵀ`` (``a = dim``, ``b = dim + 1``) in ``R^{dim+2}``, float64."""
    g = torch.eye(dim + 2, dtype=torch.float64)
    g[dim, dim + 1] = n * omega
    return g


def test_lift_gives_alibi_and_the_relative_law():
    torch.manual_seed(2)
    q, k = torch.randn(3, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    q_pos, k_pos = torch.tensor([5.0, 9.0, 40.0], dtype=torch.float64), torch.tensor([0.0, 5.0, 7.0, 38.0])
    omega = 0.125  # ALiBi's slope of head 3 of 8
    q_lift, k_lift = F.grape_additive_lift(q, k, omega * q_pos, omega * k_pos.double())
    scores = q_lift @ k_lift.T
    alibi = posenc.build("alibi", num_heads=8).bias_at(
        torch.tensor(2), q_pos[:, None].long(), k_pos[None].long()
    )
    torch.testing.assert_close(scores, q @ k.T + alibi.double(), rtol=0, atol=1e-12)
    base_q = torch.cat([q, torch.ones(3, 1, dtype=torch.float64), torch.zeros(3, 1, dtype=torch.float64)], -1)
    base_k = torch.cat([k, torch.zeros(4, 1, dtype=torch.float64), torch.ones(4, 1, dtype=torch.float64)], -1)
    for i in range(3):
        for j in range(4):
            gi, gj = _unipotent(float(q_pos[i]), omega, 6), _unipotent(float(k_pos[j]), omega, 6)
            lifted = (torch.linalg.inv(gi).T @ base_q[i]) @ (gj @ base_k[j])
            relative = base_q[i] @ _unipotent(float(k_pos[j] - q_pos[i]), omega, 6) @ base_k[j]
            torch.testing.assert_close(scores[i, j], lifted, rtol=0, atol=1e-12)
            torch.testing.assert_close(lifted, relative, rtol=0, atol=1e-12)


def test_lift_with_cumulative_forget_gates_is_fox():
    """Phases ``φ_n = −c_n`` (FoX's cumulative log forget gates) give FoX's bias ``c_i − c_j``."""
    torch.manual_seed(3)
    log_gates = torch.nn.functional.logsigmoid(torch.randn(1, 2, 7, dtype=torch.float64))
    states = F.fox_states(log_gates)  # [B, H, T]
    q, k = torch.randn(1, 2, 7, 4, dtype=torch.float64), torch.randn(1, 2, 7, 4, dtype=torch.float64)
    q_lift, k_lift = F.grape_additive_lift(q, k, -states, -states)
    bias = q_lift @ k_lift.transpose(-1, -2) - q @ k.transpose(-1, -2)
    want = F.fox_bias(TokenStates.same_sequence(states), 2, bidirectional=False)
    before = torch.tril(torch.ones(7, 7, dtype=torch.bool))
    torch.testing.assert_close(bias[..., before], want[..., before], rtol=0, atol=1e-12)


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="q_phase"):
        F.grape_additive_lift(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2), torch.zeros(5))
    with pytest.raises(ValueError, match="omega_init"):
        posenc.build("grape_a", num_heads=2, omega_init=0)


def test_learned_slopes_train_and_dispatch():
    layer = posenc.MultiheadAttention(64, 4, "grape_a", causal=True)
    layer(torch.randn(1, 6, 64)).sum().backward()
    assert layer.encoding.omega_raw.grad.abs().sum() > 0
    frozen = posenc.build("grape_a:learnable=false", num_heads=4)
    assert frozen.near_far() is not None and posenc.build("grape_a", num_heads=4).near_far() is None


@pytest.mark.parametrize("causal", [True, False])
def test_frozen_slopes_run_on_the_near_far_split(causal):
    from posenc.backends import AttentionRequest
    from posenc.backends.near_far import near_far_attention, near_far_plan

    torch.manual_seed(4)
    enc = posenc.build("grape_a:learnable=false", num_heads=2).double()
    with torch.no_grad():
        enc.omega_raw.normal_(0.0, 1.0)
    length = 90
    q, k, v = (torch.randn(1, 2, length, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(length)[None]
    req = AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=8**-0.5, causal=causal
    )
    plan, why = near_far_plan(req, block=16)
    assert plan is not None, why
    bias = enc.bias(length, length).double()
    logits = (q @ k.transpose(-1, -2)) * 8**-0.5 + bias
    if causal:
        logits = logits.masked_fill(
            torch.triu(torch.ones(length, length, dtype=torch.bool), 1), float("-inf")
        )
    want = logits.softmax(-1) @ v
    torch.testing.assert_close(near_far_attention(req, block=16), want, rtol=1e-7, atol=1e-9)


# ----------------------------------------------------------------------------
# Inputs that ended in a raw kernel error now raise a ValueError naming the input (issue 49 item 9).


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
