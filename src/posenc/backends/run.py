"""One attention call: build the request, choose its backend, run it.

:func:`attend` is what the layers (:class:`~posenc.MultiheadAttention`,
:class:`~posenc.MultiLatentAttention`) and :mod:`posenc.hf` call once their encoding has acted on
q and k; :func:`run_attention` runs a request already built. The choice is the dispatcher's
(:func:`~posenc.backends.select_backend`, in the order of :mod:`~posenc.backends.dispatch`), except
in a graph traced by ``torch.compile``, which runs one of :data:`TRACEABLE_BACKENDS`. A call whose
dense ``[B, H, Tq, Tk]`` weights would pass :data:`MAX_DENSE_BYTES` is refused before anything is
allocated (:func:`check_dense_size`).

This module is not a backend; it sits above them (the package's ``__init__`` does not import it).
"""

from __future__ import annotations

from torch import Tensor, nn

from ..encodings.base import FiniteMark, PositionalEncoding, TokenStates, checks_values
from ..masks.attention_mask import AttentionMask
from . import (
    AttentionRequest,
    Backend,
    NoBackendError,
    available_backends,
    backend_limits,
    get_backend,
    requested_backend,
    select_backend,
)
from .eager import attention_probs

__all__ = [
    "MAX_DENSE_BYTES",
    "TRACEABLE_BACKENDS",
    "attend",
    "check_dense_size",
    "run_attention",
    "traced_backend",
]


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    encoding: PositionalEncoding,
    q_pos: Tensor,
    k_pos: Tensor,
    scale: float,
    mask: AttentionMask | None = None,
    causal: bool = False,
    causal_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    sinks: Tensor | None = None,
    token_states: TokenStates | None = None,
    layer: nn.Module | None = None,
    backend: str = "auto",
    known_finite_keys: int = 0,
    finite_mark: FiniteMark | None = None,
    softcap: float | None = None,
) -> tuple[str, Tensor, Tensor | None]:
    """Attention of ``q`` over ``k``, ``v`` under ``encoding``, on ``backend`` (or the one ``auto`` picks).

    Shapes: ``q [B, H, Tq, D]``, ``k [B, Hkv, Tk, D]``, ``v [B, Hkv, Tk, Dv]`` (``H`` a multiple of
    ``Hkv``; q and k already rotated for ROTARY kinds), ``q_pos [B or 1, Tq]`` and ``k_pos [B or 1,
    Tk]`` integer positions, ``sinks [H]``. The mask is ``mask`` (an :class:`~posenc.masks.attention_mask.AttentionMask`)
    or, when None, built from ``causal``, ``causal_offset`` (the key index of the first query: the
    cache length), ``key_padding_mask [B, Tk]`` (True = padding) and ``attn_mask`` (bool, True = may
    attend, or float added to the logits; broadcastable to ``[B, H, Tq, Tk]``). ``token_states``:
    an input-dependent bias's states (FoX); ``layer``: the calling module, for CONTENT encodings with
    per-layer parameters. ``known_finite_keys``: the first keys and values are a cache's, checked
    finite when written, so the nan check reads only the rest; ``finite_mark`` is set when every key
    and value is found finite (see :class:`~posenc.backends.AttentionRequest`). ``softcap``: logit
    soft-capping (Gemma 2), ``softcap * tanh(s / softcap)`` on the q/k logits, or None.

    Returns ``(backend name, out [B, H, Tq, Dv], weights [B, H, Tq, Tk] or None)``: weights only
    with ``need_weights``, from the backend or recomputed on the eager reference path.
    Every argument is checked by :class:`~posenc.backends.AttentionRequest` (a ValueError names it).
    """
    fields = dict(
        q=q,
        k=k,
        v=v,
        encoding=encoding,
        q_pos=q_pos,
        k_pos=k_pos,
        scale=scale,
        dropout_p=dropout_p,
        need_weights=need_weights,
        layer=layer,
        sinks=sinks,
        token_states=token_states,
        known_finite_keys=known_finite_keys,
        finite_mark=finite_mark,
        softcap=softcap,
    )
    if mask is not None:
        request = AttentionRequest(mask=mask, **fields)
    else:  # the keywords describe the mask (the request holds the built one only)
        request = AttentionRequest.from_keywords(
            causal=causal,
            causal_offset=causal_offset,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            **fields,
        )
    return run_attention(request, backend)


