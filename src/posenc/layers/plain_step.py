"""The eager layer's plain decode step: one new token through :class:`~posenc.MultiheadAttention`
with a :class:`~posenc.KVCache`, without building an attention request.

A decode step asks the layer the same questions on every token (validate every argument, build the
positions and the mask, build and check a request, dispatch it), and at one query with no mask the
answers cannot change between tokens of one signature. :func:`plain_signature` is that signature;
the layer's full path records it (:func:`remember`) once it has served a call of that signature on
sdpa with every value finite. The next call with the same signature runs :func:`plain_step`:

1. ``cache.read``: the entry was written by this layer, in its current form, for this batch and
   device, and no :class:`~posenc.layers.decode.StaticDecodeStep` holds unsynced tokens in it (the full
   path's check, unchanged);
2. the positions (``past + evicted``, or the caller's, checked against the encoding's range), the
   projections and the encoding's own act on them (``embed`` or ``rotate_fresh``), as the full path;
3. the nan test of q and the new key and value (and of the encoding's parameters), before anything
   is written: a nan sends the call down the full path, to a backend that propagates it;
4. ``cache.append``, the finite mark of the stored entry, then sdpa over every key as the sdpa
   backend calls it for an unmasked request (no mask: one query sees every cached key).

A plain call is: self-attention, one token (``x [B, 1, E]``) on CPU, grad mode off, a non-streaming
cache whose entry holds no padding, documents, token states or unchecked keys, no ``attn_mask``,
``key_padding_mask``, ``document_ids``, ``prefix_len``, ``group_ids`` or ``need_weights``, a layer
without window, chunk, sinks, soft-cap, query temperature, K = V or dropout in training, and an
ABSOLUTE or ROTARY encoding that reads no token states. The signature holds what the full path
validated and chose by: the input's shape, dtype and device, the layer's weights' dtype and device,
its encoding (by identity), causality, scale, mode and requested backend, the backend forced by
:func:`~posenc.use_backend`, the dispatcher's generation (``register_backend``) and CPU order
(``set_priority``). Any of them changing sends the next call down the full path, which then records
the new signature. The number of cached keys is not in it: at one unmasked query no CPU backend's
choice reads it (``tests/test_plain_step.py`` compares with a full selection past the dispatcher's
size threshold).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends import memo, requested_backend
from ..backends.dispatch import listed_order
from ..backends.finite import all_finite, all_parameters, new_tokens_finite
from ..cache.kv_cache import KVCache
from ..encodings.base import Kind, checks_values
from .positions import arange_positions, checked_positions, embed_positions

__all__ = ["plain_signature", "plain_step", "remember"]

_PLAIN_KINDS = (Kind.ABSOLUTE, Kind.ROTARY)
#: Where the layer keeps the last signature its full path served on sdpa (a plain attribute).
_SLOT = "_plain_step_signature"


def plain_signature(layer, x: object, cache: object) -> tuple | None:
    """The signature of a plain decode call of ``layer`` on ``x`` with ``cache`` (the module
    docstring), else None. The caller has checked that no other argument was given."""
    if (
        type(x) is not Tensor
        or x.dim() != 3
        or x.shape[1] != 1
        or x.device.type != "cpu"
        or torch.is_grad_enabled()
        or type(cache) is not KVCache
        or cache.recent_tokens is not None
        or not checks_values()
    ):
        return None
    if (
        layer.window is not None
        or layer.chunk is not None
        or layer.sinks is not None
        or layer.softcap is not None
        or layer.query_temperature is not None
        or layer.value_from_key
        or (layer.training and layer.dropout > 0)
    ):
        return None
    encoding = layer.encoding
    if encoding.kind not in _PLAIN_KINDS or encoding.input_dependent or not _plain_class(type(layer)):
        return None
    weight = layer.q_proj.weight
    return (
        x.shape,
        x.dtype,
        x.device,
        weight.dtype,
        weight.device,
        id(encoding),
        layer.causal,
        layer.scale,
        layer.training,
        layer.backend,
        requested_backend(layer.backend),
        memo.generation(),
        listed_order("cpu"),
    )


#: The steps of ``MultiheadAttention.forward`` a plain step stands in for: a subclass that overrides
#: one (the KV-sharing layers' donor handoff and borrowed entry) keeps the full path.
_REPLACED_STEPS = ("_self_inputs", "_new_keys", "_cache_entry", "_mask", "_attend", "_streaming_inputs")
_PLAIN_CLASSES: dict[type, bool] = {}


def _plain_class(cls: type) -> bool:
    """Whether ``cls`` runs ``MultiheadAttention``'s own steps (computed once per class): each step is
    the one its first definer wrote, the deepest class of the MRO that has it (``MultiheadAttention``
    for every layer that calls this), so a subclass that overrides one keeps the full path. Read off
    the MRO rather than named: this module is imported by the layer's."""
    known = _PLAIN_CLASSES.get(cls)
    if known is None:
        known = all(getattr(cls, name) is _first_definition(cls, name) for name in _REPLACED_STEPS)
        _PLAIN_CLASSES[cls] = known
    return known


