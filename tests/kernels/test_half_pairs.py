"""RoPE's half pairing as eager passes (posenc.kernels.half_pairs.rotate_half_pairs) against the rotation
written out here in float64: channel ``k`` turns with channel ``k + d/2``,
``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``, which is HF's ``x * cos + rotate_half(x) * sin``;
in place, and into another tensor leaving the input alone."""

from __future__ import annotations

import pytest
import torch

from posenc.kernels.half_pairs import rotate_half_pairs


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("half", [1, 3, 8])
def test_each_channel_turns_with_the_channel_half_the_width_away(half, inplace):
    generator = torch.Generator().manual_seed(half)
    x = torch.randn(2, 3, 5, 2 * half, dtype=torch.float64, generator=generator)
    angle = torch.randn(5, half, dtype=torch.float64, generator=generator) * 10
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    rotate_half = torch.cat([-x2, x1], dim=-1)  # HF's form of the same rotation
    torch.testing.assert_close(x * torch.cat([cos, cos], -1) + rotate_half * torch.cat([sin, sin], -1), want)
    source = x.clone()
    target = source if inplace else torch.full_like(x, 7.0)
    rotate_half_pairs(source, target, cos, sin, half, inplace)
    torch.testing.assert_close(target, want, rtol=1e-14, atol=1e-14)
    if not inplace:
        assert torch.equal(source, x)  # the input is left alone


def test_a_turn_by_zero_keeps_every_channel_and_a_quarter_turn_swaps_the_halves():
    x = torch.arange(1.0, 7.0, dtype=torch.float64)[None]  # x1 = 1, 2, 3; x2 = 4, 5, 6
    out = torch.empty_like(x)
    rotate_half_pairs(
        x, out, torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), 3, False
    )
    assert out.tolist() == x.tolist()
    rotate_half_pairs(
        x, out, torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), 3, False
    )
    assert out.tolist() == [[-4.0, -5.0, -6.0, 1.0, 2.0, 3.0]]  # (x1, x2) -> (-x2, x1)