def run_attention(request: AttentionRequest, backend: str = "auto") -> tuple[str, Tensor, Tensor | None]:
    """Run ``request`` on ``backend`` (or the one ``auto`` picks): ``(backend name, out, weights)``.

    With ``need_weights`` the weights come from the backend, or from the eager reference when the
    backend returns none.
    """
    check_dense_size(request, requested_backend(backend))
    chosen = select_backend(request, backend) if checks_values() else traced_backend(request, backend)
    out, weights = chosen.run(request)
    if request.need_weights and weights is None:
        weights = attention_probs(request)
    return chosen.name, out, weights


#: The largest ``[B, H, Tq, Tk]`` tensor of logits or weights a call may ask for (``need_weights=True``
#: or the eager backend forced): past it, the call would exhaust memory before any result.
MAX_DENSE_BYTES = 4 << 30


def check_dense_size(request: AttentionRequest, backend: str) -> None:
    """Refuse up front a request whose ``[B, H, Tq, Tk]`` weights would pass :data:`MAX_DENSE_BYTES`:
    ``need_weights=True`` returns them, and the eager backend builds them (``auto`` never picks
    eager at such sizes when another backend fits)."""
    if not (request.need_weights or backend == "eager"):
        return
    batch, heads, q_len, _ = request.q.shape
    itemsize = max(request.q.element_size(), 4)  # logits and softmax are at least float32
    needed = batch * heads * q_len * request.k.shape[2] * itemsize
    if needed <= MAX_DENSE_BYTES:
        return
    cause = "need_weights=True returns" if request.need_weights else "backend='eager' builds"
    fix = "drop need_weights" if request.need_weights else "use backend='auto' (or blocked/relative)"
    raise ValueError(
        f"{cause} [B, H, Tq, Tk] = [{batch}, {heads}, {q_len}, {request.k.shape[2]}] attention weights: "
        f"{needed / 2**30:.1f} GiB (limit {MAX_DENSE_BYTES >> 30} GiB); {fix}, or use shorter sequences"
    )


available_backends()  # register every backend now: a compiled forward cannot import them

#: The backends a compiled forward (``torch.compile(layer, fullgraph=True)``) may run, in ``auto``'s
#: order there: their checks and kernels trace into one graph. The others' checks read tensor
#: values or the file system (a compiler's presence), which a graph cannot hold.
TRACEABLE_BACKENDS = ("sdpa", "eager")


def traced_backend(request: AttentionRequest, backend: str) -> Backend:
    """The backend of a call traced by ``torch.compile``: the requested one if it can be traced and
    run, else the first of :data:`TRACEABLE_BACKENDS` that can run the request."""
    # Value checks stay out of the graph (posenc.encodings.base.checks_values): the nan check is settled here.
    request.__dict__.setdefault("has_nonfinite", False)
    forced = requested_backend(backend)
    names = (forced,) if forced != "auto" else TRACEABLE_BACKENDS
    for name in names:
        if name not in TRACEABLE_BACKENDS:
            raise NoBackendError(
                f"backend {name!r} cannot be traced by torch.compile; use one of {', '.join(TRACEABLE_BACKENDS)} "
                "or 'auto' in a compiled layer"
            )
        candidate = get_backend(name)
        if not backend_limits(candidate, request):  # the shared limits too (soft-capping, input biases)
            return candidate
    return select_backend(request, backend)  # none fits: the dispatcher's error names every reason
