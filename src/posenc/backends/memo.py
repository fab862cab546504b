"""The dispatcher's memo: ``auto``'s choice (or a forced backend's check), once per request signature.

:func:`~posenc.backends.select_backend` asks every backend in turn for its declines and limits; a
decode step asks the same question on every token. The memo keys the answer on **what the backends
declare they read**, so the key is a pure function of those declarations:

* each backend states the encoding kinds it serves at all (``kinds``, a fact the dispatcher checks
  before asking it anything) and what its ``reasons`` and ``declines`` read of a request of those
  kinds (``reads``: names of :data:`READS`);
* the key of a request is the union of ``reads`` over the backends that serve its kind, plus what
  the dispatcher itself reads (:data:`DISPATCHER_READS`), each read turned into a value by its
  entry in :data:`READS`; a read whose value is not a short fact (positions, a mask other than one
  causal component, the layer, token states) makes the request unkeyed: no memo;
* a registered backend that declares no ``reads`` (``None``) turns the memo off for the kinds it
  serves (it may read anything).

``tests/backends/test_memo.py`` runs every backend's ``reasons`` and ``declines`` on a request that
records the fields read (:data:`FIELDS` maps each field to its read) and fails on a read the backend
did not declare, so a new backend cannot get a stale choice.

The request's tensors are keyed by device, dtype and shapes, with one rule of values: a small request
on CPU (``Tq * Tk`` under :data:`~posenc.backends.parts.query_blocks.MIN_AUTO_LOGITS`, where every
backend built on query blocks declines) leaves the number of keys out (whether there are any stays in)
and counts the causal offset from the cache length (``offset - (Tk - Tq)``): no CPU backend's limits or
costs read them there, so a decode step, whose keys grow by one each token, is answered from the memo
(the tests compare the memo with a full selection across that threshold). ``has_nonfinite`` reads
values: it is never keyed; a choice is stored only when it was made without finding nan or inf, and
the caller tests it again on every hit. The requested backend, the device type's order
(``dispatch.PRIORITY`` as it stands) and the grad mode are always in the key.

:func:`bump` (``register_backend``, ``use_backend``) empties the memo; ``set_priority`` need not, as
the key carries the order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from ..encodings.base import Kind
from ..masks.attention_mask import CausalMask
from . import dispatch
from .parts import query_blocks

__all__ = ["DISPATCHER_READS", "FIELDS", "READS", "UNKEYED", "bump", "lookup", "signature", "store"]

_MAX_ENTRIES = 512

_memo: dict[tuple, object] = {}
_state: dict[str, Any] = {"generation": 0, "reads": {}}

#: A read whose value decides more than a short key can say: the request is not remembered.
UNKEYED = object()


def _tensors(request: Any, small: bool) -> Hashable:
    q, k, v = request.q, request.k, request.v
    keys = (k.shape[:2], k.shape[3], v.shape[3], k.shape[2] > 0) if small else (k.shape, v.shape)
    return (q.device, q.dtype, q.shape, keys)


def _mask(request: Any, small: bool) -> Hashable:
    mask = request.mask
    if mask.additive is not None:
        return UNKEYED
    components = mask.components
    if not components:
        return None
    if len(components) == 1 and type(components[0]) is CausalMask:
        return components[0].offset - (request.k.shape[2] - request.q.shape[2] if small else 0)
    return UNKEYED


def _encoding(request: Any, small: bool) -> Hashable:
    # Its class (what isinstance and the name tell) and which parameters train; a backend whose
    # choice reads an encoding's options declares "encoding_options", which is not keyed.
    # (Under no_grad no parameter's flag matters: a decode step does not walk them.)
    encoding = request.encoding
    if not torch.is_grad_enabled():
        return type(encoding)
    return (type(encoding), tuple(p.requires_grad for p in encoding.parameters()))


def _unkeyed_unless_none(field: str) -> Callable[[Any, bool], Hashable]:
    return lambda request, small: None if getattr(request, field) is None else UNKEYED


#: Every read a backend may declare, and the value the memo keys for it.
READS: dict[str, Callable[[Any, bool], Hashable]] = {
    "tensors": _tensors,  # q, k, v: device, dtype, shapes (the small-CPU rule above)
    "kind": lambda request, small: request.kind,
    "encoding": _encoding,
    "mask": _mask,
    "dropout": lambda request, small: request.dropout_p > 0,
    "need_weights": lambda request, small: request.need_weights,
    "sinks": lambda request, small: request.sinks is not None,
    "softcap": lambda request, small: request.softcap,
    "grad": lambda request, small: request.needs_grad,
    "scale": lambda request, small: request.scale,
    "token_states": _unkeyed_unless_none("token_states"),
    "layer": lambda request, small: UNKEYED,
    "encoding_options": lambda request, small: UNKEYED,
    "positions": lambda request, small: UNKEYED,  # their values (consecutive, whole, the same rows)
    "derived": lambda request, small: UNKEYED,  # whatever a backend computes and keeps on the request
    "nonfinite": lambda request, small: None,  # values: tested again on every hit (docstring)
}

#: What the dispatcher reads of every request before it asks a backend (``backend_limits``).
DISPATCHER_READS = frozenset({"kind", "dropout", "token_states", "softcap"})

#: Each field and method of :class:`~posenc.backends.request.AttentionRequest` a backend may use,
#: and the read it belongs to (``describe`` only words an error).
FIELDS: dict[str, str] = {
    **dict.fromkeys(("q", "k", "v", "q_len", "k_len", "num_heads", "kv_per_query_head"), "tensors"),
    "kind": "kind",
    **dict.fromkeys(("encoding", "input_bias"), "encoding"),
    **dict.fromkeys(("q_pos", "k_pos", "dense_bias"), "positions"),
    "mask": "mask",
    "dropout_p": "dropout",
    "need_weights": "need_weights",
    "sinks": "sinks",
    "softcap": "softcap",
    "needs_grad": "grad",
    "scale": "scale",
    "token_states": "token_states",
    "layer": "layer",
    "derived": "derived",
    **dict.fromkeys(("has_nonfinite", "known_finite_keys", "finite_mark"), "nonfinite"),
}


def check_reads(name: str, reads: object) -> None:
    """Refuse a backend's ``reads`` that is not None or a set of :data:`READS` names, naming them."""
    if reads is None:
        return
    if not isinstance(reads, (set, frozenset)) or not all(isinstance(r, str) for r in reads):
        raise TypeError(f"backend {name!r}: reads must be a frozenset of read names or None, got {reads!r}")
    unknown = sorted(set(reads) - set(READS))
    if unknown:
        raise ValueError(f"backend {name!r}: reads {unknown} are not among {', '.join(READS)}")


