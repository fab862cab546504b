"""One layer step, planned once and run many times: :class:`StepPlan`, :func:`plan_for`, :func:`run`.

``MultiheadAttention.forward`` is ``run(plan_for(...))``. The plan holds what is the same for every
call of one signature, the run does the tensor work. There are three plans, and this module is the
one place that decides which a call gets (:func:`plan_for`, one list of reasons each):

- **full**: any call. The layer checks every argument, builds positions, the mask and an attention
  request, and the dispatcher picks the backend (:func:`posenc.backends.run.attend`).
- **decode**: a plain decode step, learned from a full call of the same signature. One token per
  row after a growing or preallocated :class:`~posenc.KVCache`, on CPU, without gradients, no mask
  or other argument, in a layer whose attention is plain (no window, chunk, sinks, cap, temperature,
  K = V, training dropout; an ABSOLUTE or ROTARY encoding that reads no token states). Once a full
  call of that signature ran on sdpa with every value finite, the next calls skip the request:
  positions continued from the cache, the projections, the encoding's act, the nan test of the new
  token (:func:`fresh_finite`; a nan sends the call down the full path, to a backend that propagates
  it), the cache's append, then sdpa over every key (:func:`attend_plain`), exactly as the sdpa
  backend calls it for an unmasked request. The signature (:func:`decode_key`) is the call's own
  fields followed by the dispatcher's state (:func:`posenc.backends.dispatch_state`): a forced
  backend, a new registry entry or CPU order makes a new one.
- **slots**: fixed shapes inside ``KVCache.fixed_shapes()`` (:mod:`posenc.cache.slots`). One token
  per row is written at the next slot of the preallocated buffers and attends over every slot, the
  unwritten ones masked (a request in float32 or wider on the eager reference backend, so nan and
  inf propagate as on the layer's eager path). Nothing read is a changing Python number, so
  ``torch.compile(fullgraph=True)`` of the layer, or of a whole model, traces one graph for every
  step: ``TransformerLM.generate(compiled=True)`` compiles the model's own forward this way.

The HF bridge (``attn_implementation="posenc"``) plans its plain decode calls with the same memo
(:func:`remember`, :func:`remembered`) and runs the same nan test and kernel.

The number of cached keys is never in a signature: at one unmasked query no CPU backend's choice
reads it (``tests/layers/test_step.py`` compares with a full selection past the dispatcher's size
threshold).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import AttentionRequest, dispatch_state
from ..backends.finite import all_finite, all_parameters, new_tokens_finite
from ..backends.run import run_attention
from ..cache.kv_cache import CacheFullError, KVCache, check_in_place_write
from ..cache.slots import SlotState
from ..encodings.base import Kind, PositionalEncoding, checks_values
from ..masks.attention_mask import AttentionMask, WrittenSlotsMask
from .positions import arange_positions, checked_positions, embed_positions

__all__ = [
    "FULL",
    "PATTERN_READS",
    "SERVES",
    "SLOTS",
    "SLOT_BACKEND",
    "Projections",
    "StepPlan",
    "attend_plain",
    "compiled_next_logits",
    "decode_key",
    "fresh_finite",
    "layer_problems",
    "next_logits",
    "plan_for",
    "remember",
    "remembered",
    "run",
    "signature",
]

Form = Literal["full", "decode", "slots"]


@dataclass(frozen=True)
class StepPlan:
    """What every call of one signature shares.

    ``form``: ``"full"`` (checks, mask and dispatch per call), ``"decode"`` (the plain decode step)
    or ``"slots"`` (fixed shapes in a preallocated cache). ``positions``: where a call's positions
    come from when none are given (``"cache"``: after the cached keys; ``"slot"``: the slot's
    position). ``mask``: ``"call"`` (built from the call), ``"none"`` (one query sees every key) or
    ``"written_slots"``. ``write``: ``"append"`` (the cache grows, or its buffer's live part does) or
    ``"slot"`` (``index_copy_`` at the next slot). ``backend``: the backend the plan fixed
    (None: the dispatcher's choice per call). ``key``: the signature a decode plan is reused for
    (a full plan of a plain-shaped call carries it too, so it can be learned).
    """

    form: Form
    positions: Literal["cache", "slot"] = "cache"
    mask: Literal["call", "none", "written_slots"] = "call"
    write: Literal["append", "slot"] = "append"
    backend: str | None = None
    key: tuple | None = None

    def learning(self, key: tuple) -> StepPlan:
        """This full plan, carrying the decode signature it may teach."""
        return StepPlan("full", key=key)


FULL = StepPlan("full")
#: The backend a fixed-shape step's request runs on: the eager reference (its attention written out
#: op by op, which ``torch.compile`` traces; nan and inf propagate; soft-capping and biases served).
#: :func:`~posenc.backends.use_backend` overrides it, as for any call.
SLOT_BACKEND = "eager"
SLOTS = StepPlan("slots", positions="slot", mask="written_slots", write="slot", backend=SLOT_BACKEND)


class Projections(Protocol):
    """What a step asks of a layer: its sizes, encoding, scale and projections (``MultiheadAttention``
    has them; the step never imports the layer)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    embed_dim: int
    layer_idx: int
    causal: bool
    scale: float
    softcap: float | None
    encoding: PositionalEncoding
    q_proj: nn.Linear
    out_proj: nn.Linear

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]: ...

    def full_step(self, x: Tensor, cache: KVCache | None, **call) -> tuple[Tensor, Tensor | None]: ...


# ---------------------------------------------------------------------------- the plan
#: The arguments of a call besides ``x``, ``positions`` and ``cache`` (a decode or slot step takes none).
CALL_ARGUMENTS = (
    "context",
    "context_positions",
    "key_padding_mask",
    "attn_mask",
    "document_ids",
    "prefix_len",
    "group_ids",
)


def plan_for(layer: Projections, x: Tensor, cache: KVCache | None, call: dict) -> StepPlan:
    """The plan of a call of ``layer`` on ``x`` with ``cache`` and the other arguments ``call``
    (``positions``, ``need_weights`` and :data:`CALL_ARGUMENTS`). Inside ``KVCache.fixed_shapes()``
    a call that the fixed shapes cannot serve raises ``ValueError`` with every reason."""
    bare = not call.get("need_weights") and all(call.get(name) is None for name in CALL_ARGUMENTS)
    if type(cache) is KVCache and cache.in_fixed_shapes:
        problems = slot_problems(layer, x, cache, call, bare)
        if problems:
            raise ValueError(
                f"layer_idx={layer.layer_idx} inside KVCache.fixed_shapes(): " + "; ".join(problems)
            )
        return SLOTS
    if not bare or cache is None:
        return FULL
    key = decode_key(layer, x, cache)
    if key is None:
        return FULL
    known = remembered(layer)
    return known if known is not None and known.key == key else FULL.learning(key)


def run(
    plan: StepPlan,
    layer: Projections,
    x: Tensor,
    cache: KVCache | None,
    call: dict,
) -> Tensor | tuple[Tensor, Tensor]:
    """The tensor work of one call planned by :func:`plan_for`: ``out [B, Tq, E]``, or
    ``(out, weights)`` when ``call["need_weights"]``."""
    positions = call.get("positions")
    if plan.form == "slots":
        return _slot_step(layer, x, positions, cache)
    if plan.form == "decode":
        out = _decode_step(layer, x, positions, cache)
        if out is not None:
            return out
        plan = FULL.learning(plan.key)  # an entry it cannot extend, or a nan: the full path decides
    out, weights = layer.full_step(x, cache, **call)
    if plan.key is not None:
        _learn(layer, plan.key, cache)
    return (out, weights) if call.get("need_weights") else out


def _heads_out(layer: Projections, out: Tensor) -> Tensor:
    """``out [B, H, Tq, Dv]`` through the layer's output projection: ``[B, Tq, E]``."""
    batch, _, q_len, _ = out.shape
    return layer.out_proj(out.transpose(1, 2).reshape(batch, q_len, layer.num_heads * layer.head_dim))


# ---------------------------------------------------------------------------- the decode plan
#: Where a caller (a layer, an HF attention module) keeps the decode plan its full path last served
#: on sdpa with finite values: a plain attribute of the module (``nn.Module.__setattr__`` costs a step 1%).
_SLOT = "_posenc_decode_plan"


def signature(call: tuple, backend: str = "auto") -> tuple:
    """The signature of a plain decode call: the caller's ``call`` fields, then the dispatcher's state
    for ``backend`` (:func:`~posenc.backends.dispatch_state`)."""
    return (*call, *dispatch_state(backend))


def remember(owner: nn.Module, key: tuple | None) -> None:
    """Keep the decode plan of signature ``key`` as the one ``owner``'s full path last served on
    sdpa with every value finite (None: forget it)."""
    owner.__dict__[_SLOT] = None if key is None else StepPlan("decode", mask="none", backend="sdpa", key=key)


def remembered(owner: nn.Module) -> StepPlan | None:
    """The decode plan ``owner``'s full path last served on sdpa with finite values, or None."""
    return owner.__dict__.get(_SLOT)


def decode_key(layer: Projections, x: object, cache: object) -> tuple | None:
    """The signature of a plain decode call of ``layer`` on ``x`` with ``cache`` (the module
    docstring), else None. The caller has checked that no other argument was given."""
    if not _plain_input(x, cache) or layer_problems(layer, "decode"):
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


#: The layer methods a plain or slot step stands in for: a subclass that overrides one (the
#: KV-sharing layers' donor handoff and borrowed entry) keeps the full path.
_REPLACED_STEPS = ("full_step", "_self_inputs", "_new_keys", "_cache_entry", "_mask", "_attend")
_OWN_STEPS: dict[type, bool] = {}


#: What each short plan serves of a layer's :attr:`~posenc.MultiheadAttention.pattern` (every other
#: field must keep its plain value) and of the encodings' kinds. A pattern field is read off the layer
#: through :data:`PATTERN_READS`; a field added to ``LayerSpec`` without a reader there fails
#: ``tests/layers/test_fixed_shapes.py``.
SERVES = {
    "decode": {"pattern": ("encoding", "head_dim", "num_kv_heads"), "kinds": (Kind.ABSOLUTE, Kind.ROTARY)},
    "slots": {
        "pattern": ("encoding", "head_dim", "num_kv_heads", "softcap", "value_from_key"),
        "kinds": (Kind.ABSOLUTE, Kind.ROTARY, Kind.BIAS),
    },
}
#: The layer attribute behind each pattern field a short plan may refuse (``kv_shared``: the class).
PATTERN_READS = {
    "window": lambda layer: layer.window,
    "chunk": lambda layer: layer.chunk,
    "sinks": lambda layer: True if layer.sinks is not None else None,
    "temperature": lambda layer: True if layer.query_temperature is not None else None,
    "softcap": lambda layer: layer.softcap,
    "value_from_key": lambda layer: True if layer.value_from_key else None,
    "kv_shared": lambda layer: None if _runs_own_steps(type(layer)) else True,
}


def layer_problems(layer: Projections, form: Literal["decode", "slots"]) -> list[str]:
    """Why ``layer`` cannot take the ``form`` plan whatever the call (empty: it can): the one list
    both short plans read (:data:`SERVES`). A pattern field it does not serve (a window, chunk,
    sinks, a query temperature, a cap or K = V for the decode plan, a KV-shared layer: a class that
    overrides the layer's own steps), training with dropout, an encoding of another kind or one that
    reads the input, and for the slots plan a layer that is not causal."""
    served = SERVES[form]
    problems = []
    if form == "slots" and not layer.causal:
        problems.append("the layer must be causal (each step sees the tokens before it)")
    for name, read in PATTERN_READS.items():
        if name not in served["pattern"] and read(layer) is not None:
            shown = type(layer).__name__ if name == "kv_shared" else read(layer)
            problems.append(f"layers with {name}={shown!r} are not served")
    if layer.training and layer.dropout > 0:
        problems.append(f"the layer is in training mode with dropout={layer.dropout}; call layer.eval()")
    encoding = layer.encoding
    if encoding.kind not in served["kinds"]:
        problems.append(f"{encoding.name!r} ({encoding.kind.value}) computes logits from q/k")
    elif encoding.input_dependent:
        problems.append(f"{encoding.name!r} computes its bias from the input")
    return problems


def _runs_own_steps(cls: type) -> bool:
    """Whether ``cls`` runs the base layer's own steps (computed once per class): each step is the one
    its first definer wrote, the deepest class of the MRO that has it."""
    known = _OWN_STEPS.get(cls)
    if known is None:
        known = all(getattr(cls, name) is _first_definition(cls, name) for name in _REPLACED_STEPS)
        _OWN_STEPS[cls] = known
    return known


def _first_definition(cls: type, name: str) -> object:
    """``name`` as the deepest class of ``cls``'s MRO defines it."""
    return next(vars(klass)[name] for klass in reversed(cls.__mro__) if name in vars(klass))


def _learn(layer: Projections, key: tuple, cache: KVCache) -> None:
    """After a full call of signature ``key``: keep its decode plan when it ran on sdpa and its entry
    is now known finite (the next call of that signature is served plainly); forget any other."""
    entry = cache.get(layer.layer_idx)
    served = layer.last_backend == "sdpa" and entry is not None and entry.finite.finite
    remember(layer, key if served else None)


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


def attend_plain(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
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


def _decode_step(layer: Projections, x: Tensor, positions: Tensor | None, cache: KVCache) -> Tensor | None:
    """One plain decode step: ``out [B, 1, E]`` for ``x [B, 1, E]``, the token's key and value
    appended to ``cache``; None (nothing written) when the call needs the full path: an entry the
    step cannot extend, positions on another device, or a value that is not finite."""
    batch = x.shape[0]
    entry = cache.read(layer, cross=False, batch=batch, device=x.device)
    if (
        entry is None
        or not entry.finite.finite
        or entry.padding is not None
        or entry.document_ids is not None
        or entry.evicted_real is not None
        or entry.token_state is not None
        or entry.shift is not None
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
    out = attend_plain(q, k, v, layer.scale)
    layer.__dict__["last_backend"] = "sdpa"
    return _heads_out(layer, out)


# ---------------------------------------------------------------------------- the slots plan
def slot_problems(layer: Projections, x: object, cache: KVCache, call: dict, bare: bool) -> list[str]:
    """Why a call cannot be a fixed-shape step (empty: it can). Read from flags and shapes only
    (dynamo guards on them: the compiled graph stays whole)."""
    given = [name for name in CALL_ARGUMENTS if call.get(name) is not None]
    given += ["need_weights"] if call.get("need_weights") else []
    problems = [f"a step takes x and positions only, got {', '.join(given)}"] if not bare else []
    problems += layer_problems(layer, "slots")
    state = cache.slot_state(layer.layer_idx)
    if state is None:
        problems.append(
            "the cache held no entry of this layer when the block opened: run the prompt through it first"
        )
        return problems
    if torch.is_grad_enabled():
        problems.append("a step writes the cache in place: decode under torch.no_grad()")
    buffer = state.entry.buffers()[0]
    want = (buffer.shape[0], 1, layer.embed_dim)
    if not isinstance(x, Tensor) or tuple(x.shape) != want:
        problems.append(f"x must be [B={want[0]}, 1, E={want[2]}], {_x_problem(x, want)}")
    if state.entry.writer_id != id(layer):
        problems.append(f"the entry of layer_idx={layer.layer_idx} was written by {state.entry.writer}")
    return problems


def _x_problem(x: object, want: tuple[int, int, int]) -> str:
    """What is wrong with a step's ``x`` (not ``want``), and what to do instead."""
    if not isinstance(x, Tensor):
        return f"got {type(x).__name__}"
    got = f"got {tuple(x.shape)}"
    if x.dim() == 3 and x.shape[0] != want[0]:
        return f"{got}: the cache holds a batch of {want[0]}; a new batch needs a fresh KVCache"
    if x.dim() == 3 and x.shape[1] != 1:
        return f"{got}: one token per step; run several tokens outside the fixed_shapes() block"
    return got


def _slot_step(layer: Projections, x: Tensor, positions: Tensor | None, cache: KVCache) -> Tensor:
    """One fixed-shape step: ``out [B, 1, E]`` for ``x [B, 1, E]``, its key and value written at the
    layer's next slot, attended over every slot up to it."""
    state = cache.slot_state(layer.layer_idx)
    batch, encoding = x.shape[0], layer.encoding
    pos = state.positions() if positions is None else _slot_positions(positions, batch)
    if encoding.kind is Kind.ABSOLUTE:
        x = encoding.embed(x, pos.expand(batch, 1))
    q, k, v = layer.project(x)
    if encoding.kind is Kind.ROTARY:
        q, k = encoding.rotate(q, k, pos, pos)
    _check_slot_write(state, k, v)
    slot = state.write(k, v, pos.expand(batch, 1))
    out = _attend_slots(layer, q, pos, state, slot)
    state.advance()
    return _heads_out(layer, out)


def _slot_positions(positions: Tensor, batch: int) -> Tensor:
    if not isinstance(positions, Tensor) or positions.shape[-1] != 1 or positions.dim() > 2:
        got = tuple(positions.shape) if isinstance(positions, Tensor) else type(positions).__name__
        raise ValueError(f"positions of a fixed-shape step must be [1], [1, 1] or [B, 1], got {got}")
    positions = positions.reshape(-1, 1)
    if positions.shape[0] not in (1, batch):
        raise ValueError(f"positions must be [1, 1] or [{batch}, 1], got {tuple(positions.shape)}")
    return positions


def _check_slot_write(state: SlotState, k: Tensor, v: Tensor) -> None:
    """A free slot (read in eager calls only: a compiled graph reads no value) and the buffers' dtype."""
    buffer = state.entry.buffers()[0]
    if k.dtype != buffer.dtype:  # a dtype, not a value: compiled graphs check it too
        raise ValueError(
            f"KVCache.fixed_shapes(): the cache holds {buffer.dtype} keys but the layer now makes "
            f"{k.dtype}; keep the layer's dtype, or prefill a fresh KVCache(max_length=...)"
        )
    check_in_place_write("KVCache.fixed_shapes()", "KVCache()", "keys", None, k, v)
    if checks_values() and state.length() >= state.capacity:
        raise CacheFullError(
            f"KVCache(max_length={state.capacity}) is full: every slot is written; build the cache with "
            "a larger max_length"
        )


def _attend_slots(layer: Projections, q: Tensor, pos: Tensor, state: SlotState, slot: Tensor) -> Tensor:
    """Attention of ``q [B, H, 1, D]`` (at positions ``pos``) over every slot, those after ``slot``
    hidden: a request in float32 or wider on :data:`SLOT_BACKEND`."""
    k_buffer, v_buffer, pos_buffer = state.entry.buffers()
    wide = torch.promote_types(q.dtype, torch.float32)
    capacity, batch = k_buffer.shape[2], q.shape[0]
    mask = AttentionMask(1, capacity, batch, layer.num_heads, q.device, (WrittenSlotsMask(slot),))
    request = AttentionRequest(
        q=q.to(wide),
        k=k_buffer.to(wide),
        v=v_buffer.to(wide),
        encoding=layer.encoding,
        q_pos=pos,
        k_pos=pos_buffer,  # the keys' positions as written: the prompt's may be any, not their slots
        scale=layer.scale,
        mask=mask,
        layer=layer,
        softcap=layer.softcap,
    )
    _, out, _ = run_attention(request, SLOT_BACKEND)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------- a model's compiled decode
def next_logits(model: nn.Module, token: Tensor, cache: KVCache) -> Tensor:
    """``[B, V]``: the logits after ``token [B, 1]`` through ``model``'s own forward (in fixed shapes
    when ``cache`` is inside ``KVCache.fixed_shapes()``)."""
    return model(token, cache=cache)[:, -1]


_COMPILED: list = []
_WARNED: list = []


def _recompile_limit_errors() -> tuple[type[BaseException], ...]:
    """Dynamo's errors for a function traced more often than its recompile limit allows."""
    from torch._dynamo import exc

    names = ("FailOnRecompileLimitHit", "RecompileLimitExceeded", "CacheLimitExceeded")
    return tuple(getattr(exc, name) for name in names if hasattr(exc, name))


def compiled_next_logits(model: nn.Module, token: Tensor, cache: KVCache) -> Tensor:
    """:func:`next_logits` under ``torch.compile(fullgraph=True)``, compiled once per process: the
    model and cache are arguments, so a new cache (the next ``generate``) of the same shapes reuses
    the graph, and torch's automatic dynamic shapes serve a new batch or length with one more
    trace. Past torch's recompile limit (many models in one process) it warns once and runs the
    same fixed-shape step eagerly: never a raw dynamo error."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(next_logits, fullgraph=True))
    try:
        return _COMPILED[0](model, token, cache)
    except _recompile_limit_errors() as error:
        if not _WARNED:
            _WARNED.append(True)
            warnings.warn(
                "generate(compiled=True): torch.compile reached its recompile limit "
                f"({type(error).__name__}: too many models or shapes in this process); these steps "
                "run eagerly in fixed shapes (the same tokens). torch._dynamo.config.recompile_limit "
                "raises the limit.",
                RuntimeWarning,
                stacklevel=3,
            )
        return next_logits(model, token, cache)
