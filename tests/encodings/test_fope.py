"""FoPE against the authors' code restated here in float64 (docs/conventions.md §7.10).

The authors' ``FourierEmbedding`` (Fourier-Position-Embedding, ``olmo/model.py``) with the paper's
configs: RoPE frequencies, those below ``2π/L`` clipped to zero and dropped (K left), per head a
sine and a cosine coefficient matrix ``[K, n]``, ``n = min(K, d/4)``, initialised
``xavier_normal_(gain=σ) + eye``; ``fourier_sin = pos_sin @ A``, ``fourier_cos = pos_cos @ B``,
padded to d/2 with ``F.pad(value=1)``, doubled, and ``t·cos + rotate_half(t)·sin``.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import functional as F


def _authors(x, positions, head_dim, base, length, sin_coef, cos_coef, pad_sin):
    """The authors' forward for ``x [B, H, T, D]`` at ``positions [B, T]``, float64."""
    d = head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    inv_freq[inv_freq < 2 * math.pi / length] = 0.0  # rope_clamp_floor_freq, clamp_floor_to_zero
    inv_freq = inv_freq[inv_freq != 0.0]  # fourier_ignore_zero
    angles = positions.double()[..., None] * inv_freq  # [B, T, K]
    pos_sin, pos_cos = angles.sin()[:, None], angles.cos()[:, None]  # [B, 1, T, K]
    f_sin = torch.einsum("bhtk,hkn->bhtn", pos_sin, sin_coef.double())
    f_cos = torch.einsum("bhtk,hkn->bhtn", pos_cos, cos_coef.double())
    pad = d // 2 - f_sin.shape[-1]
    f_sin = torch.nn.functional.pad(f_sin, (0, pad), value=pad_sin)
    f_cos = torch.nn.functional.pad(f_cos, (0, pad), value=1.0)
    f_sin, f_cos = torch.cat((f_sin, f_sin), -1), torch.cat((f_cos, f_cos), -1)
    x = x.double()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotate_half = torch.cat((-x2, x1), dim=-1)
    return x * f_cos + rotate_half * f_sin


@pytest.mark.parametrize(
    ("head_dim", "length", "kept", "pairs"), [(16, 64, 3, 3), (64, 512, 16, 16), (32, 2048, 11, 8)]
)
@pytest.mark.parametrize("padding", ["authors", "zero_frequency"])
def test_matches_the_authors_code(head_dim, length, kept, pairs, padding):
    enc = posenc.build("fope", num_heads=4, head_dim=head_dim, train_length=length, padding=padding)
    assert enc.inv_freq.shape[0] == kept and enc.series_pairs == pairs
    assert enc.sin_coef.shape == (4, kept, pairs)
    q, k = torch.randn(2, 4, 7, head_dim), torch.randn(2, 4, 7, head_dim)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [10, 11, 12, 500, 501, 502, 1500]])
    got_q, got_k = enc.rotate(q, k, pos, pos)
    pad_sin = 1.0 if padding == "authors" else 0.0
    args = (pos, head_dim, 10000.0, length, enc.sin_coef, enc.cos_coef, pad_sin)
    torch.testing.assert_close(got_q.double(), _authors(q, *args), rtol=0, atol=2e-4)
    torch.testing.assert_close(got_k.double(), _authors(k, *args), rtol=0, atol=2e-4)


