"""Attention masks: one object per request, small mask functions, a materialiser per consumer.

Which keys a query may see is decided here and nowhere else. A request's mask is the AND of small
*components* (causal with a cache offset, key padding, a user bool mask; document, window and chunk
masks fit the same mould). Each component answers three questions, one per kind of consumer:

* ``mod(b, h, q_idx, kv_idx) -> bool``: the FlexAttention ``mask_mod`` form (index tensors that
  broadcast against each other), as in HF ``masking_utils``; combine with :func:`and_masks` and
  :func:`or_masks`;
* ``block(i0, i1, k0, k1) -> bool [B|1, H|1, i1-i0, k1-k0]``: the rows ``i0:i1`` against keys
  ``k0:k1``, broadcastable, for the dense (eager, sdpa) and query-blocked (blocked, relative)
  backends;
* ``key_range(i0, i1) -> (lo, hi)``: the keys that any of the rows ``i0:i1`` can see lie in
  ``lo:hi``; a blocked backend skips the rest.

A user float mask (added to the logits) rides along as :attr:`AttentionMask.additive`; its ``-inf``
entries are moved into the boolean part, so every kernel sees finite numbers and one rule covers
"this key is hidden" whichever way the user said it.

**Rows that see no key.** A query row whose every key is hidden (left padding under a causal mask,
an all-False row of a user mask, an all ``-inf`` float row) has no softmax. Every backend gives such a
row an output of zeros, attention weights of zeros, and no gradient (the FlexAttention and
FlashAttention convention, and PyTorch's "safe softmax"). Backends compute whatever is cheapest for
those rows and then call :meth:`AttentionMask.zero_empty_rows`. The alternative some libraries use
(a uniform average over every key) would let a padded query read future keys in a causal layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._segments import KeySegment, split_segments
from .components import (
    BidirectionalWindowMask,
    CausalMask,
    ChunkMask,
    KeyPaddingMask,
    MaskComponent,
    MaskFn,
    SlidingWindowMask,
    UserBoolMask,
    WrittenSlotsMask,
    and_masks,
    left_padding_counts,
    or_masks,
    to_device,
)
from .groups import BlockwiseCausalMask, DocumentMask, PrefixLMMask, has_groups
from .keywords import MaskKeywordError, checked_attn_mask
from .window_conventions import WINDOW_CONVENTIONS, convert_window

__all__ = [
    "WINDOW_CONVENTIONS",
    "AttentionMask",
    "BidirectionalWindowMask",
    "BlockwiseCausalMask",
    "CausalMask",
    "ChunkMask",
    "DocumentMask",
    "KeyPaddingMask",
    "KeySegment",
    "MaskComponent",
    "MaskFn",
    "MaskKeywordError",
    "PrefixLMMask",
    "SlidingWindowMask",
    "UserBoolMask",
    "WrittenSlotsMask",
    "and_masks",
    "convert_window",
    "or_masks",
]


@dataclass(eq=False)
class AttentionMask:
    """Every mask of one attention call: the AND of :attr:`components`, plus a float :attr:`additive`.

    Build it with :meth:`build`. Shapes: ``q_len`` queries, ``k_len`` keys, batch ``batch``,
    ``heads`` query heads. All materialisers return tensors on :attr:`device`.
    """

    q_len: int
    k_len: int
    batch: int
    heads: int
    device: torch.device
    components: tuple[MaskComponent, ...] = ()
    #: Finite float values added to the logits ``[B|1, H|1, Tq, Tk]`` (a user float mask), or None.
    additive: Tensor | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        *,
        q_len: int,
        k_len: int,
        batch: int,
        heads: int,
        device: torch.device | str = "cpu",
        causal: bool = False,
        causal_offset: int = 0,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        window: int | None = None,
        chunk: int | None = None,
        q_document_ids: Tensor | None = None,
        k_document_ids: Tensor | None = None,
        prefix_len: Tensor | None = None,
        group_ids: Tensor | None = None,
    ) -> AttentionMask:
        """The mask of a request.

        Args:
            causal, causal_offset: query ``i`` sees keys ``j <= i + causal_offset``.
            key_padding_mask: bool ``[B, Tk]``, True = padding (hidden from every query).
            attn_mask: bool (True = may attend) or float (added to the logits; ``-inf`` hides the
                key), 4-D and broadcastable to ``[B, H, Tq, Tk]``.
            window: with ``causal``, query ``i`` sees keys ``j > i + causal_offset - window`` (sliding
                window); without, keys ``|j - (i + causal_offset)| < window`` (a band).
            chunk: query ``i`` sees keys of its own chunk, ``j // chunk == (i + causal_offset) // chunk``;
                with a ``key_padding_mask``, chunks start at each row's first real key (HF, Llama 4).
            q_document_ids, k_document_ids: ``[B, Tq]`` and ``[B, Tk]`` integer ids; a query sees keys
                of its own document only.
            prefix_len: ``[B]`` int; with ``causal``, keys ``j < prefix_len[b]`` are visible to every
                query (prefix LM: bidirectional prefix, causal after it).
            group_ids: ``[B, Tq]`` int; with ``causal``, queries also see the later keys of this call
                with their own non-negative group id (:class:`BlockwiseCausalMask`; ``-1``: no group).

        ``causal``, ``causal_offset``, ``key_padding_mask`` and ``attn_mask`` are checked here (a
        :class:`MaskKeywordError`, a ValueError, names the keyword at fault); the caller validates the
        other options (the attention layer names the parameter at fault).
        """
        device = torch.device(device)
        attn_mask = checked_attn_mask(
            q_len=q_len,
            k_len=k_len,
            batch=batch,
            heads=heads,
            device=device,
            causal=causal,
            causal_offset=causal_offset,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
        )
        offset = int(causal_offset)
        components = _causal_components(causal, offset, k_len, prefix_len, group_ids, device)
        if window is not None:
            band = SlidingWindowMask if causal else BidirectionalWindowMask
            components.append(band(int(window), offset))
        if chunk is not None:
            components.append(ChunkMask(int(chunk), offset, left_padding_counts(key_padding_mask)))
        if q_document_ids is not None and k_document_ids is not None:
            components.append(DocumentMask(q_document_ids, k_document_ids))
        if key_padding_mask is not None:
            components.append(KeyPaddingMask(key_padding_mask))
        additive = None if attn_mask is None else _user_mask(attn_mask, components)
        return cls(q_len, k_len, batch, heads, device, tuple(components), additive)

    # ------------------------------------------------------------------ questions
    @property
    def causal_offset(self) -> int | None:
        """The causal component's offset, or None when the mask is not causal."""
        for component in self.components:
            if isinstance(component, CausalMask):
                return component.offset
        return None

    @property
    def is_trivial(self) -> bool:
        """True when every query sees every key and nothing is added to the logits."""
        return not self.components and self.additive is None

    @property
    def is_plain_causal(self) -> bool:
        """Exactly ``is_causal`` of SDPA: causal with no offset, square, nothing else."""
        return (
            self.additive is None
            and len(self.components) == 1
            and self.causal_offset == 0
            and self.q_len == self.k_len
        )

    @property
    def data_dependent(self) -> bool:
        return any(c.data_dependent for c in self.components)

    def without(self, kind: type[MaskComponent]) -> AttentionMask:
        """This mask less its components of type ``kind`` (for a kernel that applies them itself)."""
        kept = tuple(c for c in self.components if not isinstance(c, kind))
        return AttentionMask(self.q_len, self.k_len, self.batch, self.heads, self.device, kept, self.additive)

    def key_range(self, i0: int, i1: int) -> tuple[int, int]:
        """Keys ``lo:hi`` outside which none of the query rows ``i0:i1`` sees anything.

        Memoised per mask: dispatch (costing a backend) and the blocked kernels (forward and backward)
        ask for the same blocks, and a document mask answers with a search per block.
        """
        key = ("key_range", i0, i1)
        if key not in self._memo:
            lo, hi = 0, self.k_len
            for component in self.components:
                c_lo, c_hi = component.key_range(i0, i1, self.k_len)
                lo, hi = max(lo, c_lo), min(hi, c_hi)
            self._memo[key] = (lo, max(lo, hi))
        return self._memo[key]

    def segments(self, i0: int, i1: int) -> tuple[KeySegment, ...]:
        """The keys rows ``i0:i1`` see, as at most three :class:`KeySegment` per batch row, in key order:
        an anticausal square, a middle run (full or masked) and a causal square, each left out when empty.

        Read from the boolean rows over :meth:`key_range`, so any combination of components works: a
        sliding window gives (anticausal, full, causal) away from the sequence start, a block inside
        one packed document (full, causal), anything irregular one masked run. Keys no row sees are
        trimmed from both ends. The user's float mask is not described here (its consumers add it).
        Memoised per mask.
        """
        key = ("segments", i0, i1)
        if key not in self._memo:
            self._memo[key] = self._find_segments(i0, i1)
        return self._memo[key]

    def _find_segments(self, i0: int, i1: int) -> tuple[KeySegment, ...]:
        lo, hi = self.key_range(i0, i1)
        if hi <= lo or i1 <= i0:
            return ()
        return split_segments(self.rows(i0, i1, lo, hi), i0, i1, lo, hi)

    def describe(self) -> str:
        parts = [c.describe() for c in self.components]
        if self.additive is not None:
            parts.append(f"attn_mask(float){list(self.additive.shape)}")
        return " & ".join(parts) or "none"

    # ------------------------------------------------------------------ materialisers
    def rows(self, i0: int, i1: int, k0: int = 0, k1: int | None = None) -> Tensor | None:
        """Bool ``[B|1, H|1, i1-i0, k1-k0]``, True = may attend, or None when every pair may attend."""
        k1 = self.k_len if k1 is None else k1
        allowed: Tensor | None = None
        for component in self.components:
            block = to_device(component.block(i0, i1, k0, k1, self.device), self.device)
            allowed = block if allowed is None else allowed & block
        return allowed

    def dense(self) -> Tensor | None:
        """Bool ``[B|1, H|1, Tq, Tk]``, True = may attend, or None when every pair may attend."""
        if "dense" not in self._memo:
            self._memo["dense"] = self.rows(0, self.q_len)
        return self._memo["dense"]

    def visible_keys(self, block: int = 512) -> Tensor:
        """``[B|1, H|1, Tq]`` int64: how many keys each query may attend to (a user's float mask hides
        none: its values are finite), counted ``block`` query rows at a time (memory ``O(block · Tk)``)."""
        counts = []
        for i0 in range(0, self.q_len, block):
            i1 = min(i0 + block, self.q_len)
            allowed = self.rows(i0, i1)
            if allowed is None:
                counts.append(torch.full((1, 1, i1 - i0), self.k_len, dtype=torch.int64, device=self.device))
            else:
                counts.append(allowed.sum(dim=-1, dtype=torch.int64))
        if not counts:
            return torch.zeros(1, 1, 0, dtype=torch.int64, device=self.device)
        shape = torch.broadcast_shapes(*(c.shape[:2] for c in counts))
        return torch.cat([c.expand(*shape, -1) for c in counts], dim=-1)

    def additive_rows(self, i0: int, i1: int, k0: int = 0, k1: int | None = None) -> Tensor | None:
        """The user's float mask for rows ``i0:i1`` and keys ``k0:k1``, or None."""
        if self.additive is None:
            return None
        return self.additive[..., i0:i1, k0 : self.k_len if k1 is None else k1]

    def dense_additive(self, dtype: torch.dtype) -> Tensor | None:
        """Everything as one float tensor: the user's float mask, ``finfo(dtype).min`` where hidden."""
        allowed = self.dense()
        if allowed is None and self.additive is None:
            return None
        mask = torch.zeros((), dtype=dtype, device=self.device)
        if self.additive is not None:
            mask = mask + self.additive.to(dtype)
        if allowed is not None:
            mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
        return mask

    def mask_mod(self) -> MaskFn | None:
        """The FlexAttention ``mask_mod`` of the boolean part, or None when nothing is hidden."""
        if not self.components:
            return None
        return and_masks(*(c.mod for c in self.components))

    def block_mask(self):
        """A FlexAttention ``BlockMask`` of the boolean part (None when nothing is hidden).

        Masks that read no tensor (causal alone) are cached by shape and offset.
        """
        mod = self.mask_mod()
        if mod is None:
            return None
        if self.data_dependent:
            return _create_block_mask(
                mod, self.batch, self._mask_heads(), self.q_len, self.k_len, self.device
            )
        key = (tuple(c.describe() for c in self.components), self.q_len, self.k_len, str(self.device))
        return _cached_block_mask(key, mod, self.q_len, self.k_len, self.device)

    def _mask_heads(self) -> int | None:
        per_head = any(isinstance(c, UserBoolMask) and c.allowed.shape[1] > 1 for c in self.components)
        return self.heads if per_head else None

    # ------------------------------------------------------------------ rows that see no key
    def empty_rows(self) -> Tensor | None:
        """Bool ``[B|1, H|1, Tq, 1]``, True for query rows that see no key; None when there are none."""
        if "empty" not in self._memo:
            self._memo["empty"] = self._find_empty_rows()
        return self._memo["empty"]

    def _find_empty_rows(self) -> Tensor | None:
        if self.q_len == 0:
            return None
        if self.k_len == 0:
            return torch.ones(1, 1, self.q_len, 1, dtype=torch.bool, device=self.device)
        if all(c.keeps_diagonal for c in self.components) and (
            self.causal_offset is None or self.causal_offset >= 0
        ):
            return None
        empty = self._empty_rows_cheaply()
        if empty is None:
            allowed = self.dense()
            empty = None if allowed is None else ~allowed.any(dim=-1, keepdim=True)
        if empty is None or (not torch.compiler.is_compiling() and not bool(empty.any())):
            return None  # (a compiled graph reads no values: it zeroes the rows the tensor names)
        return empty

    def _empty_rows_cheaply(self) -> Tensor | None:
        """Causal and key padding only: row ``i`` is empty when keys ``0..i+offset`` are all padding."""
        kinds = {type(c) for c in self.components}
        if not kinds <= {CausalMask, KeyPaddingMask} or KeyPaddingMask not in kinds:
            return None
        padding = next(c.padding for c in self.components if isinstance(c, KeyPaddingMask))
        real_keys = (~padding).long().cumsum(dim=1)  # [B, Tk]: real keys among 0..j
        offset = self.causal_offset
        if offset is None:
            last = torch.full((self.q_len,), self.k_len - 1, device=self.device)
        else:
            last = (torch.arange(self.q_len, device=self.device) + offset).clamp(max=self.k_len - 1)
        seen = real_keys[:, last.clamp(min=0)]  # [B, Tq]
        if offset is not None and offset < 0:
            seen = seen.masked_fill(last < 0, 0)
        return (seen == 0)[:, None, :, None]

    def zero_empty_rows(self, out: Tensor) -> Tensor:
        """``out [B, H, Tq, *]`` with the rows that see no key set to zero (no gradient flows there)."""
        empty = self.empty_rows()
        return out if empty is None else out.masked_fill(empty, 0.0)


