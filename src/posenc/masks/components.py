"""The components an :class:`~posenc.masks.attention_mask.AttentionMask` is the AND of: causal, key padding,
sliding windows (causal and bidirectional), chunks, the written slots of a static cache and a user
bool mask. Each answers ``mod`` (FlexAttention's ``mask_mod``), ``block`` (dense rows against keys)
and ``key_range`` (the keys a row block can see); see :mod:`posenc.masks.attention_mask`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

__all__ = [
    "BidirectionalWindowMask",
    "CacheOffsetMask",
    "CausalMask",
    "ChunkMask",
    "KeyPaddingMask",
    "MaskComponent",
    "MaskFn",
    "SlidingWindowMask",
    "UserBoolMask",
    "WrittenSlotsMask",
    "and_masks",
    "left_padding_counts",
    "or_masks",
    "to_device",
]

#: ``(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend), FlexAttention's ``mask_mod``.
MaskFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def and_masks(*fns: MaskFn) -> MaskFn:
    """A mask function that allows a pair only when every ``fns`` allows it."""
    if not fns:
        raise ValueError("and_masks needs at least one mask function")

    def combined(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        keep = fns[0](b, h, q_idx, kv_idx)
        for fn in fns[1:]:
            keep = keep & fn(b, h, q_idx, kv_idx)
        return keep

    return combined


def or_masks(*fns: MaskFn) -> MaskFn:
    """A mask function that allows a pair when any of ``fns`` allows it."""
    if not fns:
        raise ValueError("or_masks needs at least one mask function")

    def combined(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        keep = fns[0](b, h, q_idx, kv_idx)
        for fn in fns[1:]:
            keep = keep | fn(b, h, q_idx, kv_idx)
        return keep

    return combined


class MaskComponent:
    """One condition on (query, key) pairs. Subclasses implement :meth:`mod` and :meth:`block`.

    Attributes:
        data_dependent: the component reads a tensor (padding, a user mask), so a FlexAttention block
            mask built from it cannot be reused for another call of the same shape.
        keeps_diagonal: query ``i`` always sees key ``i + offset`` in self-attention, so this component
            alone never hides a whole row.
    """

    data_dependent: bool = False
    keeps_diagonal: bool = False

    def mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def block(self, i0: int, i1: int, k0: int, k1: int, device: torch.device) -> Tensor:
        raise NotImplementedError

    def key_range(self, i0: int, i1: int, k_len: int) -> tuple[int, int]:
        """Keys ``lo:hi`` outside which rows ``i0:i1`` see nothing (default: all keys)."""
        return 0, k_len

    def describe(self) -> str:
        return type(self).__name__


class CacheOffsetMask(MaskComponent):
    """A component whose query ``i`` sits at key index ``i + offset`` (``offset`` = cached keys)."""

    offset: int

    @cached_property
    def _offset_tensor(self) -> Tensor:
        # A tensor, not an int, inside mask_mod: dynamo would specialise a compiled FlexAttention on
        # an int and recompile at every cache length.
        return torch.tensor(self.offset)

    def _query_index(self, q_idx: Tensor) -> Tensor:
        """The key index of query ``q_idx`` (FlexAttention's index tensors)."""
        return q_idx + self._offset_tensor.to(q_idx.device)


@dataclass(frozen=True)
class CausalMask(CacheOffsetMask):
    """Query ``i`` sees keys ``j <= i + offset`` (``offset`` = cached keys before the first query)."""

    offset: int = 0
    keeps_diagonal = True

    def mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= self._query_index(q_idx)

    def block(self, i0: int, i1: int, k0: int, k1: int, device: torch.device) -> Tensor:
        rows = torch.arange(i0, i1, device=device)[:, None] + self.offset
        return (torch.arange(k0, k1, device=device)[None, :] <= rows)[None, None]

    def key_range(self, i0: int, i1: int, k_len: int) -> tuple[int, int]:
        return 0, max(0, min(k_len, i1 + self.offset))

    def describe(self) -> str:
        return f"causal(offset={self.offset})"


@dataclass(frozen=True, eq=False)
class KeyPaddingMask(MaskComponent):
    """Keys where ``padding [B, Tk]`` is True are hidden from every query."""

    padding: Tensor
    data_dependent = True

    def mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ~self.padding[b, kv_idx]

    def block(self, i0: int, i1: int, k0: int, k1: int, device: torch.device) -> Tensor:
        return ~self.padding[:, None, None, k0:k1]

    def describe(self) -> str:
        return f"key_padding{list(self.padding.shape)}"


@dataclass(frozen=True, eq=False)
class WrittenSlotsMask(MaskComponent):
    """A preallocated cache's decode step: every query sees the slots ``j <= last`` (``last`` a 0-d
    int64 tensor, the step's own slot, so no row is empty); the slots after it are not written yet.

    A tensor, not an int: a compiled step reads the slot from the tensor and never recompiles."""

    last: Tensor
    data_dependent = True
    keeps_diagonal = True

    def mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= self.last

    def block(self, i0: int, i1: int, k0: int, k1: int, device: torch.device) -> Tensor:
        return (torch.arange(k0, k1, device=device) <= self.last)[None, None, None, :]

    def describe(self) -> str:
        return "written_slots(<= the step's slot)"


@dataclass(frozen=True)
class SlidingWindowMask(CacheOffsetMask):
    """Query ``i`` sees keys ``j > i + offset - window`` (with a causal mask: the last ``window`` keys
    up to and including its own, the HF / Mistral convention)."""

    window: int
    offset: int = 0
    keeps_diagonal = True

    def mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx > self._query_index(q_idx) - self.window

    def block(self, i0: int, i1: int, k0: int, k1: int, device: torch.device) -> Tensor:
        rows = torch.arange(i0, i1, device=device)[:, None] + self.offset - self.window
        return (torch.arange(k0, k1, device=device)[None, :] > rows)[None, None]

    def key_range(self, i0: int, i1: int, k_len: int) -> tuple[int, int]:
        return max(0, min(k_len, i0 + self.offset - self.window + 1)), k_len

    def describe(self) -> str:
        return f"window({self.window}, offset={self.offset})"


@dataclass(frozen=True)
class BidirectionalWindowMask(CacheOffsetMask):
    """Query ``i`` sees keys ``j`` with ``|j - (i + offset)| < window``: ``window - 1`` keys on each
    side and its own (a band; the causal :class:`SlidingWindowMask` is its lower half).

    HF's ``sliding_window_bidirectional_overlay(w)`` (ModernBERT, T5Gemma) keeps ``|i - j| <= w``:
    ``window = w + 1``; Gemma's bidirectional mode (``_bidirectional_window_overlay(s)``, EmbeddingGemma)
    keeps ``|i - j| < s``: ``window = s`` (docs/conventions.md §1.7).
    """

    window: int
    offset: int = 0
    keeps_diagonal = True

    def mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx - self._query_index(q_idx)).abs() < self.window

    def block(self, i0: int, i1: int, k0: int, k1: int, device: torch.device) -> Tensor:
        rows = torch.arange(i0, i1, device=device)[:, None] + self.offset
        return ((torch.arange(k0, k1, device=device)[None, :] - rows).abs() < self.window)[None, None]

    def key_range(self, i0: int, i1: int, k_len: int) -> tuple[int, int]:
        lo = i0 + self.offset - self.window + 1
        hi = i1 - 1 + self.offset + self.window
        return max(0, min(k_len, lo)), max(0, min(k_len, hi))

    def describe(self) -> str:
        return f"bidirectional_window({self.window}, offset={self.offset})"