@pytest.mark.parametrize(("heads", "kept", "pairs"), [(4, 16, 16), (2, 11, 8), (1, 6, 3)])
def test_initialisation_is_the_authors(heads, kept, pairs):
    """``xavier_normal_(gain=0.3)`` then ``+ eye`` (K = n) or the strided eye ``[j·⌈K/n⌉, j]`` (K > n)."""
    torch.manual_seed(5)
    want = torch.empty(heads, kept, pairs)
    torch.nn.init.xavier_normal_(want, gain=0.3)
    step = math.ceil(kept / pairs)
    for j in range(pairs):
        if j * step < kept:  # the authors' get_step_eye
            want[:, j * step, j] += 1.0
    torch.manual_seed(5)
    got = F.fope_init_coefficients(heads, kept, pairs, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    identity = F.fope_init_coefficients(heads, kept, pairs, 0.0)
    assert (
        identity.sum().item() == heads * min(pairs, math.ceil(kept / step)) and identity.max().item() == 1.0
    )


def test_worked_numbers():
    """docs/conventions.md §7.10: d = 16, base 10^4, L = 64: floor 2π/64 = 0.098, K = 3 (θ = 1, 0.316, 0.1), n = 3."""
    theta = F.fope_inv_freq(16, 10000.0, 64)
    assert theta.tolist() == pytest.approx([1.0, 0.31622776, 0.1])
    assert F.fope_inv_freq(16, 10000.0).shape[0] == 8  # no floor: every frequency
    enc = posenc.build("fope:train_length=64,sigma=0", num_heads=1, head_dim=16)
    # σ = 0: pair 0 at p = 2 is the plain rotation by 2 rad; pair 5 is the identity.
    cos, sin = F.fope_cos_sin(
        torch.tensor([[2]]), enc.inv_freq, enc.cos_coef, enc.sin_coef, 16, "zero_frequency"
    )
    assert cos[0, 0, 0, 0].item() == pytest.approx(math.cos(2.0)) and sin[0, 0, 0, 0].item() == pytest.approx(
        math.sin(2.0)
    )
    assert (cos[0, 0, 0, 3:].tolist(), sin[0, 0, 0, 3:].tolist()) == ([1.0] * 5, [0.0] * 5)


def _matrix(enc, position: int, head_dim: int) -> torch.Tensor:
    basis = torch.eye(head_dim, dtype=torch.float64)[None, None]
    pos = torch.full((1, head_dim), position, dtype=torch.long)
    rotated, _ = enc.rotate(basis, basis, pos, pos)
    return rotated[0, 0].T


def test_relative_property_fails_with_harmonics_and_holds_without():
    """The paper: the Fourier series break exact relativity (c² + s² ≠ 1); σ = 0 is clipped RoPE, relative."""
    series = posenc.build("fope:train_length=64,sigma=0.3", num_heads=1, head_dim=16)
    plain = posenc.build("fope:train_length=64,sigma=0", num_heads=1, head_dim=16)
    a, b = 5, 19
    lhs = _matrix(plain, a, 16).T @ _matrix(plain, b, 16)
    torch.testing.assert_close(lhs, _matrix(plain, b - a, 16), rtol=0, atol=1e-5)
    lhs = _matrix(series, a, 16).T @ _matrix(series, b, 16)
    assert (lhs - _matrix(series, b - a, 16)).abs().max() > 1e-2
    assert not posenc.get_class("fope").shift_invariant


def test_grouped_query_heads_use_their_groups_coefficients():
    enc = posenc.build("fope:train_length=64", num_heads=4, head_dim=16)
    q, k = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16)
    pos = torch.arange(5)[None]
    got_q, got_k = enc.rotate(q, k, pos, pos)
    for head, coef in [(0, 0), (1, 0), (2, 2), (3, 2)]:  # key head j uses coefficient head 2j
        want = _authors(
            q[:, head : head + 1],
            pos,
            16,
            1e4,
            64,
            enc.sin_coef[coef : coef + 1],
            enc.cos_coef[coef : coef + 1],
            0.0,
        )
        torch.testing.assert_close(got_q[:, head : head + 1].double(), want, rtol=0, atol=1e-5)
    want_k = _authors(k[:, 1:2], pos, 16, 1e4, 64, enc.sin_coef[2:3], enc.cos_coef[2:3], 0.0)
    torch.testing.assert_close(got_k[:, 1:2].double(), want_k, rtol=0, atol=1e-5)
    shared = posenc.build("fope:train_length=64,separate_heads=false", num_heads=4, head_dim=16)
    assert shared.sin_coef.shape[0] == 1


def test_coefficients_are_saved_and_learnable_on_request():
    one = posenc.build("fope:train_length=64", num_heads=2, head_dim=16)
    two = posenc.build("fope:train_length=64", num_heads=2, head_dim=16)
    assert set(one.state_dict()) == {"sin_coef", "cos_coef"}
    assert not torch.equal(one.sin_coef, two.sin_coef)
    two.load_state_dict(one.state_dict())
    q = torch.randn(1, 2, 4, 16)
    pos = torch.arange(4)[None]
    torch.testing.assert_close(one.rotate(q, q, pos, pos)[0], two.rotate(q, q, pos, pos)[0], rtol=0, atol=0)
    assert not list(one.parameters())
    learnable = posenc.build("fope:train_length=64,learnable=true", num_heads=2, head_dim=16)
    assert {name for name, _ in learnable.named_parameters()} == {"sin_coef", "cos_coef"}


def test_runs_through_sdpa_and_caches():
    layer = posenc.MultiheadAttention(64, 4, "fope:train_length=512", causal=True).eval()
    x = torch.randn(2, 12, 64)
    full = layer(x)
    assert layer.last_backend == "sdpa"
    cache = posenc.KVCache()
    steps = [layer(x[:, :5], cache=cache), layer(x[:, 5:], cache=cache)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_errors_name_the_option():
    with pytest.raises(ValueError, match="padding"):
        posenc.build("fope:padding=ones", num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="train_length"):
        posenc.build("fope:train_length=0", num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="sigma"):
        posenc.build("fope:sigma=-1", num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="head_dim"):
        posenc.build("fope", num_heads=2, head_dim=15)


def test_a_models_layers_take_its_max_len_as_the_training_length():
    model = posenc.TransformerLM(50, 64, 2, 4, encoding="fope", max_len=512)
    encs = [m for m in model.modules() if isinstance(m, posenc.get_class("fope"))]
    assert encs and all(e.train_length == 512 for e in encs)
    # head size 16, θ_k = 10^(-k/2): θ·512 ≥ 2π keeps k ≤ 3 (θ_3 = 0.0316 ≥ 0.0123, θ_4 = 0.01)
    assert encs[0].inv_freq.shape[0] == 4 and encs[0].series_pairs == 4


def test_a_floor_above_every_frequency_zeroes_every_pair():
    """L = 1: the floor 2π exceeds θ_0 = 1, K = 0, every pair zeroed: the identity (the authors' padding: a fixed map)."""
    enc = posenc.build("fope:train_length=1", num_heads=2, head_dim=16)
    assert enc.inv_freq.numel() == 0 and enc.series_pairs == 0
    q = torch.randn(1, 2, 3, 16)
    pos = torch.tensor([[0, 5, 90]])
    torch.testing.assert_close(enc.rotate(q, q, pos, pos)[0], q, rtol=0, atol=0)
