"""Attention backends, the request they serve, and the dispatcher that picks one.

A backend implements ``reasons(request) -> list[str]``: the hard limits that stop it from serving
``request`` (empty when it can), optionally ``declines(request) -> list[str]``: costs that ``auto``
weighs but forcing ignores (a compile per shape, overhead on small problems), and
``run(request) -> (out, weights_or_None)``. The order in which ``auto`` tries them is one list per
device type in :mod:`posenc.backends.dispatch`. When none can serve a request, the error names the
request and every backend's reasons. Tests and users force a backend per layer (``backend="sdpa"``)
or for a block of code (``with posenc.backends.use_backend("eager"): ...``; called bare, from then on).

Masks are not a backend's business: ``request.mask`` (:class:`posenc.masks.attention_mask.AttentionMask`) says
which keys each query sees and materialises itself in the form each kernel takes. The request and
its field checks live in :mod:`.request`, its non-finite checks in :mod:`.finite`; this module
holds the protocol, the registry, forcing and selection.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
from torch import Tensor

from ..encodings.base import Kind
from . import memo as _memo
from .dispatch import listed_order, priority_list
from .parts.softcap import SOFTCAP_REASON
from .request import AttentionRequest

__all__ = [
    "INPUT_BIAS_REASON",
    "SOFTCAP_REASON",
    "AttentionRequest",
    "Backend",
    "NoBackendError",
    "auto_reasons",
    "available_backends",
    "backend_limits",
    "backend_reasons",
    "dispatch_state",
    "get_backend",
    "kind_reasons",
    "register_backend",
    "requested_backend",
    "select_backend",
    "use_backend",
]


class Backend(Protocol):
    """What an attention backend provides: every attribute the dispatcher reads.

    The capability flags default to False; :func:`register_backend` gives a backend that does not
    declare one the default, so dispatch reads them as plain attributes.
    """

    name: str
    #: The encoding kinds it serves at all: a fact the dispatcher checks before asking anything else
    #: (a request of another kind gets one reason naming them); default: every kind.
    kinds: frozenset[Kind] = frozenset(Kind)
    #: What its ``reasons`` and ``declines`` read of a request of those kinds (names of
    #: :data:`posenc.backends.memo.READS`): the dispatcher's memo keys on them. None (the default):
    #: undeclared, so no request of those kinds is remembered.
    reads: frozenset[str] | None = None
    #: It applies attention dropout (``request.dropout_p > 0``): a fact the dispatcher checks.
    serves_dropout: bool = False
    #: It evaluates input-dependent biases (FoX: ``request.token_states``); others read the
    #: encoding's position-only view, so :func:`backend_limits` refuses such requests for them.
    serves_input_bias: bool = False
    #: It applies logit soft-capping (``request.softcap``); a fused kernel that takes no logits cannot.
    serves_softcap: bool = False

    def reasons(self, request: AttentionRequest) -> list[str]:
        """Hard limits: why this backend cannot serve ``request``; empty when it can."""
        ...

    def declines(self, request: AttentionRequest) -> list[str]:
        """Costs: why ``auto`` should pass this backend over although it could serve ``request``.

        Forcing a backend ignores them. Backends without costs return an empty list.
        """
        ...

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        """``(out [B, H, Tq, D], weights [B, H, Tq, Tk] or None)``."""
        ...


def kind_reasons(request: AttentionRequest, kind: Kind) -> list[str]:
    """The reason a backend that serves only ``kind`` gives for any other encoding (empty if it fits)."""
    if request.kind is kind:
        return []
    return [f"serves {kind.name} encodings only; {request.encoding.name} is {request.kind.value}"]


#: Why a backend without ``serves_dropout = True`` refuses a request with attention dropout.
DROPOUT_REASON = "attention dropout is not implemented in this backend (sdpa and eager apply it)"

#: Why a backend without ``serves_input_bias = True`` refuses an input-dependent bias (FoX).
INPUT_BIAS_REASON = (
    "the bias depends on the layer input (token_states); this backend evaluates position-only biases"
)


def backend_limits(backend: Backend, request: AttentionRequest) -> list[str]:
    """``backend.reasons(request)`` plus the limits every backend shares, checked here once.

    A backend evaluates an input-dependent bias only when it says so (``serves_input_bias = True``);
    any other would read the encoding's position-only view and give silently wrong attention. Likewise
    it soft-caps logits (``request.softcap``) only when it says so (``serves_softcap = True``).
    """
    if request.kind in backend.kinds:
        reasons = list(backend.reasons(request))
    else:  # a fact: the backend is not asked
        served = ", ".join(k.value for k in Kind if k in backend.kinds)
        reasons = [f"serves {served} encodings only; {request.encoding.name} is {request.kind.value}"]
    if request.dropout_p > 0 and not backend.serves_dropout:
        reasons.append(DROPOUT_REASON)
    if request.token_states is not None and not backend.serves_input_bias:
        reasons.append(INPUT_BIAS_REASON)
    if request.softcap is not None and not backend.serves_softcap:
        reasons.append(SOFTCAP_REASON)
    return reasons


def auto_reasons(backend: Backend, request: AttentionRequest) -> list[str]:
    """Why ``auto`` passes over ``backend``: its limits (:func:`backend_limits`) plus its ``declines``."""
    return backend_limits(backend, request) + list(backend.declines(request))


class NoBackendError(ValueError, RuntimeError):
    """No backend can serve a request; the message names the request and every backend's reasons.

    A ValueError (the request asks for what the chosen backend cannot do) and, as before, a RuntimeError.
    """


_BACKENDS: dict[str, Backend] = {}


class _Forced(threading.local):
    """The backend :class:`use_backend` forces in this thread (None: none). A class attribute gives
    every thread its None without the AttributeError a missing thread-local attribute raises, which
    cost a decode step's dispatch a few microseconds."""

    name: str | None = None


