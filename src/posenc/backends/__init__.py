"""Attention backends and the dispatcher that picks one by stated reasons.

Each backend implements ``reasons(request) -> list[str]`` (why it cannot serve the request; empty
when it can) and ``run(request) -> (out, weights_or_None)``. ``auto`` takes the first backend, in
priority order, with no reasons; when none can serve a request the error lists every backend's
reasons. Tests and users force a backend per layer (``backend="sdpa"``) or for a block of code
(``with posenc.backends.use_backend("eager"): ...``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from ..base import Kind, PositionalEncoding

__all__ = [
    "AttentionRequest",
    "Backend",
    "NoBackendError",
    "auto_reasons",
    "available_backends",
    "backend_reasons",
    "get_backend",
    "kind_reasons",
    "register_backend",
    "select_backend",
    "use_backend",
]


@dataclass
class AttentionRequest:
    """Everything a backend needs for one attention call.

    Shapes: ``q [B, H, Tq, D]``; ``k``, ``v`` ``[B, Hkv, Tk, D]`` (``H`` a multiple of ``Hkv``);
    ``q_pos [B or 1, Tq]`` and ``k_pos [B or 1, Tk]`` int64 positions; ``key_padding_mask [B, Tk]``
    bool, True = padding; ``attn_mask`` bool (True = may attend) or float (added to the logits),
    broadcastable to ``[B, H, Tq, Tk]`` and already 4-D. ``causal_offset`` is the key index of the
    first query (the cache length) when ``causal`` is True: query ``i`` sees keys ``j <= i + offset``.
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
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def kind(self) -> Kind:
        return self.encoding.kind

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
        return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)

    def has_mask(self) -> bool:
        return self.causal or self.key_padding_mask is not None or self.attn_mask is not None

    def allowed(self) -> Tensor | None:
        """Boolean ``[B or 1, 1 or H, Tq, Tk]``, True where attention is allowed; None if all allowed."""
        if "allowed" in self._cache:
            return self._cache["allowed"]
        device = self.q.device
        allowed: Tensor | None = None
        if self.causal:
            qi = torch.arange(self.q_len, device=device)[:, None] + self.causal_offset
            kj = torch.arange(self.k_len, device=device)[None, :]
            allowed = (kj <= qi)[None, None]
        if self.key_padding_mask is not None:
            keep = ~self.key_padding_mask[:, None, None, :]
            allowed = keep if allowed is None else allowed & keep
        if self.attn_mask is not None and self.attn_mask.dtype == torch.bool:
            allowed = self.attn_mask if allowed is None else allowed & self.attn_mask
        self._cache["allowed"] = allowed
        return allowed

    def float_mask(self) -> Tensor | None:
        """The user's float mask (added to the logits), or None."""
        if self.attn_mask is not None and self.attn_mask.dtype != torch.bool:
            return self.attn_mask
        return None

    def additive_mask(self, dtype: torch.dtype) -> Tensor | None:
        """All masks as one additive float tensor: ``finfo(dtype).min`` where not allowed."""
        allowed, extra = self.allowed(), self.float_mask()
        if allowed is None and extra is None:
            return None
        mask = torch.zeros((), dtype=dtype, device=self.q.device)
        if extra is not None:
            mask = mask + extra.to(dtype)
        if allowed is not None:
            mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
        return mask


class Backend(Protocol):
    """What an attention backend provides."""

    name: str

    def reasons(self, request: AttentionRequest) -> list[str]:
        """Why this backend cannot serve ``request``; empty when it can."""
        ...

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        """``(out [B, H, Tq, D], weights [B, H, Tq, Tk] or None)``."""
        ...


def kind_reasons(request: AttentionRequest, kind: Kind) -> list[str]:
    """The reason a backend that serves only ``kind`` gives for any other encoding (empty if it fits)."""
    if request.kind is kind:
        return []
    return [f"serves {kind.name} encodings only; {request.encoding.name} is {request.kind.value}"]


def auto_reasons(backend: Backend, request: AttentionRequest) -> list[str]:
    """Why ``auto`` passes over ``backend``: its ``reasons`` plus its optional ``declines``.

    ``declines(request)`` states costs rather than limits (a compile per shape, overhead on
    small problems): ``auto`` respects them, forcing a backend ignores them.
    """
    declines = getattr(backend, "declines", None)
    return backend.reasons(request) + (list(declines(request)) if declines is not None else [])


class NoBackendError(RuntimeError):
    """No backend can serve a request; the message lists every backend's reasons."""


_BACKENDS: dict[str, tuple[int, Backend]] = {}
_forced = threading.local()


def register_backend(backend: Backend, priority: int) -> Backend:
    """Add a backend; ``auto`` tries backends by ascending ``priority``."""
    _BACKENDS[backend.name] = (priority, backend)
    return backend


def available_backends() -> list[str]:
    """Backend names in the order ``auto`` tries them."""
    _load_builtin()
    return [name for name, _ in sorted(_BACKENDS.items(), key=lambda item: item[1][0])]


def get_backend(name: str) -> Backend:
    _load_builtin()
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(available_backends())} or 'auto'")
    return _BACKENDS[name][1]


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
    """Every backend's reasons for ``request`` (empty list = can serve it).

    With ``auto=True`` the lists also hold what ``auto`` weighs (:func:`auto_reasons`).
    """
    explain = auto_reasons if auto else (lambda backend, req: backend.reasons(req))
    return {name: explain(get_backend(name), request) for name in available_backends()}


def select_backend(request: AttentionRequest, requested: str = "auto") -> Backend:
    """The backend to run ``request``: the forced or requested one, or the first with no reasons."""
    forced = getattr(_forced, "name", None)
    name = forced or requested
    if name != "auto":
        backend = get_backend(name)
        reasons = backend.reasons(request)
        if reasons:
            raise NoBackendError(f"backend {name!r} cannot run this request: " + "; ".join(reasons))
        return backend
    report = []
    for candidate in available_backends():
        backend = get_backend(candidate)
        reasons = auto_reasons(backend, request)
        if not reasons:
            return backend
        report.append(f"{candidate}: " + "; ".join(reasons))
    raise NoBackendError("no attention backend can run this request:\n  " + "\n  ".join(report))


def _load_builtin() -> None:
    """Import every backend module of this package (importing one registers it)."""
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