def _first_definition(cls: type, name: str) -> object:
    """``name`` as the deepest class of ``cls``'s MRO defines it."""
    return next(vars(klass)[name] for klass in reversed(cls.__mro__) if name in vars(klass))


def remember(layer, signature: tuple | None, backend: str, cache: KVCache) -> None:
    """After a full call of ``signature``: keep it when it ran on sdpa and its entry is now known
    finite (the next call of that signature is served plainly); forget any other."""
    entry = cache.get(layer.layer_idx)
    served = signature is not None and backend == "sdpa" and entry is not None and entry.finite.finite
    layer.__dict__[_SLOT] = signature if served else None


def remembered(layer) -> tuple | None:
    """The signature ``layer``'s full path last served on sdpa, or None."""
    return layer.__dict__.get(_SLOT)


def plain_step(layer, x: Tensor, positions: Tensor | None, cache: KVCache) -> Tensor | None:
    """One plain decode step of ``layer``: ``out [B, 1, E]`` for ``x [B, 1, E]``, the token's key and
    value appended to ``cache``; None (nothing written) when the call needs the full path: an entry
    the plain step cannot extend, positions on another device, or a value that is not finite."""
    batch = x.shape[0]
    entry = cache.read(layer, cross=False, batch=batch, device=x.device)
    if (
        entry is None
        or not entry.finite.finite
        or entry.padding is not None
        or entry.document_ids is not None
        or entry.evicted_real is not None
        or entry.token_state is not None
    ):
        return None
    encoding = layer.encoding
    if positions is None:
        q_pos = encoding.check_positions(arange_positions(entry.k.shape[2] + entry.evicted, 1, x.device))
    elif type(positions) is Tensor and positions.device == x.device:
        q_pos = checked_positions(encoding, positions, "positions", batch, 1, positions)
    else:
        return None
    if encoding.kind is Kind.ABSOLUTE:
        x = embed_positions(encoding, x, q_pos)
    q, k, v = layer.project(x)
    if encoding.kind is Kind.ROTARY:
        q, k = encoding.rotate_fresh(q, k, q_pos, q_pos)
    if not _finite(q, k, v, encoding):
        return None
    k, v, _ = cache.append(layer, entry, k, v, q_pos, padding=None, document_ids=None, states=None)
    cache.get(layer.layer_idx).finite.finite = True  # the cached keys were, the new ones are
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=layer.scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    layer.__dict__["last_backend"] = "sdpa"
    return layer.out_proj(out.transpose(1, 2).reshape(batch, 1, layer.num_heads * layer.head_dim))


def _finite(q: Tensor, k: Tensor, v: Tensor, encoding) -> bool:
    """The request's nan test of a plain step: q, the new key and value (one block, one sum: a
    finite sum proves every element finite; one that is not may be an overflow, which the exact
    test settles), then the encoding's parameters."""
    if not new_tokens_finite(q, k, v)[0]:
        return False
    return all(not p.is_floating_point() or all_finite(p) for p in all_parameters(encoding))
