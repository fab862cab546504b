"""``posenc.pretrained.measures``: each function against an independent computation (numpy written
out in the test, HF's own Whisper sinusoid and MPNet bucket function, hand-checked numbers)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from posenc.pretrained.measures import (
    bias_by_distance,
    bucket_edges,
    cosine_by_offset,
    cosine_matrix,
    pair_norms,
    row_norms,
    sinusoid_table,
    wavelengths,
)


def _table(rows: int = 9, dim: int = 6) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(3))


def test_cosine_matrix_and_norms_equal_numpy():
    table = _table()
    raw = table.numpy().astype(np.float64)
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    np.testing.assert_allclose(cosine_matrix(table).numpy(), unit @ unit.T, atol=1e-12)
    np.testing.assert_allclose(row_norms(table).numpy(), np.sqrt((raw**2).sum(axis=1)), atol=1e-12)


def test_a_zero_row_has_cosine_zero_not_nan():
    table = _table()
    table[4] = 0
    cosine = cosine_matrix(table)
    assert torch.isfinite(cosine).all()
    assert (cosine[4] == 0).all() and (cosine[:, 4] == 0).all()
    assert cosine[3, 3] == pytest.approx(1.0)


def test_cosine_by_offset_is_the_mean_of_each_diagonal():
    cosine = cosine_matrix(_table(7))
    expected = [np.mean([cosine[p, p + d].item() for p in range(7 - d)]) for d in range(7)]
    np.testing.assert_allclose(cosine_by_offset(cosine).numpy(), expected, atol=1e-12)
    assert cosine_by_offset(cosine)[0].item() == pytest.approx(1.0)


def test_the_halves_sinusoid_is_whispers():
    from transformers.models.whisper.modeling_whisper import sinusoids

    np.testing.assert_allclose(sinusoid_table(30, 16, "halves").numpy(), sinusoids(30, 16).numpy(), atol=1e-5)


def test_the_interleaved_sinusoid_is_vaswanis():
    table = sinusoid_table(12, 8, "interleaved").numpy()
    for p, i in ((0, 0), (3, 1), (11, 3)):
        angle = p / 10000 ** (2 * i / 8)
        assert table[p, 2 * i] == pytest.approx(math.sin(angle))
        assert table[p, 2 * i + 1] == pytest.approx(math.cos(angle))
    with pytest.raises(ValueError, match="dim must be even"):
        sinusoid_table(4, 7, "halves")


def _hf_mpnet_buckets(distances: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    return MPNetEncoder.relative_position_bucket(
        distances, num_buckets=num_buckets, max_distance=max_distance
    )


def test_bucket_edges_of_mpnets_buckets():
    distances = torch.arange(-300, 301)
    buckets = _hf_mpnet_buckets(distances, 32, 128)
    edges = bucket_edges(distances, buckets).tolist()
    # Hand-counted from HF's rule: exact buckets for |r| < 8, then log-spaced up to the last at 91.
    positive = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 23, 32, 46, 64, 91]
    assert edges == sorted([-p for p in positive] + positive)
    # Written out: every distance whose bucket differs from its neighbour towards 0.
    b = dict(zip(distances.tolist(), buckets.tolist(), strict=True))
    walked = [d for d in range(1, 301) if b[d] != b[d - 1]] + [d for d in range(-300, 0) if b[d] != b[d + 1]]
    assert edges == sorted(walked)


def test_bias_by_distance_is_hf_mpnets_position_bias():
    from transformers import MPNetConfig
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    config = MPNetConfig(
        hidden_size=8, num_attention_heads=2, num_hidden_layers=1, relative_attention_num_buckets=16
    )
    encoder = MPNetEncoder(config)
    torch.nn.init.normal_(encoder.relative_attention_bias.weight)
    length = 50
    with torch.no_grad():
        hf = encoder.compute_position_bias(torch.zeros(1, length, 8), num_buckets=16)[
            0
        ]  # [heads, query, key]
    distances = torch.arange(-(length - 1), length)
    bias = bias_by_distance(
        encoder.relative_attention_bias.weight.detach(), _hf_mpnet_buckets(distances, 16, 128)
    )
    for query, key in ((0, 0), (3, 40), (40, 3), (25, 26), (49, 0)):
        torch.testing.assert_close(bias[:, key - query + length - 1].float(), hf[:, query, key])


def test_pair_norms_half_and_interleaved_written_out():
    x = torch.randn(2, 5, 3, 10, generator=torch.Generator().manual_seed(1))
    raw = x.numpy().astype(np.float64)
    half = pair_norms(x, 8, "half").numpy()
    interleaved = pair_norms(x, 8, "interleaved").numpy()
    assert half.shape == (2, 5, 3, 4)
    for k in range(4):
        np.testing.assert_allclose(half[..., k], np.hypot(raw[..., k], raw[..., k + 4]), atol=1e-12)
        np.testing.assert_allclose(
            interleaved[..., k], np.hypot(raw[..., 2 * k], raw[..., 2 * k + 1]), atol=1e-12
        )
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        pair_norms(x, 12)


def test_wavelengths_of_ropes_frequencies():
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    # 2π·10000^(2k/8): 2π, 20π, 200π, 2000π.
    np.testing.assert_allclose(
        wavelengths(inv_freq).numpy(), [2 * math.pi * 10**k for k in range(4)], rtol=1e-12
    )
