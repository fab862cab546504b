"""The position rules of the attention layers: which position each token gets, and what rides with it.

Positions are data, never a side effect (docs/conventions.md §1.3, §1.4): explicit positions, or
the defaults here, computed the same way by :class:`~posenc.MultiheadAttention`,
:class:`~posenc.MultiLatentAttention` and the model.

* :func:`default_positions`: ``past + arange(T)``, or counted from the padding mask (left padding);
* :func:`document_positions`: restarting at each packed document's first token;
* :func:`self_attention_positions`: the one of the two a self-attention call takes;
* :func:`read_step`: everything a self-attention call's new tokens get from its cache entry (the
  keys before them, their padding and documents over every key, their default positions), asked
  once by the layer; :func:`step_positions` the default positions alone, asked once by a model;
* :func:`padding_with_cache`, :func:`documents_with_cache`: a call's padding and document ids
  over every key, the cached ones first;
* :func:`prefix_lengths`: a prefix LM's ``prefix_len`` as ``[B]``;
* :func:`temperature_factors`: a position-dependent query scale (Llama 4's floored form, Inkling's
  continuous log form);
* :func:`embed_positions`: where ABSOLUTE encodings act.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..encodings.base import PositionalEncoding, checks_values
from ..kernels.position_ranges import arange_positions
from .temperature import TemperatureForm

if TYPE_CHECKING:
    from ..cache.entry import KVCacheEntry

__all__ = [
    "Step",
    "checked_positions",
    "default_positions",
    "document_positions",
    "documents_with_cache",
    "embed_positions",
    "padding_with_cache",
    "prefix_lengths",
    "read_step",
    "self_attention_positions",
    "step_positions",
    "temperature_factors",
]


def default_positions(
    q_len: int, past: int, padding: Tensor | None, device: torch.device, real_before: Tensor | None = None
) -> Tensor:
    """Positions ``[B or 1, q_len]`` of ``q_len`` new tokens after ``past`` earlier ones.

    ``past`` counts every earlier token, those a windowed cache has evicted included. Without
    padding, ``past + arange(q_len)``. With ``padding [B, S]`` (True = padding, left padding as HF
    ``generate`` and BLOOM use it) over the last ``S`` of the ``past + q_len`` tokens, a token's
    position counts the real tokens before it, so every sequence starts at 0 whatever its padding;
    the ``past + q_len - S`` tokens before the mask (evicted from a windowed cache) count as real,
    unless ``real_before [B]`` says how many of them were real (the cache evicted padded keys).
    """
    if padding is None:
        return arange_positions(past, q_len, device)
    before = past + q_len - padding.shape[1]
    if before < 0:
        raise ValueError(
            f"default_positions: the padding covers {padding.shape[1]} tokens, more than the "
            f"{past + q_len} of past={past} and q_len={q_len}"
        )
    real = (~padding).long()
    offset = before if real_before is None else real_before.to(device)[:, None]
    positions = (real.cumsum(dim=1) - 1 + offset).clamp(min=0)
    return positions[:, positions.shape[1] - q_len :]


def document_positions(document_ids: Tensor) -> Tensor:
    """Positions ``[B, T]`` that restart at 0 at each document's first token.

    ``document_ids [B, T]`` holds non-decreasing integer ids per row (packed documents).
    """
    length = document_ids.shape[1]
    index = torch.arange(length, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def self_attention_positions(
    q_len: int,
    past: int,
    evicted: int,
    padding: Tensor | None,
    docs: Tensor | None,
    device: torch.device,
    evicted_real: Tensor | None = None,
) -> Tensor:
    """The default positions of ``q_len`` new tokens after ``past`` cached ones (``evicted`` more
    dropped by a windowed cache, ``evicted_real [B]`` of them real when some were padding):
    restarting at each document with ``docs [B, past + q_len]``, else :func:`default_positions`
    (counted from ``padding`` when given)."""
    if docs is not None:
        return document_positions(docs)[:, past:]
    return default_positions(q_len, past + evicted, padding, device, evicted_real)


@dataclass(frozen=True)
class Step:
    """A self-attention call's new tokens as its cache entry sees them (:func:`read_step`)."""

    #: keys the cache holds before this call (0 without a cache)
    past: int
    #: ``[B, past + T]`` key padding (True = padding), cached keys first; None when nothing is padded
    padding: Tensor | None
    #: ``[B, past + T]`` document ids, cached keys first; None without packed documents
    documents: Tensor | None
    #: ``[B or 1, T]`` the positions the new tokens take when none are given
    positions: Tensor


