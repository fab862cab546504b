"""Attention backends, the request they serve, and the dispatcher that picks one.

A backend implements ``reasons(request) -> list[str]``: the hard limits that stop it from serving
``request`` (empty when it can), optionally ``declines(request) -> list[str]``: costs that ``auto``
weighs but forcing ignores (a compile per shape, overhead on small problems), and
``run(request) -> (out, weights_or_None)``. The order in which ``auto`` tries them is one list per
device type in :mod:`posenc.backends.dispatch`. When none can serve a request, the error names the
request and every backend's reasons. Tests and users force a backend per layer (``backend="sdpa"``)
or for a block of code (``with posenc.backends.use_backend("eager"): ...``).

Masks are not a backend's business: ``request.mask`` (:class:`posenc.masks.AttentionMask`) says
which keys each query sees and materialises itself in the form each kernel takes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch
from torch import Tensor, nn

from ..base import Kind, PositionalEncoding, TokenStates
from ..masks import AttentionMask

__all__ = [
    "INPUT_BIAS_REASON",
    "AttentionRequest",
    "Backend",
    "NoBackendError",
    "auto_reasons",
    "available_backends",
    "backend_limits",
    "backend_reasons",
    "get_backend",
    "kind_reasons",
    "register_backend",
    "select_backend",
    "use_backend",
]


def _all_finite(t: Tensor) -> bool:
    """Whether every element of the floating tensor ``t`` is finite, in one reduction.

    A finite sum means every element is finite (nan and inf propagate, and ``inf − inf`` is nan); a
    sum that is not finite may also be an overflow, so only then is each element tested. The sum
    accumulates in float64 where the device has it, so float32 inputs cannot overflow it.
    ``torch.isfinite(t).all()`` alone makes three full-size temporaries (``abs`` and two comparisons):
    15% of a long DeBERTa forward on CPU, paid by every request a CPU backend checks.
    """
    wide = torch.float64 if t.device.type in ("cpu", "cuda") else None
    return bool(torch.isfinite(t.sum(dtype=wide))) or bool(torch.isfinite(t).all())


@dataclass
class AttentionRequest:
    """Everything a backend needs for one attention call.

    Shapes: ``q [B, H, Tq, D]``; ``k [B, Hkv, Tk, D]`` and ``v [B, Hkv, Tk, Dv]`` (``H`` a multiple
    of ``Hkv``; ``Dv`` equals ``D`` except for multi-head latent attention, which only the ABSOLUTE
    path of sdpa and eager serves);
    ``q_pos [B or 1, Tq]`` and ``k_pos [B or 1, Tk]`` int64 positions.

    The mask is :attr:`mask` (:class:`~posenc.masks.AttentionMask`). Give it directly, or describe it
    with the keyword fields, from which it is built: ``causal`` and ``causal_offset`` (the key index of
    the first query, i.e. the cache length: query ``i`` sees keys ``j <= i + offset``),
    ``key_padding_mask [B, Tk]`` (bool, True = padding) and ``attn_mask`` (bool, True = may attend,
    or float added to the logits; 4-D, broadcastable to ``[B, H, Tq, Tk]``).

    An input-dependent bias (FoX) needs ``token_states`` (:class:`~posenc.base.TokenStates`, from the
    encoding's ``token_states`` of the layer input); only backends with ``serves_input_bias`` run it.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    encoding: PositionalEncoding
    q_pos: Tensor
    k_pos: Tensor
    scale: float
    causal: bool = False
    causal_offset: int = 0
    key_padding_mask: Tensor | None = None
    attn_mask: Tensor | None = None
    dropout_p: float = 0.0
    need_weights: bool = False
    layer: nn.Module | None = None
    mask: AttentionMask = field(default=None, repr=False)  # type: ignore[assignment]
    #: Attention sinks: one logit per query head ``[H]`` in every row's softmax denominator, or None.
    sinks: Tensor | None = None
    #: Input-dependent biases (FoX): the queries' and keys' states the bias is computed from.
    token_states: TokenStates | None = None

    def __post_init__(self) -> None:
        self._check_token_states()
        if self.mask is None:
            self.mask = AttentionMask.build(
                q_len=self.q_len,
                k_len=self.k_len,
                batch=self.q.shape[0],
                heads=self.num_heads,
                device=self.q.device,
                causal=self.causal,
                causal_offset=self.causal_offset,
                key_padding_mask=self.key_padding_mask,
                attn_mask=self.attn_mask,
            )

    def _check_token_states(self) -> None:
        needs = self.encoding.input_dependent
        states = self.token_states
        if needs and states is None:
            raise ValueError(
                f"token_states: {self.encoding.name!r} computes its bias from the layer input; pass "
                "token_states (posenc.base.TokenStates of encoding.token_states(x)), or call the layer"
            )
        if not needs and states is not None:
            raise ValueError(f"token_states: {self.encoding.name!r} is not an input-dependent bias")
        if states is None:
            return
        batch = self.q.shape[0]
        want = {"q": (self.q_len, states.q), "k": (self.k_len, states.k)}
        for side, (length, tensor) in want.items():
            if tensor.dim() != 3 or tensor.shape[0] != batch or tensor.shape[2] != length:
                raise ValueError(
                    f"token_states.{side} must have shape [B, S, T{side}] = [{batch}, S, {length}], "
                    f"got {tuple(tensor.shape)}"
                )
        if states.q_index.shape != (self.q_len,) or states.k_index.shape != (self.k_len,):
            raise ValueError(
                f"token_states: q_index and k_index must have shapes [{self.q_len}] and [{self.k_len}], got "
                f"{tuple(states.q_index.shape)} and {tuple(states.k_index.shape)}"
            )

    @property
    def kind(self) -> Kind:
        return self.encoding.kind

    def dense_bias(self) -> Tensor:
        """The bias ``[B or 1, H, Tq, Tk]`` of a BIAS encoding (float32 or wider), from the positions
        or, for an input-dependent bias, from :attr:`token_states`."""
        if self.token_states is not None:
            return self.encoding.bias_from_states(self.token_states)
        return self.encoding.bias_for_positions(self.q_pos, self.k_pos)

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def q_len(self) -> int:
        return self.q.shape[2]

    @property
    def k_len(self) -> int:
        return self.k.shape[2]

    @property
    def needs_grad(self) -> bool:
        tensors = [self.q, self.k, self.v, *self.encoding.parameters()]
        if self.sinks is not None:
            tensors.append(self.sinks)
        if self.token_states is not None:
            tensors.extend(self.token_states.tensors())
        return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)

    @cached_property
    def has_nonfinite(self) -> bool:
        """True when q, k, v, the sinks, a float mask or the encoding's parameters hold nan or inf.

        Fused kernels may turn such rows into finite numbers (PyTorch's CPU flash kernel returns
        zeros); the backends that use one state a reason, so the request goes to one that propagates.
        Computed once per request, however many backends ask.
        """
        tensors = [self.q, self.k, self.v, *self.encoding.parameters()]
        tensors += [t for t in (self.sinks, self.mask.additive) if t is not None]
        if self.token_states is not None:
            tensors.extend(self.token_states.tensors())
        return any(t.is_floating_point() and not _all_finite(t) for t in tensors)

    def kv_per_query_head(self) -> tuple[Tensor, Tensor]:
        """``k`` and ``v`` repeated along heads to ``[B, H, Tk, D]`` (grouped-query attention)."""
        groups = self.num_heads // self.k.shape[1]
        if groups == 1:
            return self.k, self.v
        return self.k.repeat_interleave(groups, dim=1), self.v.repeat_interleave(groups, dim=1)

    def describe(self) -> str:
        """One line naming what a backend has to serve: encoding, shapes, dtype, device, masks."""
        return (
            f"{self.encoding.name} ({self.kind.value}); q {list(self.q.shape)}, k/v {list(self.k.shape)}, "
            f"{self.q.dtype}, {self.q.device}; mask: {self.mask.describe()}; sinks: {self.sinks is not None}; "
            f"grad: {self.needs_grad}, dropout: {self.dropout_p}, need_weights: {self.need_weights}"
        )