_forced = _Forced()


#: The :class:`Backend` flags and their defaults, given at registration to a backend without them.
_FLAG_DEFAULTS = {
    "serves_dropout": False,
    "serves_input_bias": False,
    "serves_softcap": False,
    "kinds": frozenset(Kind),
    "reads": None,
}


def register_backend(backend: Backend) -> Backend:
    """Add a backend by its ``name``; :mod:`~posenc.backends.dispatch` says where ``auto`` tries it.

    A backend that does not declare a :class:`Backend` flag gets its default here (False; every kind;
    no declared reads, so the memo stays off for the kinds it serves).
    """
    missing = [m for m in ("reasons", "declines", "run") if not callable(getattr(backend, m, None))]
    if missing:
        raise TypeError(f"backend {backend!r} lacks {', '.join(missing)} (see posenc.backends.Backend)")
    for flag, default in _FLAG_DEFAULTS.items():
        if not hasattr(backend, flag):
            try:
                setattr(backend, flag, default)
            except AttributeError:  # __slots__ or a frozen object
                raise TypeError(
                    f"backend {backend!r} lacks {flag} and takes no attribute: declare {flag} = {default}"
                ) from None
    _memo.check_reads(backend.name, backend.reads)
    if not isinstance(backend.kinds, frozenset) or not all(isinstance(k, Kind) for k in backend.kinds):
        raise TypeError(f"backend {backend.name!r}: kinds must be a frozenset of Kind, got {backend.kinds!r}")
    _BACKENDS[backend.name] = backend
    _memo.bump()
    return backend


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backend names in the order ``auto`` tries them on ``device``."""
    _load_builtin()
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    # Asked on every request: remembered until the order or the registered backends change.
    key = (device_type, _memo.generation(), listed_order(device_type), len(_BACKENDS))
    order = _ORDERS.get(key)
    if order is None:
        order = _ORDERS[key] = tuple(priority_list(device_type, _BACKENDS))
        if len(_ORDERS) > 64:
            _ORDERS.clear()
            _ORDERS[key] = order
    return list(order)


_ORDERS: dict[tuple, tuple[str, ...]] = {}


def get_backend(name: str) -> Backend:
    _load_builtin()
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(_BACKENDS))} or 'auto'")
    return _BACKENDS[name]


class use_backend:  # lower case: called like a function, as torch.set_grad_enabled is
    """Force every attention layer in this thread to run on backend ``name``; ``"auto"`` undoes it.

    It acts when called, and works both ways, as ``torch.set_grad_enabled`` does:

    * ``posenc.use_backend("eager")`` forces ``eager`` from here on, until
      ``posenc.use_backend("auto")`` (or another name);
    * ``with posenc.use_backend("eager"): ...`` forces it inside the block, and on leaving the block
      (an exception included) restores what was forced before it (or nothing), undoing any bare call
      made inside.

    The setting belongs to the calling thread. A layer's own ``backend=`` yields to it. An unknown
    name is a ValueError that lists the backends, and changes nothing.
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"use_backend: name must be a backend name (a str), got {type(name).__name__}")
        if name != "auto":
            get_backend(name)
        self.name = name
        self.previous: str | None = _forced.name
        _forced.name = None if name == "auto" else name

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        _forced.name = self.previous

    def __repr__(self) -> str:
        return f"posenc.use_backend({self.name!r})"