def read_step(
    entry: KVCacheEntry | None,
    batch: int,
    q_len: int,
    key_padding_mask: Tensor | None,
    document_ids: Tensor | None,
    device: torch.device,
) -> Step:
    """The :class:`Step` of ``q_len`` new tokens after ``entry``'s keys (a layer's own entry, read
    and checked; None without a cache or before the first call): the keys it holds, those a window
    evicted and the real tokens among them decide the positions (:func:`self_attention_positions`),
    the call's ``key_padding_mask`` and ``document_ids`` are extended over the cached keys."""
    if entry is None:
        padding = padding_with_cache(key_padding_mask, None, batch, q_len)
        docs = documents_with_cache(document_ids, None, batch, q_len, device)
        return Step(0, padding, docs, self_attention_positions(q_len, 0, 0, padding, docs, device))
    past, evicted = entry.k.shape[2], entry.evicted
    padding = padding_with_cache(key_padding_mask, (past, entry.padding), batch, q_len, evicted)
    docs = documents_with_cache(document_ids, (past, entry.document_ids), batch, q_len, device)
    positions = self_attention_positions(q_len, past, evicted, padding, docs, device, entry.evicted_real)
    if entry.shift is not None:  # KVCache.shift_keys moved the keys, and the tokens after them
        positions = positions + entry.shift[:, None]
    return Step(past, padding, docs, positions)


def step_positions(
    entry: KVCacheEntry | None,
    batch: int,
    q_len: int,
    key_padding_mask: Tensor | None,
    document_ids: Tensor | None,
    device: torch.device,
    *,
    streaming: bool = False,
) -> Tensor:
    """The default positions ``[B or 1, q_len]`` of a call's new tokens after ``entry``'s keys, as
    :func:`read_step` gives them: what a model computes once and hands to every layer (``streaming``:
    a StreamingLLM cache, whose positions are the slots inside the cache). With ``document_ids``
    the padding does not enter the positions, and is not read."""
    if streaming and document_ids is None:
        past = 0 if entry is None else entry.k.shape[2]
        return arange_positions(past, q_len, device)
    padding = None if document_ids is not None else key_padding_mask
    return read_step(entry, batch, q_len, padding, document_ids, device).positions


def checked_positions(
    encoding: PositionalEncoding, given: Tensor | None, name: str, batch: int, length: int, default: Tensor
) -> Tensor:
    """``given`` positions (``[T]`` or ``[B, T]``, on ``default``'s device), or ``default``, checked
    against ``encoding``'s range; a ValueError names ``name`` when the shape is wrong."""
    if given is None:
        return encoding.check_positions(default, name=name)
    positions = encoding.check_positions(given, name=name)
    if positions.shape[-1] != length or positions.shape[0] not in (1, batch):
        raise ValueError(
            f"{name} must have shape [{length}] or [{batch}, {length}], got {tuple(given.shape)}"
        )
    return positions.to(default.device)


def padding_with_cache(
    mask: Tensor | None,
    cached: tuple[int, Tensor | None] | None,
    batch: int,
    q_len: int,
    evicted: int = 0,
) -> Tensor | None:
    """The key padding ``[B, past + q_len]`` (True = padding) of a call, or None when nothing is padded.

    ``cached`` is ``(past, cached padding or None)`` when a cache holds ``past`` tokens. ``mask`` may
    cover every key ``[B, past + q_len]``, after a cache only the new tokens ``[B, q_len]``, or,
    when a windowed cache evicted ``evicted`` tokens, every token since the first ``[B, evicted +
    past + q_len]`` (as HF's growing ``attention_mask``), whose evicted part is dropped.
    """
    past, previous = cached if cached is not None else (0, None)
    if mask is None:
        if previous is None:
            return None
        return torch.cat([previous, previous.new_zeros(batch, q_len)], dim=1)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = f"dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"key_padding_mask must be a bool tensor (True = padding), got {got}")
    if tuple(mask.shape) == (batch, past + q_len):
        return mask
    if evicted and tuple(mask.shape) == (batch, evicted + past + q_len):
        return mask[:, evicted:]
    if tuple(mask.shape) == (batch, q_len) and cached is not None:
        previous = previous if previous is not None else mask.new_zeros(batch, past)
        return torch.cat([previous, mask], dim=1)
    raise ValueError(
        f"key_padding_mask must have shape [B, Tk] = [{batch}, {past + q_len}] (or [{batch}, {q_len}] "
        f"for the new tokens of a cached step), got {tuple(mask.shape)}"
    )