class Backend(Protocol):
    """What an attention backend provides."""

    name: str

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


#: Why a backend without ``serves_input_bias = True`` refuses an input-dependent bias (FoX).
INPUT_BIAS_REASON = (
    "the bias depends on the layer input (token_states); this backend evaluates position-only biases"
)


def backend_limits(backend: Backend, request: AttentionRequest) -> list[str]:
    """``backend.reasons(request)`` plus the limits every backend shares, checked here once.

    A backend evaluates an input-dependent bias only when it says so (``serves_input_bias = True``);
    any other would read the encoding's position-only view and give silently wrong attention.
    """
    reasons = list(backend.reasons(request))
    if request.token_states is not None and not getattr(backend, "serves_input_bias", False):
        reasons.append(INPUT_BIAS_REASON)
    return reasons


def auto_reasons(backend: Backend, request: AttentionRequest) -> list[str]:
    """Why ``auto`` passes over ``backend``: its limits (:func:`backend_limits`) plus its ``declines``."""
    return backend_limits(backend, request) + list(backend.declines(request))


class NoBackendError(ValueError, RuntimeError):
    """No backend can serve a request; the message names the request and every backend's reasons.

    A ValueError (the request asks for what the chosen backend cannot do) and, as before, a RuntimeError.
    """


_BACKENDS: dict[str, Backend] = {}
_forced = threading.local()