def bump() -> None:
    """Forget every choice: the order, the registered backends or the forced one changed."""
    _state["generation"] += 1
    _state["reads"] = {}
    _memo.clear()


def generation() -> int:
    return _state["generation"]


def reads_for(kind: Kind, backends: dict) -> frozenset[str] | None:
    """The reads that decide a request of ``kind``: the dispatcher's and those of every backend that
    serves the kind; None when one of those declares none."""
    union: set[str] = set(DISPATCHER_READS)
    for backend in backends.values():
        if kind not in backend.kinds:
            continue
        if backend.reads is None:
            return None
        union |= backend.reads
    return frozenset(union)


def _extractors(kind: Kind, backends: dict) -> tuple[Callable[[Any, bool], Hashable], ...] | None:
    """The :data:`READS` entries of :func:`reads_for`, in a fixed order, worked out once per kind
    until :func:`bump` (a decode step only calls them)."""
    known = _state["reads"]
    if kind not in known:
        reads = reads_for(kind, backends)
        known[kind] = None if reads is None else tuple(READS[name] for name in sorted(reads))
    return known[kind]


def signature(request, requested: str, backends: dict) -> tuple | None:
    """The memo key of ``request``, or None when its choice may depend on more than the key."""
    extractors = _extractors(request.kind, backends)
    if extractors is None:
        return None
    q, k = request.q, request.k
    small = q.device.type == "cpu" and q.shape[2] * k.shape[2] < query_blocks.MIN_AUTO_LOGITS
    key: list[Hashable] = [requested, dispatch.listed_order(q.device.type), torch.is_grad_enabled()]
    for read in extractors:
        value = read(request, small)
        if value is UNKEYED:
            return None
        key.append(value)
    return tuple(key)


def lookup(key: tuple) -> object | None:
    return _memo.get(key)


def store(key: tuple, request, backend: object) -> None:
    """Remember ``backend`` for ``key`` unless the choice saw nan or inf (a value, not the key)."""
    if request.__dict__.get("has_nonfinite", False):
        return
    if len(_memo) >= _MAX_ENTRIES:
        _memo.clear()
    _memo[key] = backend
