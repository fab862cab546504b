"""posenc's own ``arange`` positions carry their first value (posenc.kernels.position_ranges): the checks and
the rotary tables read it instead of the tensor. The mark must give the same numbers as the tensor,
and must never outlive an in-place change of it."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.kernels.position_ranges import arange_positions, known_start
from posenc.kernels.rope import RotaryTables


def _inv_freq(dim: int = 16) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


@pytest.mark.parametrize(("start", "length"), [(0, 1), (5, 1), (300, 1), (0, 37), (1000, 3), (7, 0)])
def test_marked_positions_give_the_gathered_tables(start: int, length: int) -> None:
    tables = RotaryTables(_inv_freq().float())
    marked = arange_positions(start, length)
    plain = torch.arange(start, start + length)[None]  # no mark: the general gather
    assert known_start(marked) == start and known_start(plain) is None
    cos, sin = tables.tables(marked)
    want_cos, want_sin = tables.tables(plain)
    assert cos.shape == want_cos.shape == (1, length, 8)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    # and both equal the formula in float64, rounded to float32
    angles = torch.arange(start, start + length, dtype=torch.float64)[:, None] * _inv_freq()
    assert torch.allclose(cos[0].double(), angles.cos(), atol=1e-4)  # float32 angles at p = 1000


def test_an_in_place_change_drops_the_mark() -> None:
    tables = RotaryTables(_inv_freq().float())
    positions = arange_positions(10, 4)
    positions += 100  # the tensor no longer holds 10..13
    assert known_start(positions) is None
    cos, _ = tables.tables(positions)
    want, _ = tables.tables(torch.arange(110, 114)[None])
    assert torch.equal(cos, want)


def test_a_slice_or_copy_has_no_mark() -> None:
    positions = arange_positions(3, 5)
    assert known_start(positions[:, 1:]) is None
    assert known_start(positions.clone()) is None


def test_the_checks_still_refuse_what_they_refused() -> None:
    learned = posenc.build("learned:max_len=16", dim=16)
    inside = arange_positions(0, 16)
    assert torch.equal(learned.check_positions(inside), inside)
    with pytest.raises(ValueError, match="max_positions=16"):
        learned.check_positions(arange_positions(10, 7))  # 10..16: the last one is outside
    bumped = arange_positions(0, 4)
    bumped -= 2  # -2..1: the mark is gone, and the sign check sees the values
    rope = posenc.build("rope", head_dim=8)
    with pytest.raises(ValueError, match="non-negative"):
        rope.check_positions(bumped)


def test_a_decode_step_equals_explicit_positions() -> None:
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(32, 4, "rope", causal=True).eval()
    prompt, steps = torch.randn(2, 9, 32), torch.randn(3, 2, 1, 32)
    with torch.no_grad():
        marked, explicit = posenc.KVCache(), posenc.KVCache()
        layer(prompt, cache=marked)
        layer(prompt, cache=explicit, positions=torch.arange(9).clone())
        for i, x in enumerate(steps):
            got = layer(x, cache=marked)
            want = layer(x, cache=explicit, positions=torch.tensor([9 + i]))
            assert torch.equal(got, want)
