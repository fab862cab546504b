"""The plain decode step: one new token attended over a cache without building an attention
request, shared by :class:`~posenc.MultiheadAttention` and the HF bridge (``attn_implementation=
"posenc"``).

A decode step asks the same questions on every token (validate every argument, build the positions
and the mask, build and check a request, dispatch it), and at one query with no mask the answers
cannot change between tokens of one signature. This module is the one home of that shortcut:

- :func:`signature`: a call's own fields (shapes, dtypes, devices, scale, ...) followed by the
  dispatcher's state (:func:`posenc.backends.dispatch_state`: the backend asked for or forced, the
  registry's generation, the CPU order). Any of them changing makes a new signature.
- :func:`remember` / :func:`remembered`: each caller (a layer, an HF attention module) keeps the one
  signature its full path last served **on sdpa with every value finite**; only a call of that
  signature is served plainly.
- :func:`fresh_finite`: the nan test of q and the new key and value (and of the encoding's
  parameters), run before anything is written: a nan sends the call down the full path, to a backend
  that propagates it.
- :func:`attend`: sdpa over every key, called exactly as the sdpa backend calls it for an unmasked
  request (no mask: one query sees every cached key).

The number of cached keys is never in a signature: at one unmasked query no CPU backend's choice
reads it (``tests/layers/test_plain_step.py`` compares with a full selection past the dispatcher's size
threshold).

**The layer's use** (:func:`layer_signature`, :func:`layer_step`, :func:`remember_layer`). A plain
layer call is: self-attention, one token (``x [B, 1, E]``) on CPU, grad mode off, a non-streaming
cache whose entry holds no padding, documents, token states or unchecked keys, no ``attn_mask``,
``key_padding_mask``, ``document_ids``, ``prefix_len``, ``group_ids`` or ``need_weights``, a layer
without window, chunk, sinks, soft-cap, query temperature, K = V or dropout in training, and an
ABSOLUTE or ROTARY encoding that reads no token states. Its call fields: the input's shape, dtype
and device, the weights' dtype and device, the encoding (by identity), causality, scale, mode. The
step then does what the full path would:

1. ``cache.read``: the entry was written by this layer, in its current form, for this batch and
   device, and no :class:`~posenc.layers.decode.StaticDecodeStep` holds unsynced tokens in it;
2. the positions (``past + evicted``, or the caller's, checked against the encoding's range), the
   projections and the encoding's own act on them (``embed`` or ``rotate_fresh``);
3. :func:`fresh_finite`, then ``cache.append`` and the finite mark of the stored entry, then
   :func:`attend`.

**The HF bridge's use** (:mod:`posenc.hf`): one query, HF's positions already in q and k, no mask,
bias, sinks, soft-cap, window, dropout, weights or paged cache; its call fields are the shapes but
the key count, the dtypes and the scale. HF's cache already holds the new key, so the bridge also
checks that the keys before it are those its last call found finite, then runs
:func:`fresh_finite` on the last key and value and :func:`attend`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import dispatch_state
from ..backends.finite import all_finite, all_parameters, new_tokens_finite
from ..cache.kv_cache import KVCache
from ..encodings.base import Kind, checks_values
from .positions import arange_positions, checked_positions, embed_positions

__all__ = [
    "attend",
    "fresh_finite",
    "layer_signature",
    "layer_step",
    "remember",
    "remember_layer",
    "remembered",
    "signature",
]

_PLAIN_KINDS = (Kind.ABSOLUTE, Kind.ROTARY)
#: Where a caller (a layer, an HF attention module) keeps the signature its full path last served on
#: sdpa with finite values: a plain attribute of the module (``nn.Module.__setattr__`` costs a step 1%).
_SLOT = "_posenc_plain_signature"


# ---------------------------------------------------------------------------- shared by every caller
def signature(call: tuple, backend: str = "auto") -> tuple:
    """The signature of a plain decode call: the caller's ``call`` fields, then the dispatcher's state
    for ``backend`` (:func:`~posenc.backends.dispatch_state`)."""
    return (*call, *dispatch_state(backend))


def remember(owner: nn.Module, served: tuple | None) -> None:
    """Keep ``served`` as the signature ``owner``'s full path last served on sdpa with every value
    finite (None: forget it)."""
    owner.__dict__[_SLOT] = served


def remembered(owner: nn.Module) -> tuple | None:
    """The signature ``owner``'s full path last served on sdpa with finite values, or None."""
    return owner.__dict__.get(_SLOT)


