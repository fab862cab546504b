"""The grid of runs and its shards (posenc.experiments.grid): array ranges."""

from __future__ import annotations

import pytest

from posenc.experiments.grid import array_ranges


@pytest.mark.parametrize(
    "indices, text", [([0], "0"), ([0, 1, 2, 3], "0-3"), ([3, 1], "1,3"), ([0, 1, 2, 5, 7, 8], "0-2,5,7-8")]
)
def test_array_ranges(indices, text):
    assert array_ranges(indices) == text
