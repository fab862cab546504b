"""A shard: part ``i`` of ``n`` of a grid's list of units (``--shard i/n``).

The plan's word for a slice of the work, below every other module of the experiments: a grid or a
plan selects its shard's units, the cluster layer (:mod:`.cluster.sharding`) reads one from the
command line or from Slurm's environment and merges what shards wrote. Shard ``i`` of ``n`` keeps the
units at positions ``i, i + n, ...``, so the assignment is a function of the command line alone and
array tasks need no coordination.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Shard"]

T = TypeVar("T")


@dataclass(frozen=True)
class Shard:
    """Part ``index`` of ``count`` (``0 <= index < count``) of an experiment's grid of runs."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or isinstance(self.count, bool):
            raise ValueError(f"--shard needs integers, got {self.index!r}/{self.count!r}")
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(
                f"--shard {self.index}/{self.count}: need i/n with n >= 1 and 0 <= i < n "
                f"(the shards of {max(self.count, 1)} are 0/{max(self.count, 1)} .. "
                f"{max(self.count, 1) - 1}/{max(self.count, 1)})"
            )

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def select(self, runs: Sequence[T]) -> list[T]:
        """The items of this shard: those at positions ``index, index + count, ...`` of ``runs``."""
        return [run for position, run in enumerate(runs) if position % self.count == self.index]