@dataclass(frozen=True, eq=False)
class ChunkMask(CacheOffsetMask):
    """Query ``i`` sees keys in its own chunk: ``j // chunk == (i + offset) // chunk`` (Llama 4).

    ``left_padding [B]`` (int64, or None for zeros): chunks of batch row ``b`` start at its first real
    token, ``(j - p_b) // chunk == (i + offset - p_b) // chunk`` (HF's ``chunked_overlay``, batched
    generation of a left-padded batch).
    """

    chunk: int
    offset: int = 0
    left_padding: Tensor | None = None
    keeps_diagonal = True

    @property
    def data_dependent(self) -> bool:  # type: ignore[override]
        return self.left_padding is not None

    def _shift(self, b: Tensor) -> Tensor | int:
        return 0 if self.left_padding is None else self.left_padding[b]

    def mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        shift = self._shift(b)
        return (kv_idx - shift) // self.chunk == (self._query_index(q_idx) - shift) // self.chunk

    def block(self, i0: int, i1: int, k0: int, k1: int, device: torch.device) -> Tensor:
        shift = 0 if self.left_padding is None else self.left_padding.to(device)[:, None, None, None]
        rows = torch.arange(i0, i1, device=device)[:, None] + self.offset - shift
        keys = torch.arange(k0, k1, device=device)[None, :] - shift
        allowed = keys // self.chunk == rows // self.chunk
        return allowed if allowed.dim() == 4 else allowed[None, None]

    def key_range(self, i0: int, i1: int, k_len: int) -> tuple[int, int]:
        shifts = torch.zeros(1, dtype=torch.long) if self.left_padding is None else self.left_padding.cpu()
        lo = (i0 + self.offset - shifts) // self.chunk * self.chunk + shifts
        hi = ((i1 - 1 + self.offset - shifts) // self.chunk + 1) * self.chunk + shifts
        return max(0, min(k_len, int(lo.min()))), max(0, min(k_len, int(hi.max())))

    def describe(self) -> str:
        padded = "" if self.left_padding is None else ", left_padding"
        return f"chunk({self.chunk}, offset={self.offset}{padded})"


@dataclass(frozen=True, eq=False)
class UserBoolMask(MaskComponent):
    """A user's boolean mask ``[B|1, H|1, Tq, Tk]``, True = may attend."""

    allowed: Tensor
    data_dependent = True

    def mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        batch = b if self.allowed.shape[0] > 1 else torch.zeros_like(b)
        head = h if self.allowed.shape[1] > 1 else torch.zeros_like(h)
        return self.allowed[batch, head, q_idx, kv_idx]

    def block(self, i0: int, i1: int, k0: int, k1: int, device: torch.device) -> Tensor:
        return self.allowed[..., i0:i1, k0:k1]

    def describe(self) -> str:
        return f"attn_mask(bool){list(self.allowed.shape)}"


def left_padding_counts(padding: Tensor | None) -> Tensor | None:
    """``[B]`` int64: the padding keys before each row's first real key (None when there are none)."""
    if padding is None:
        return None
    left = (~padding).long().cumsum(dim=1).eq(0).sum(dim=1)
    return left if torch.compiler.is_compiling() or bool(left.any()) else None


def to_device(block: Tensor, device: torch.device) -> Tensor:
    return block if block.device == device else block.to(device)