def fresh_finite(
    q: Tensor, k: Tensor, v: Tensor, encoding: nn.Module | None = None
) -> tuple[bool, Tensor | None]:
    """The nan test of a plain step: ``(finite, block)`` for the query ``q [B, H, 1, D]``, the new key
    ``k`` and value ``v [B, Hkv, 1, D]`` (one block, one sum: a finite sum proves every element finite;
    one that is not may be an overflow, which the exact test settles), then ``encoding``'s floating
    parameters. ``block`` is :func:`~posenc.backends.finite.new_tokens_finite`'s copy of the three
    (None when it made none)."""
    finite, block = new_tokens_finite(q, k, v)
    if finite and encoding is not None:
        finite = all(not p.is_floating_point() or all_finite(p) for p in all_parameters(encoding))
    return finite, block


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """``out [B, H, 1, D]``: sdpa of ``q [B, H, 1, D]`` over every key of ``k``, ``v [B, Hkv, T, D]``,
    as the sdpa backend calls it for an unmasked request."""
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


# ---------------------------------------------------------------------------- the eager layer's use
def layer_signature(layer: nn.Module, x: object, cache: object) -> tuple | None:
    """The signature of a plain decode call of ``layer`` on ``x`` with ``cache`` (the module
    docstring), else None. The caller has checked that no other argument was given."""
    if not _plain_input(x, cache) or not _plain_layer(layer):
        return None
    weight = layer.q_proj.weight
    call = (x.shape, x.dtype, x.device, weight.dtype, weight.device, id(layer.encoding))
    return signature((*call, layer.causal, layer.scale, layer.training, layer.backend), layer.backend)


def _plain_input(x: object, cache: object) -> bool:
    """One token on CPU without gradients, a non-streaming posenc cache, values being checked."""
    return (
        type(x) is Tensor
        and x.dim() == 3
        and x.shape[1] == 1
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and type(cache) is KVCache
        and cache.recent_tokens is None
        and checks_values()
    )


def _plain_layer(layer: nn.Module) -> bool:
    """A layer whose attention is plain: no window, chunk, sinks, cap, temperature, K = V or training
    dropout, an ABSOLUTE or ROTARY encoding that reads no token states, and the layer's own steps."""
    if (
        layer.window is not None
        or layer.chunk is not None
        or layer.sinks is not None
        or layer.softcap is not None
        or layer.query_temperature is not None
        or layer.value_from_key
        or (layer.training and layer.dropout > 0)
    ):
        return False
    encoding = layer.encoding
    return encoding.kind in _PLAIN_KINDS and not encoding.input_dependent and _plain_class(type(layer))


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


def remember_layer(layer: nn.Module, called: tuple | None, backend: str, cache: KVCache) -> None:
    """After a full call of signature ``called``: keep it when it ran on sdpa and its entry is now
    known finite (the next call of that signature is served plainly); forget any other."""
    entry = cache.get(layer.layer_idx)
    served = called is not None and backend == "sdpa" and entry is not None and entry.finite.finite
    remember(layer, called if served else None)


def layer_step(layer: nn.Module, x: Tensor, positions: Tensor | None, cache: KVCache) -> Tensor | None:
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
    if not fresh_finite(q, k, v, encoding)[0]:
        return None
    k, v, _ = cache.append(layer, entry, k, v, q_pos, padding=None, document_ids=None, states=None)
    cache.get(layer.layer_idx).finite.finite = True  # the cached keys were, the new ones are
    out = attend(q, k, v, layer.scale)
    layer.__dict__["last_backend"] = "sdpa"
    return layer.out_proj(out.transpose(1, 2).reshape(batch, 1, layer.num_heads * layer.head_dim))
