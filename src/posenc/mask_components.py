"""The components an :class:`~posenc.masks.AttentionMask` is the AND of: causal, key padding,
sliding windows (causal and bidirectional), chunks, documents, a prefix, blockwise groups and a user
bool mask. Each answers ``mod`` (FlexAttention's ``mask_mod``), ``block`` (dense rows against keys)
and ``key_range`` (the keys a row block can see); see :mod:`posenc.masks`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

__all__ = [
    "BidirectionalWindowMask",
    "BlockwiseCausalMask",
    "CausalMask",
    "ChunkMask",
    "DocumentMask",
    "KeyPaddingMask",
    "MaskComponent",
    "MaskFn",
    "PrefixLMMask",
    "SlidingWindowMask",
    "UserBoolMask",
    "WrittenSlotsMask",
    "and_masks",
    "has_groups",
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


class _CacheOffset(MaskComponent):
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
class CausalMask(_CacheOffset):
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
class SlidingWindowMask(_CacheOffset):
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
class BidirectionalWindowMask(_CacheOffset):
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
class ChunkMask(_CacheOffset):
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
class DocumentMask(MaskComponent):
    """Tokens see keys of their own document only: ``q_docs[b, i] == k_docs[b, j]``.

    ``q_docs [B, Tq]`` and ``k_docs [B, Tk]`` are integer document ids, non-decreasing along each row
    (packed documents are contiguous), which is what lets :meth:`key_range` skip other documents.
    """

    q_docs: Tensor
    k_docs: Tensor
    data_dependent = True
    keeps_diagonal = True

    def mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.q_docs[b, q_idx] == self.k_docs[b, kv_idx]

    def block(self, i0: int, i1: int, k0: int, k1: int, device: torch.device) -> Tensor:
        return self.q_docs[:, None, i0:i1, None] == self.k_docs[:, None, None, k0:k1]

    def key_range(self, i0: int, i1: int, k_len: int) -> tuple[int, int]:
        if i1 <= i0:
            return 0, 0
        keys = self.k_docs.contiguous()
        first = torch.searchsorted(keys, self.q_docs[:, i0 : i0 + 1].contiguous(), right=False)
        last = torch.searchsorted(keys, self.q_docs[:, i1 - 1 : i1].contiguous(), right=True)
        return int(first.min()), int(last.max())

    def describe(self) -> str:
        return f"documents{list(self.k_docs.shape)}"


@dataclass(frozen=True, eq=False)
class PrefixLMMask(_CacheOffset):
    """Causal after a bidirectional prefix: query ``i`` sees ``j <= i + offset`` or ``j < prefix_len[b]``."""

    prefix_len: Tensor  # [B] int64
    offset: int = 0
    data_dependent = True
    keeps_diagonal = True

    def mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        causal = kv_idx <= self._query_index(q_idx)
        return causal | (kv_idx < self.prefix_len[b])

    def block(self, i0: int, i1: int, k0: int, k1: int, device: torch.device) -> Tensor:
        rows = torch.arange(i0, i1, device=device)[:, None] + self.offset
        keys = torch.arange(k0, k1, device=device)[None, :]
        return (keys <= rows)[None, None] | (keys < self.prefix_len[:, None, None, None])

    def key_range(self, i0: int, i1: int, k_len: int) -> tuple[int, int]:
        longest = int(self.prefix_len.max()) if self.prefix_len.numel() else 0
        return 0, max(0, min(k_len, max(i1 + self.offset, longest)))

    def describe(self) -> str:
        return f"prefix_lm(offset={self.offset})"


@dataclass(frozen=True, eq=False)
class BlockwiseCausalMask(_CacheOffset):
    """Causal, except that tokens of one group see each other (Gemma 3 / 4 image tokens, HF's
    ``or_masks(causal_mask_function, blockwise_overlay(block_sequence_ids))``).

    ``groups [B, Tq]`` (int64) are the group ids of this call's tokens, ``-1`` for none: query ``i``
    sees key ``j`` when ``j <= i + offset``, or when key ``j`` is token ``t = j - offset`` of this call
    and ``groups[b, t] == groups[b, i] >= 0``. The cached keys (``j < offset``) precede every query,
    so their ids are never read: a cache keeps none.
    """

    groups: Tensor
    offset: int = 0
    data_dependent = True
    keeps_diagonal = True

    @cached_property
    def _reach(self) -> Tensor:
        """``[B, Tq]``: the last token of this call that token ``t`` sees through its group (``t`` itself
        when it has none)."""
        batch, length = self.groups.shape
        tokens = torch.arange(length, device=self.groups.device).expand(batch, length)
        rows = torch.arange(batch, device=self.groups.device)[:, None].expand(batch, length)
        ids, inverse = torch.unique(torch.stack((rows, self.groups)).flatten(1), dim=1, return_inverse=True)
        last = torch.full((ids.shape[1],), -1, dtype=torch.long, device=self.groups.device)
        last = last.scatter_reduce(0, inverse, tokens.flatten(), reduce="amax")
        return torch.where(self.groups >= 0, last[inverse].view(batch, length), tokens)

    def _same_group(self, q_groups: Tensor, k_tokens: Tensor, k_groups: Tensor) -> Tensor:
        in_call = (k_tokens >= 0) & (k_tokens < self.groups.shape[1])
        return (q_groups >= 0) & (q_groups == k_groups) & in_call

    def mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        tokens = kv_idx - self._offset_tensor.to(kv_idx.device)
        k_groups = self.groups[b, tokens.clamp(0, self.groups.shape[1] - 1)]
        causal = kv_idx <= self._query_index(q_idx)
        return causal | self._same_group(self.groups[b, q_idx], tokens, k_groups)

    def block(self, i0: int, i1: int, k0: int, k1: int, device: torch.device) -> Tensor:
        groups = self.groups.to(device)
        rows = torch.arange(i0, i1, device=device)[:, None] + self.offset
        keys = torch.arange(k0, k1, device=device)[None, :]
        tokens = keys - self.offset
        k_groups = groups[:, tokens[0].clamp(0, groups.shape[1] - 1)]  # [B, keys]
        same = self._same_group(groups[:, i0:i1, None], tokens[None], k_groups[:, None, :])
        return ((keys <= rows)[None] | same)[:, None]

    def key_range(self, i0: int, i1: int, k_len: int) -> tuple[int, int]:
        if i1 <= i0:
            return 0, 0
        reach = int(self._reach[:, i0:i1].max()) + self.offset + 1
        return 0, max(0, min(k_len, max(i1 + self.offset, reach)))

    def describe(self) -> str:
        return f"blockwise_causal{list(self.groups.shape)}(offset={self.offset})"


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


def has_groups(group_ids: Tensor | None) -> bool:
    """Whether ``group_ids`` name a group (``-1`` everywhere, as in a decode step, is plain causal)."""
    if group_ids is None:
        return False
    return torch.compiler.is_compiling() or bool((group_ids >= 0).any())


def left_padding_counts(padding: Tensor | None) -> Tensor | None:
    """``[B]`` int64: the padding keys before each row's first real key (None when there are none)."""
    if padding is None:
        return None
    left = (~padding).long().cumsum(dim=1).eq(0).sum(dim=1)
    return left if torch.compiler.is_compiling() or bool(left.any()) else None


def to_device(block: Tensor, device: torch.device) -> Tensor:
    return block if block.device == device else block.to(device)
