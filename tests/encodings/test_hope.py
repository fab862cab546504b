"""HoPE against the paper's definition written out here in float64 (docs/conventions.md §7.9).

HoPE (Chen et al. 2025): RoPE's pair k turns by p·θ_k when θ_k·L ≥ 2π (a full period inside the
training length L), and not at all otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import functional as F


def _reference(x: torch.Tensor, positions: torch.Tensor, base: float, kept: list[bool], pairing: str):
    """Rotate ``x [B, H, T, D]`` pair by pair in float64: pair k by p·θ_k if kept[k], else not at all."""
    x = x.double()
    d = x.shape[-1]
    out = x.clone()
    for k in range(d // 2):
        theta = base ** (-2 * k / d) if kept[k] else 0.0
        angle = positions.double()[:, None, :] * theta  # [B, 1, T]
        i, j = (k, k + d // 2) if pairing == "half" else (2 * k, 2 * k + 1)
        a, b = x[..., i], x[..., j]
        out[..., i] = a * torch.cos(angle) - b * torch.sin(angle)
        out[..., j] = b * torch.cos(angle) + a * torch.sin(angle)
    return out


def _kept(head_dim: int, base: float, length: int) -> list[bool]:
    return [base ** (-2 * k / head_dim) * length >= 2 * math.pi for k in range(head_dim // 2)]


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize(
    ("head_dim", "base", "length"), [(16, 10000.0, 64), (64, 10000.0, 512), (32, 500.0, 100)]
)
def test_matches_the_papers_definition(pairing, head_dim, base, length):
    enc = posenc.build("hope", head_dim=head_dim, base=base, train_length=length, pairing=pairing)
    q, k = torch.randn(2, 3, 9, head_dim), torch.randn(2, 1, 9, head_dim)
    q_pos = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 40, 41, 42, 700, 701, 1999]])
    kept = _kept(head_dim, base, length)
    assert 0 < sum(kept) < head_dim // 2  # some pairs kept, some made position-free
    got_q, got_k = enc.rotate(q, k, q_pos, q_pos)
    torch.testing.assert_close(got_q.double(), _reference(q, q_pos, base, kept, pairing), rtol=0, atol=2e-4)
    torch.testing.assert_close(got_k.double(), _reference(k, q_pos, base, kept, pairing), rtol=0, atol=2e-4)
    # Not RoPE: the low-frequency pairs of RoPE do turn at these positions.
    rope = posenc.build("rope", head_dim=head_dim, base=base, pairing=pairing)
    assert not torch.allclose(rope.rotate(q, k, q_pos, q_pos)[0], got_q, atol=1e-3)


def test_worked_numbers():
    """docs/conventions.md §7.9: d = 16, base 10^4, L = 64 keeps pairs 0, 1, 2 (θ·L = 64, 20.2, 6.4 ≥ 2π; 2.02 < 2π)."""
    theta = F.hope_inv_freq(16, 10000.0, train_length=64)
    assert theta[:3].tolist() == pytest.approx([1.0, 0.31622776, 0.1])
    assert theta[3:].tolist() == [0.0] * 5
    assert F.hope_inv_freq(16, 10000.0, high_freq_pairs=5).count_nonzero() == 5
    assert posenc.build("hope:train_length=64", head_dim=16).rotating_pairs == 3
    # half pairing: channels 3..7 and 11..15 (pairs 3..7) never move
    enc = posenc.build("hope:train_length=64", head_dim=16)
    q = torch.randn(1, 1, 4, 16)
    pos = torch.tensor([[0, 7, 300, 5000]])
    got, _ = enc.rotate(q, q, pos, pos)
    still = [*range(3, 8), *range(11, 16)]
    torch.testing.assert_close(got[..., still], q[..., still], rtol=0, atol=0)
    assert not torch.allclose(got[..., [0, 8]], q[..., [0, 8]])


def _matrix(enc, position: float, head_dim: int) -> torch.Tensor:
    """The d x d map x -> R(p) x of ``enc`` at one position (float64), read off the basis vectors."""
    basis = torch.eye(head_dim, dtype=torch.float64)[None, None]  # [1, 1, D tokens, D]
    pos = torch.full((1, head_dim), position, dtype=torch.long)
    rotated, _ = enc.rotate(basis, basis, pos, pos)
    return rotated[0, 0].T  # column i = R e_i


def test_relative_property_holds():
    """R(a)ᵀ R(b) = R(b − a): θ' = 0 is the identity rotation, so HoPE stays relative."""
    enc = posenc.build("hope:train_length=64", head_dim=16)
    for a, b in [(3, 10), (0, 57), (120, 4000)]:
        lhs = _matrix(enc, a, 16).T @ _matrix(enc, b, 16)
        torch.testing.assert_close(lhs, _matrix(enc, b - a, 16), rtol=0, atol=1e-4)  # float32 angles


def test_runs_through_sdpa_and_caches():
    layer = posenc.MultiheadAttention(64, 4, "hope:train_length=512", causal=True).eval()
    x = torch.randn(2, 12, 64)
    full = layer(x)
    assert layer.last_backend == "sdpa"
    cache = posenc.KVCache()
    steps = [layer(x[:, :5], cache=cache), layer(x[:, 5:], cache=cache)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_errors_name_the_option():
    with pytest.raises(ValueError, match="high_freq_pairs"):
        posenc.build("hope", head_dim=16)  # neither option
    with pytest.raises(ValueError, match="train_length"):
        posenc.build("hope:train_length=64,high_freq_pairs=2", head_dim=16)
    with pytest.raises(ValueError, match="high_freq_pairs"):
        posenc.build("hope:high_freq_pairs=9", head_dim=16)
    with pytest.raises(ValueError, match="train_length"):
        posenc.build("hope:train_length=0", head_dim=16)
    with pytest.raises(ValueError, match="head_dim"):
        posenc.build("hope:train_length=64", head_dim=15)


def test_a_models_layers_take_its_max_len_as_the_training_length():
    model = posenc.TransformerLM(50, 64, 2, 4, encoding="hope", max_len=512)  # 4 heads of 16
    encs = [m for m in model.modules() if isinstance(m, posenc.get_class("hope"))]
    assert encs and all(e.train_length == 512 for e in encs)
    # 8 pairs, θ_k = 10^(-k/2): θ·512 ≥ 2π (θ ≥ 0.0123) keeps k ≤ 3 (θ_3 = 0.0316, θ_4 = 0.01)
    assert encs[0].rotating_pairs == 4
    explicit = posenc.TransformerLM(50, 64, 2, 4, encoding="hope:high_freq_pairs=3", max_len=512)
    assert {m.rotating_pairs for m in explicit.modules() if isinstance(m, posenc.get_class("hope"))} == {3}
