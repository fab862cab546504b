"""The dispatcher's memo: ``auto``'s choice (or a forced backend's check), once per request signature.

:func:`~posenc.backends.select_backend` asks every backend in turn for its declines and limits; a
decode step asks the same question on every token. This module keys the answer on what the
built-in backends read from a request, and only for the requests where that is a short list:

* the encoding is ABSOLUTE, ROTARY or NONE-like (not BIAS, not CONTENT: those backends read the
  encoding's declarations, its parameters and the positions' values), with no token states;
* the mask is none or one causal component (any cache offset) with no float part (other masks'
  costs read their values: documents, padding, prefixes);
* every registered backend is a built-in one (a user's backend may read anything).

The key: the requested backend, the device type's order (``dispatch.PRIORITY`` as it stands: a
direct edit of it changes the answer as :func:`~posenc.backends.dispatch.set_priority` does), the
device, dtype and shapes of q, k and v, the kind, the causal offset, sinks (present or not), the
soft-cap, dropout > 0, need_weights, grad mode and whether anything requires grad. A small request
on CPU (``Tq * Tk`` under :data:`~posenc.backends.parts.query_blocks.MIN_AUTO_LOGITS`, where every backend
built on query blocks declines) leaves the number of keys out of the key (whether there are any stays
in) and counts the causal offset from the cache length (``offset - (Tk - Tq)``): no CPU backend's
limits or costs read them there, so a decode step, whose keys grow by one each token, is answered
from the memo (``tests/backends/test_memo.py`` compares the memo with a full selection for key
counts up to the threshold and past it). Elsewhere the key keeps both: the splits weigh a mask's
band against its pairs, and flex on an accelerator counts the shapes it compiled. ``has_nonfinite`` reads values: it is left out of the key, a choice is stored only when it was
made without finding nan or inf, and the caller tests it again on every hit.

:func:`bump` (``register_backend``, ``use_backend``) empties the memo; ``set_priority`` need not, as
the key carries the order.
"""

from __future__ import annotations

import torch

from ..encodings.base import Kind
from ..masks.attention_mask import CausalMask
from . import dispatch
from .parts import query_blocks

_MAX_ENTRIES = 512

_memo: dict[tuple, object] = {}
_state = {"generation": 0, "builtin_only": None}


def bump() -> None:
    """Forget every choice: the order, the registered backends or the forced one changed."""
    _state["generation"] += 1
    _state["builtin_only"] = None
    _memo.clear()


def generation() -> int:
    return _state["generation"]


def _builtin_only(backends: dict) -> bool:
    known = _state["builtin_only"]
    if known is None:
        known = all(type(b).__module__.startswith("posenc.backends.") for b in backends.values())
        _state["builtin_only"] = known
    return known


def signature(request, requested: str, backends: dict) -> tuple | None:
    """The memo key of ``request``, or None when its choice may depend on more than the key."""
    if request.token_states is not None or request.kind in (Kind.BIAS, Kind.CONTENT):
        return None
    mask = request.mask
    if mask.additive is not None:
        return None
    components = mask.components
    q, k, v = request.q, request.k, request.v
    # small on CPU: no backend's choice reads the number of keys or where the cache ends (docstring)
    small = q.device.type == "cpu" and q.shape[2] * k.shape[2] < query_blocks.MIN_AUTO_LOGITS
    if not components:
        causal = None
    elif len(components) == 1 and type(components[0]) is CausalMask:
        causal = components[0].offset - (k.shape[2] - q.shape[2] if small else 0)
    else:
        return None
    if not _builtin_only(backends):
        return None
    keys = (k.shape[:2], k.shape[3], v.shape[3], k.shape[2] > 0) if small else (k.shape, v.shape)
    return (
        requested,
        dispatch.listed_order(q.device.type),
        q.device,
        q.dtype,
        q.shape,
        keys,
        request.kind,
        causal,
        request.sinks is not None,
        request.softcap,
        request.dropout_p > 0,
        request.need_weights,
        torch.is_grad_enabled(),
        request.needs_grad,
    )


def lookup(key: tuple) -> object | None:
    return _memo.get(key)


def store(key: tuple, request, backend: object) -> None:
    """Remember ``backend`` for ``key`` unless the choice saw nan or inf (a value, not the key)."""
    if request.__dict__.get("has_nonfinite", False):
        return
    if len(_memo) >= _MAX_ENTRIES:
        _memo.clear()
    _memo[key] = backend