_BLOCK_MASK_CACHE: dict[tuple, object] = {}
_MAX_CACHED_BLOCK_MASKS = 16


def _create_block_mask(mod: MaskFn, batch: int | None, heads: int | None, q_len: int, k_len: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mod, batch, heads, q_len, k_len, device=device)


def _cached_block_mask(key: tuple, mod: MaskFn, q_len: int, k_len: int, device):
    if key not in _BLOCK_MASK_CACHE:
        if len(_BLOCK_MASK_CACHE) >= _MAX_CACHED_BLOCK_MASKS:
            _BLOCK_MASK_CACHE.pop(next(iter(_BLOCK_MASK_CACHE)))
        _BLOCK_MASK_CACHE[key] = _create_block_mask(mod, None, None, q_len, k_len, device)
    return _BLOCK_MASK_CACHE[key]


def _causal_components(
    causal: bool,
    offset: int,
    k_len: int,
    prefix_len: Tensor | None,
    group_ids: Tensor | None,
    device: torch.device,
) -> list[MaskComponent]:
    """The causal part of a mask: a prefix LM's, a blockwise-causal one's, or the plain causal mask
    (none at all where it would hide nothing)."""
    if causal and prefix_len is not None:
        return [PrefixLMMask(prefix_len.to(device=device, dtype=torch.long), offset)]
    if causal and has_groups(group_ids):
        return [BlockwiseCausalMask(group_ids.to(device=device, dtype=torch.long), offset)]
    if causal and offset < k_len - 1:
        # (offset >= k_len - 1: every query sees every key, as in a one-token decode step; a
        # mask that hides nothing would only cost its materialisation)
        return [CausalMask(offset)]
    return []


def _user_mask(attn_mask: Tensor, components: list[MaskComponent]) -> Tensor | None:
    """A user's (checked) ``attn_mask``: a bool one joins ``components``; a float one is the additive
    part it returns, its ``-inf`` entries moved into ``components`` as a bool mask."""
    if attn_mask.dtype == torch.bool:
        components.append(UserBoolMask(attn_mask))
        return None
    hidden = torch.isneginf(attn_mask)
    if torch.compiler.is_compiling() or bool(hidden.any()):  # a compiled graph reads no values
        components.append(UserBoolMask(~hidden))
        attn_mask = attn_mask.masked_fill(hidden, 0.0)
    return attn_mask