def register_backend(backend: Backend) -> Backend:
    """Add a backend by its ``name``; :mod:`~posenc.backends.dispatch` says where ``auto`` tries it."""
    missing = [m for m in ("reasons", "declines", "run") if not callable(getattr(backend, m, None))]
    if missing:
        raise TypeError(f"backend {backend!r} lacks {', '.join(missing)} (see posenc.backends.Backend)")
    _BACKENDS[backend.name] = backend
    return backend


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backend names in the order ``auto`` tries them on ``device``."""
    _load_builtin()
    from .dispatch import priority_list

    return priority_list(device, _BACKENDS)


def get_backend(name: str) -> Backend:
    _load_builtin()
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(_BACKENDS))} or 'auto'")
    return _BACKENDS[name]


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force every attention layer to use backend ``name`` inside the block (``"auto"`` to undo)."""
    if name != "auto":
        get_backend(name)
    previous = getattr(_forced, "name", None)
    _forced.name = None if name == "auto" else name
    try:
        yield
    finally:
        _forced.name = previous


def backend_reasons(request: AttentionRequest, *, auto: bool = False) -> dict[str, list[str]]:
    """Every backend's reasons for ``request`` (empty list = can serve it), in ``auto``'s order.

    With ``auto=True`` the lists also hold what ``auto`` weighs (:func:`auto_reasons`).
    """
    order = available_backends(request.q.device)
    if auto:
        return {name: auto_reasons(get_backend(name), request) for name in order}
    return {name: backend_limits(get_backend(name), request) for name in order}


def select_backend(request: AttentionRequest, requested: str = "auto") -> Backend:
    """The backend to run ``request``: the forced or requested one, or the first with no reasons."""
    forced = getattr(_forced, "name", None)
    name = forced or requested
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
    report = []
    for candidate, reasons in backend_reasons(request, auto=True).items():
        if not reasons:
            return get_backend(candidate)
        report.append(f"{candidate}: " + "; ".join(reasons))
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
        if not info.name.startswith("_") and info.name != "dispatch":
            importlib.import_module(f"{__name__}.{info.name}")
