"""xPos against the paper's score formula and a restatement of torchscale's centred forward
(docs/conventions.md §8)."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import functional as F


def test_zeta_and_decay_reference_numbers():
    torch.testing.assert_close(
        F.xpos_zeta(8), torch.tensor([0.285714, 0.464286, 0.642857, 0.821429]), rtol=0, atol=1e-6
    )
    zeta = F.xpos_zeta(8).double()
    for dist, want0, want3 in [
        (1, 0.997556, 0.999616),
        (512, 0.285714, 0.821429),
        (1024, 0.081633, 0.674745),
    ]:
        assert float(zeta[0] ** (dist / 512)) == pytest.approx(want0, abs=1e-6)
        assert float(zeta[3] ** (dist / 512)) == pytest.approx(want3, abs=1e-6)


def _paper_score(
    q: torch.Tensor, k: torch.Tensor, n: int, m: int, base=10000.0, scale_base=512.0, gamma=0.4
) -> float:
    """Σ_k ζ_k^((n-m)/B) · ⟨R_n q_k, R_m k_k⟩ over interleaved pairs, float64, written out pair by pair."""
    d = q.shape[-1]
    total = 0.0
    for pair in range(d // 2):
        theta = base ** (-2 * pair / d)
        zeta = (2 * pair + gamma * d) / ((1 + gamma) * d)
        qa, qb, ka, kb = (
            float(q[2 * pair]),
            float(q[2 * pair + 1]),
            float(k[2 * pair]),
            float(k[2 * pair + 1]),
        )
        delta = (m - n) * theta  # ⟨R(nθ)q, R(mθ)k⟩ = ⟨q, R((m-n)θ)k⟩
        rotated = (qa * ka + qb * kb) * math.cos(delta) + (qb * ka - qa * kb) * math.sin(delta)
        total += zeta ** ((n - m) / scale_base) * rotated
    return total


def test_scores_match_paper_formula():
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    positions = torch.tensor([0, 3, 40, 700])
    qx = F.apply_xpos(q.expand(1, 1, 4, 16), positions, downscale=False)
    kx = F.apply_xpos(k.expand(1, 1, 4, 16), positions, downscale=True)
    scores = (qx[0, 0] @ kx[0, 0].T).double()
    for a, n in enumerate(positions.tolist()):
        for b, m in enumerate(positions.tolist()):
            if m <= n:
                assert float(scores[a, b]) == pytest.approx(_paper_score(q, k, n, m), rel=1e-4, abs=1e-5)


def _torchscale_forward(x: torch.Tensor, offset: int, downscale: bool, scale_base=512.0) -> torch.Tensor:
    """docs/conventions.md §8's description of torchscale ``XPOS.forward`` on ``x [L, d]`` (float64)."""
    length, d = x.shape
    zeta = (torch.arange(0, d, 2, dtype=torch.float64) + 0.4 * d) / (1.4 * d)
    min_pos = -(length + offset) // 2
    max_pos = length + offset + min_pos
    scale = zeta ** (torch.arange(min_pos, max_pos, dtype=torch.float64) / scale_base)[:, None]
    inv_freq = 10000.0 ** (-torch.arange(0, d // 2, dtype=torch.float64) / (d // 2))
    angles = torch.arange(scale.shape[0], dtype=torch.float64)[:, None] * inv_freq
    sin, cos = angles.sin()[-length:], angles.cos()[-length:]
    scale = scale[-length:]
    if downscale:
        scale = 1 / scale
    sin, cos = (sin * scale).repeat_interleave(2, -1), (cos * scale).repeat_interleave(2, -1)
    rotated = torch.stack((-x[:, 1::2], x[:, 0::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def test_scores_equal_torchscale_centred_version_full_and_incremental():
    length, d = 12, 16
    q, k = torch.randn(length, d, dtype=torch.float64), torch.randn(length, d, dtype=torch.float64)
    want = _torchscale_forward(q, 0, False) @ _torchscale_forward(k, 0, True).T
    pos = torch.arange(length)
    got = (
        F.apply_xpos(q[None, None], pos, downscale=False)[0, 0]
        @ F.apply_xpos(k[None, None], pos, downscale=True)[0, 0].T
    )
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    torch.testing.assert_close(got[causal], want[causal], rtol=1e-6, atol=1e-6)
    # torchscale's incremental step: the last query alone with offset = src_len - 1.
    last = _torchscale_forward(q[-1:], length - 1, False) @ _torchscale_forward(k, 0, True).T
    torch.testing.assert_close(got[-1:], last, rtol=1e-6, atol=1e-6)
    # The module, with a non-zero scale centre, gives the same scores.
    enc = posenc.build("xpos", head_dim=d, scale_center=5)
    qr, kr = enc.rotate(q[None, None].float(), k[None, None].float(), pos[None], pos[None])
    torch.testing.assert_close((qr[0, 0] @ kr[0, 0].T).double()[causal], want[causal], rtol=1e-4, atol=1e-4)


def test_cached_decoding_equals_full_pass():
    layer = posenc.MultiheadAttention(32, 2, encoding="xpos", causal=True).eval()
    x = torch.randn(2, 10, 32)
    full = layer(x)
    cache = posenc.KVCache()
    steps = torch.cat([layer(x[:, i : i + 1], cache=cache) for i in range(10)], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)


def test_differs_from_rope_and_decays():
    q = torch.ones(1, 1, 1, 8)
    enc = posenc.build("xpos", head_dim=8, pairing="half")
    rope = posenc.build("rope", head_dim=8)
    near = enc.rotate(q, q, torch.tensor([[600]]), torch.tensor([[599]]))
    far = enc.rotate(q, q, torch.tensor([[600]]), torch.tensor([[0]]))
    assert float((near[0] * near[1]).sum()) > float((far[0] * far[1]).sum())
    plain = rope.rotate(q, q, torch.tensor([[600]]), torch.tensor([[0]]))
    assert not torch.allclose((far[0] * far[1]).sum(), (plain[0] * plain[1]).sum(), atol=1e-3)


def test_errors():
    with pytest.raises(ValueError, match="causal"):
        posenc.MultiheadAttention(32, 2, encoding="xpos", causal=False)
    with pytest.raises(ValueError, match="head_dim"):
        posenc.build("xpos", head_dim=7)
    with pytest.raises(ValueError, match="scale_base"):
        posenc.build("xpos", head_dim=8, scale_base=0)