def documents_with_cache(
    document_ids: Tensor | None,
    cached: tuple[int, Tensor | None] | None,
    batch: int,
    q_len: int,
    device: torch.device,
) -> Tensor | None:
    """Document ids of every key ``[B, past + q_len]`` (cached ones first), checked; or None.

    ``cached`` is ``(past, the cached keys' ids or None)`` when a cache holds ``past`` tokens, as for
    :func:`padding_with_cache`; ids given once must be given at every step.
    """
    previous = None if cached is None else cached[1]
    if document_ids is None:
        if previous is not None:
            raise ValueError(
                "document_ids: the cache was written with document ids; pass the new tokens' ids too"
            )
        return None
    if (
        not isinstance(document_ids, Tensor)
        or document_ids.dtype.is_floating_point
        or document_ids.dtype in (torch.bool, torch.complex64, torch.complex128)
    ):
        raise ValueError("document_ids must be an integer tensor [B, T] (one document id per token)")
    if tuple(document_ids.shape) != (batch, q_len):
        raise ValueError(
            f"document_ids must have shape [B, T] = [{batch}, {q_len}], got {tuple(document_ids.shape)}"
        )
    if cached is not None and previous is None:
        raise ValueError(
            "document_ids: the cache was written without document ids; pass them from the first step"
        )
    docs = document_ids.long().to(device)
    if previous is not None:
        docs = torch.cat([previous, docs], dim=1)
    if docs.shape[1] > 1 and checks_values() and bool((docs[:, 1:] < docs[:, :-1]).any()):
        raise ValueError(
            "document_ids must be non-decreasing along each row (packed documents are contiguous "
            "runs of one id), so that positions can restart at each document's first token"
        )
    return docs


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def prefix_lengths(prefix_len: int | Tensor, batch: int, k_len: int, device: torch.device) -> Tensor:
    """A prefix LM's ``prefix_len`` (an int, or ``[B]``) as ``[B]`` int64, checked against the keys."""
    if not (isinstance(prefix_len, Tensor) or _is_int(prefix_len)) and not (
        isinstance(prefix_len, (list, tuple)) and all(_is_int(n) for n in prefix_len)
    ):
        raise ValueError(
            f"prefix_len must be an int or an integer tensor [B] (the prefix length of each sequence), "
            f"got {prefix_len!r} ({type(prefix_len).__name__})"
        )
    lengths = torch.as_tensor(prefix_len, device=device)
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.dim() > 1:
        raise ValueError(f"prefix_len must be an int or an integer tensor [B], got {prefix_len!r}")
    lengths = lengths.long().expand(batch) if lengths.dim() == 0 else lengths.long()
    if lengths.shape != (batch,):
        raise ValueError(f"prefix_len must have shape [B] = [{batch}], got {tuple(lengths.shape)}")
    if checks_values() and (bool((lengths < 0).any()) or bool((lengths > k_len).any())):
        raise ValueError(f"prefix_len must be in [0, {k_len}] (the number of keys), got {lengths.tolist()}")
    return lengths


def temperature_factors(temperature: TemperatureForm, positions: Tensor) -> Tensor:
    """Query scales ``[B|1, 1, T, 1]`` (float32) of ``temperature`` at ``positions [B|1, T]``
    (:meth:`~posenc.layers.temperature.TemperatureForm.factors`)."""
    return temperature.factors(positions)


def embed_positions(encoding: PositionalEncoding, x: Tensor, positions: Tensor) -> Tensor:
    """ABSOLUTE encodings act here and nowhere else: ``x [B, T, E]`` plus the encoding of ``positions``.

    ``positions`` is ``[T]``, ``[1, T]`` or ``[B, T]``; it is checked against the encoding's range.
    A :class:`~posenc.MultiheadAttention` with an ABSOLUTE encoding calls it on its input; a model
    calls it once on the token embeddings.
    """
    positions = encoding.check_positions(positions)
    return encoding.embed(x, positions.expand(x.shape[0], -1))
