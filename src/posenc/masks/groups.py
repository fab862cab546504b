"""Mask components over groups of tokens: packed documents, a prefix LM's prefix and blockwise
bidirectional groups (Gemma 3's image tokens). Like every :class:`~posenc.masks.components.MaskComponent`,
each answers ``mod``, ``block`` and ``key_range``; :meth:`posenc.masks.attention_mask.AttentionMask.build` uses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from .components import CacheOffsetMask, MaskComponent

__all__ = ["BlockwiseCausalMask", "DocumentMask", "PrefixLMMask", "has_groups"]


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
class PrefixLMMask(CacheOffsetMask):
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
class BlockwiseCausalMask(CacheOffsetMask):
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


def has_groups(group_ids: Tensor | None) -> bool:
    """Whether ``group_ids`` name a group (``-1`` everywhere, as in a decode step, is plain causal)."""
    if group_ids is None:
        return False
    return torch.compiler.is_compiling() or bool((group_ids >= 0).any())
