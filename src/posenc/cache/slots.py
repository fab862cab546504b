"""Fixed-shape decoding in a preallocated cache: :class:`SlotState`, one layer's place in its
buffers while ``KVCache.fixed_shapes()`` is open.

A growing cache hands the kernel keys that grow by one every step: every step has new shapes, and a
compiled graph would be traced again. Inside ``with cache.fixed_shapes():`` (a ``KVCache(max_length=N)``
whose prompt was run as usual) a one-token call of a layer instead writes its key and value at the
next free slot of the layer's ``[B, Hkv, N, D]`` buffers (one ``index_copy_``) and attends over all
``N`` slots, those not written yet hidden by a mask read from a tensor. Nothing a step reads is a
Python number that changes, so ``torch.compile(fullgraph=True)`` of a layer or of a whole model
traces one graph and serves every step (gpt-fast's static cache; HF's ``StaticCache``).

A slot is where a token is written; its position is the position after the token in the slot
before it (``slot + offset``, per row): a prompt may sit at any positions and the steps continue them.
Leaving the block records the tokens written (``set_length``) and marks them unchecked, so the next
eager call tests them for nan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .entry import KVCacheEntry

__all__ = ["SlotState", "fixed_shape_problems"]


def fixed_shape_problems(entry: KVCacheEntry) -> list[str]:
    """Why ``entry`` cannot be decoded in fixed shapes (empty: it can): it needs preallocated
    buffers whose live keys start at slot 0, and no per-key padding, documents or token states
    (every written slot is attended)."""
    if entry.buffers() is None:
        return ["it holds no preallocated buffers"]
    problems = []
    if entry.padding is not None or entry.document_ids is not None:
        problems.append("it holds padding or document ids (every written slot is attended)")
    if entry.token_state is not None:
        problems.append("it holds token states of an input-dependent bias")
    if entry.first_slot != 0 or entry.evicted:
        problems.append("its keys do not start at the first slot (a window evicted some)")
    return problems


@dataclass(eq=False)
class SlotState:
    """One layer's fixed-shape decoding: its entry, the number of slots written (a 0-d int64 tensor)
    and the offset from a slot to its token's position (``[B, 1]`` int64). Both tensors change in
    place, so a compiled graph that reads them is never traced again."""

    entry: KVCacheEntry
    written: Tensor
    offset: Tensor

    @classmethod
    def start(cls, entry: KVCacheEntry) -> SlotState:
        """The state after ``entry``'s live tokens (the prompt)."""
        positions = entry.buffers()[2]
        state = cls(
            entry,
            torch.zeros((), dtype=torch.int64, device=positions.device),
            positions.new_zeros(positions.shape[0], 1),
        )
        state.continue_from(entry.k.shape[2])
        return state

    @property
    def capacity(self) -> int:
        return self.entry.buffers()[0].shape[2]

    def continue_from(self, length: int) -> None:
        """Write the next token at slot ``length``, at the position after the token in slot ``length - 1``
        (eager only: it reads the buffers' positions)."""
        positions = self.entry.buffers()[2]
        before = positions[:, length - 1 : length] + 1 - length if length else positions[:, :1] * 0
        self.written.fill_(length)
        self.offset.copy_(before)

    def positions(self) -> Tensor:
        """``[B, 1]``: the position of the token the next step writes."""
        return self.written.reshape(1, 1) + self.offset

    def write(self, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
        """Write one token's ``k``, ``v`` ``[B, Hkv, 1, D]`` at ``positions [B, 1]`` into the next slot;
        returns that slot (0-d int64: the mask shows the slots up to it). The count moves on after the
        attention reads it (:meth:`advance`)."""
        self.entry.write_at(self.written, k, v, positions)
        return self.written

    def advance(self) -> None:
        self.written.add_(1)

    def length(self) -> int:
        """The slots written (eager only)."""
        return int(self.written)