def requested_backend(backend: str = "auto") -> str:
    """The backend a call asks for: the one :func:`use_backend` forces, else ``backend`` (a layer's)."""
    return _forced.name or backend


def dispatch_state(backend: str = "auto") -> tuple:
    """What a choice of backend depends on besides the request: the backend asked for (``backend``,
    or the one :func:`use_backend` forces), the registry's generation (any :func:`register_backend`,
    :func:`use_backend` or :func:`~posenc.backends.dispatch.set_priority` bumps it) and the CPU order
    as it stands. Equal states and equal requests get the same backend: a caller that remembers a
    choice keys it on this (:mod:`posenc.layers.step`)."""
    return (requested_backend(backend), _memo.generation(), listed_order("cpu"))


def backend_reasons(request: AttentionRequest, *, auto: bool = False) -> dict[str, list[str]]:
    """Every backend's reasons for ``request`` (empty list = can serve it), in ``auto``'s order.

    With ``auto=True`` the lists also hold what ``auto`` weighs (:func:`auto_reasons`).
    """
    order = available_backends(request.q.device)
    if auto:
        return {name: auto_reasons(get_backend(name), request) for name in order}
    return {name: backend_limits(get_backend(name), request) for name in order}


def select_backend(request: AttentionRequest, requested: str = "auto") -> Backend:
    """The backend to run ``request``: the forced or requested one, or the first with no reasons.

    The answer is remembered per request signature (:mod:`posenc.backends.memo`): a repeated
    decode step asks no backend again, only tests its new tokens for nan and inf.
    """
    _load_builtin()
    name = requested_backend(requested)
    key = _memo.signature(request, name, _BACKENDS)
    if key is not None:
        backend = _memo.lookup(key)
        if backend is not None and not (request.q.device.type == "cpu" and request.has_nonfinite):
            return backend  # type: ignore[return-value]
    backend = _select(request, name)
    if key is not None:
        _memo.store(key, request, backend)
    return backend


def _select(request: AttentionRequest, name: str) -> Backend:
    """:func:`select_backend` without the memo: every backend asked in turn."""
    if name != "auto":
        backend = get_backend(name)
        reasons = backend_limits(backend, request)
        if reasons:
            raise NoBackendError(
                f"backend {name!r} cannot run this request: "
                + "; ".join(reasons)
                + f"\n  request: {request.describe()}"
            )
        return backend
    for name in available_backends(request.q.device):
        candidate = get_backend(name)
        # Costs first: a backend that declines is passed over without stating its limits, which can
        # cost more to find (the clipped split reads tables that DeBERTa projects).
        if not candidate.declines(request) and not backend_limits(candidate, request):
            return candidate
    report = [
        f"{name}: " + "; ".join(reasons) for name, reasons in backend_reasons(request, auto=True).items()
    ]
    raise NoBackendError(
        f"no attention backend can run this request ({request.describe()}):\n  " + "\n  ".join(report)
    )


_LOADED = False


def _load_builtin() -> None:
    """Import every backend module of this package (importing one registers it)."""
    global _LOADED
    if _LOADED:  # once: a compiled forward cannot trace the module search
        return
    import importlib
    import pkgutil

    _LOADED = True
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_") and info.name not in ("dispatch", "run"):
            importlib.import_module(f"{__name__}.{info.name}")
