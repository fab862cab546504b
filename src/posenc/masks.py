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

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from ._mask_segments import KeySegment, split_segments

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
    "PrefixLMMask",
    "SlidingWindowMask",
    "UserBoolMask",
    "and_masks",
    "convert_window",
    "or_masks",
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


# ---------------------------------------------------------------------------- window conventions
#: A window as the band it keeps: key ``j`` is visible from query ``i`` iff ``i - left <= j <= i +
#: right`` (FlashAttention's ``window_size=(left, right)``, both ends inclusive).
Band = tuple[int, int]


@dataclass(frozen=True)
class _Convention:
    """How one convention counts a window: ``to_band(value, causal)`` and ``from_band(band, causal)``."""

    to_band: Callable[[object, bool], Band]
    from_band: Callable[[Band, bool], object]


def _side(band: Band, causal: bool) -> int:
    """The band's left reach, after checking it is a posenc band: ``(left, 0)`` when ``causal``,
    ``(left, left)`` otherwise."""
    left, right = band
    if left < 0 or right != (0 if causal else left):
        shape = "(left, 0)" if causal else "(left, left)"
        raise ValueError(
            f"value: a {'causal' if causal else 'bidirectional'} posenc window is a band {shape} with "
            f"left >= 0, got {band}"
        )
    return left


def _count(value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"value must be an int >= {least} in this convention, got {value!r}")
    return value


def _flash_band(value: object, causal: bool) -> Band:
    if not (isinstance(value, tuple) and len(value) == 2 and all(type(v) is int for v in value)):
        raise ValueError(
            f"value must be FlashAttention's window_size, a tuple (left, right) of ints, got {value!r}"
        )
    if min(value) < 0:
        raise ValueError(
            f"value {value}: -1 is FlashAttention's 'no window'; give posenc window=None instead"
        )
    _side(value, causal)
    return value


def _kept_band(value: object, causal: bool) -> Band:
    kept = _count(value, 1)
    if causal:
        return kept - 1, 0
    if kept % 2 == 0:
        raise ValueError(
            f"value: a bidirectional window keeps an odd number of keys (2 * side + 1), got {kept}"
        )
    return (kept - 1) // 2, (kept - 1) // 2


#: The window conventions :func:`convert_window` converts between (docs/conventions.md §1.7):
#: ``"posenc"`` (the layer's ``window=W``: keys ``|i - j| < W``, with ``causal`` only
#: ``j <= i``), ``"hf"`` (the ``sliding_window`` HF's mask functions take: causal
#: ``sliding_window_overlay(W)`` keeps ``i - W < j <= i``, bidirectional
#: ``sliding_window_bidirectional_overlay(w)`` keeps ``|i - j| <= w``), ``"flash"`` (``window_size=
#: (left, right)``) and ``"keys"`` (the keys a query keeps away from the sequence ends, its own included).
WINDOW_CONVENTIONS: dict[str, _Convention] = {
    "posenc": _Convention(
        lambda w, causal: (_count(w, 1) - 1, 0 if causal else _count(w, 1) - 1),
        lambda band, causal: _side(band, causal) + 1,
    ),
    "hf": _Convention(
        lambda w, causal: (_count(w, 1) - 1, 0) if causal else (_count(w, 0), _count(w, 0)),
        lambda band, causal: _side(band, causal) + (1 if causal else 0),
    ),
    "flash": _Convention(_flash_band, lambda band, causal: (_side(band, causal), band[1])),
    "keys": _Convention(_kept_band, lambda band, causal: _side(band, causal) * (1 if causal else 2) + 1),
}


def convert_window(value: int | tuple[int, int], source: str, target: str, *, causal: bool):
    """A sliding window given in convention ``source`` as convention ``target`` (names in
    :data:`WINDOW_CONVENTIONS`), for a causal or a bidirectional layer.

    ``convert_window(4096, "hf", "flash", causal=True) == (4095, 0)``;
    ``convert_window(64, "hf", "posenc", causal=False) == 65`` (ModernBERT's ``local_attention=128``).
    A band no posenc window can express (an asymmetric bidirectional one, a causal one looking ahead)
    is a ValueError naming ``value``.
    """
    for name, convention in (("source", source), ("target", target)):
        if convention not in WINDOW_CONVENTIONS:
            raise ValueError(f"{name} must be one of {sorted(WINDOW_CONVENTIONS)}, got {convention!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    band = WINDOW_CONVENTIONS[source].to_band(value, causal)
    return WINDOW_CONVENTIONS[target].from_band(band, causal)


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


def _has_groups(group_ids: Tensor | None) -> bool:
    """Whether ``group_ids`` name a group (``-1`` everywhere, as in a decode step, is plain causal)."""
    if group_ids is None:
        return False
    return torch.compiler.is_compiling() or bool((group_ids >= 0).any())


def _left_padding(padding: Tensor | None) -> Tensor | None:
    """``[B]`` int64: the padding keys before each row's first real key (None when there are none)."""
    if padding is None:
        return None
    left = (~padding).long().cumsum(dim=1).eq(0).sum(dim=1)
    return left if torch.compiler.is_compiling() or bool(left.any()) else None


def _to_device(block: Tensor, device: torch.device) -> Tensor:
    return block if block.device == device else block.to(device)


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

        The caller validates the options (the attention layer names the parameter at fault).
        """
        components: list[MaskComponent] = []
        offset = int(causal_offset)
        if causal and prefix_len is not None:
            components.append(PrefixLMMask(prefix_len.to(device=device, dtype=torch.long), offset))
        elif causal and _has_groups(group_ids):
            components.append(BlockwiseCausalMask(group_ids.to(device=device, dtype=torch.long), offset))
        elif causal and offset < k_len - 1:
            # (offset >= k_len - 1: every query sees every key, as in a one-token decode step; a
            # mask that hides nothing would only cost its materialisation)
            components.append(CausalMask(offset))
        if window is not None:
            band = SlidingWindowMask if causal else BidirectionalWindowMask
            components.append(band(int(window), offset))
        if chunk is not None:
            components.append(ChunkMask(int(chunk), offset, _left_padding(key_padding_mask)))
        if q_document_ids is not None and k_document_ids is not None:
            components.append(DocumentMask(q_document_ids, k_document_ids))
        if key_padding_mask is not None:
            components.append(KeyPaddingMask(key_padding_mask))
        additive = None
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            components.append(UserBoolMask(attn_mask))
        elif attn_mask is not None:
            hidden = torch.isneginf(attn_mask)
            if torch.compiler.is_compiling() or bool(hidden.any()):  # a compiled graph reads no values
                components.append(UserBoolMask(~hidden))
                attn_mask = attn_mask.masked_fill(hidden, 0.0)
            additive = attn_mask
        return cls(q_len, k_len, batch, heads, torch.device(device), tuple(components), additive)

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
            block = _to_device(component.block(i0, i1, k0, k1, self.device), self.device)
            allowed = block if allowed is None else allowed & block
        return allowed

    def dense(self) -> Tensor | None:
        """Bool ``[B|1, H|1, Tq, Tk]``, True = may attend, or None when every pair may attend."""
        if "dense" not in self._memo:
            self._memo["dense"] = self.rows(0, self.q_len)
        return self._memo["dense"]

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
