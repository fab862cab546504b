"""The request a backend serves (:class:`AttentionRequest`) and the checks of its fields: shapes,
dtypes, devices, positions, numbers, each error naming the field."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor, nn

from ..encodings.base import FiniteMark, InputBias, Kind, PositionalEncoding, TokenStates, checks_values
from ..masks.attention_mask import AttentionMask
from ..masks.keywords import MaskKeywordError, described
from .finite import all_finite, all_finite_together, all_parameters
from .parts.softcap import check_softcap

__all__ = ["AttentionRequest"]


def _field_error(name: str, problem: str) -> ValueError:
    return ValueError(f"AttentionRequest.{name}: {problem}")


def _check_number(name: str, value: object, what: str) -> None:
    if type(value) is float or type(value) is int:  # the usual case, without the ABC check
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _field_error(name, f"must be {what}, got {described(value)}")


def _check_positions(
    name: str, pos: object, batch: int, length: int, device: torch.device, allow_float: bool = False
) -> None:
    """Integer positions ``[B or 1, T]`` on ``device`` (a float position would be truncated by one
    backend and used as it is by another); real-valued ones only for an encoding that defines them
    (``float_positions``: rotary kinds, whose backends never read positions past the rotation)."""
    if not isinstance(pos, Tensor):
        raise _field_error(name, f"must be an integer tensor [B or 1, T], got {described(pos)}")
    if pos.dtype.is_floating_point and allow_float:
        pass
    elif pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise _field_error(
            name,
            f"must be an integer tensor (positions are whole numbers), got dtype {pos.dtype}; use .long()",
        )
    if pos.dim() != 2 or pos.shape[0] not in (1, batch) or pos.shape[1] != length:
        raise _field_error(
            name, f"must have shape [B or 1, T] = [{batch} or 1, {length}], got {list(pos.shape)}"
        )
    if pos.device != device:
        raise _field_error(name, f"is on device {pos.device} but q is on {device}; move it to {device}")


#: ``from_keywords`` passes it as the mask: every other field is checked, the default mask is not
#: built (the keywords' mask replaces it; building both cost a decode step a few microseconds).
_KEYWORDS_PENDING: object = object()


@dataclass
class AttentionRequest:
    """Everything a backend needs for one attention call.

    Shapes: ``q [B, H, Tq, D]``; ``k [B, Hkv, Tk, D]`` and ``v [B, Hkv, Tk, Dv]`` (``H`` a multiple
    of ``Hkv``; ``Dv`` equals ``D`` except for multi-head latent attention, which only the ABSOLUTE
    path of sdpa and eager serves);
    ``q_pos [B or 1, Tq]`` and ``k_pos [B or 1, Tk]`` int64 positions.

    The mask is :attr:`mask`, one :class:`~posenc.masks.attention_mask.AttentionMask` (build it with
    :meth:`AttentionMask.build <posenc.masks.attention_mask.AttentionMask.build>`); left out (None), every query sees
    every key (full bidirectional attention). The request has no other mask field: a request written
    with the keywords ``causal``, ``causal_offset``, ``key_padding_mask`` and ``attn_mask`` is
    :meth:`from_keywords`, which builds the mask from them.

    An input-dependent bias (FoX) needs ``token_states`` (:class:`~posenc.encodings.base.TokenStates`, from the
    ``token_states`` its ``input_bias()`` declares, of the layer input); only backends with ``serves_input_bias`` run it.

    Every field is checked once, at construction (shapes, dtypes, devices, integer positions, the
    encoding's head count, scale, dropout): a ValueError names the field (``AttentionRequest.k: ...``).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    encoding: PositionalEncoding
    q_pos: Tensor
    k_pos: Tensor
    scale: float
    #: Which keys each query sees; None (the default): every key, full bidirectional attention.
    mask: AttentionMask = field(default=None, repr=False)  # type: ignore[assignment]
    dropout_p: float = 0.0
    need_weights: bool = False
    layer: nn.Module | None = None
    #: Attention sinks: one logit per query head ``[H]`` in every row's softmax denominator, or None.
    sinks: Tensor | None = None
    #: Input-dependent biases (FoX): the queries' and keys' states the bias is computed from.
    token_states: TokenStates | None = None
    #: The first ``known_finite_keys`` keys and values are known finite (a cache's, checked when written).
    known_finite_keys: int = 0
    #: Set when :attr:`has_nonfinite` finds every key and value finite (the cache entry storing them).
    finite_mark: FiniteMark | None = None
    #: Logit soft-capping (Gemma 2): the q/k logit ``s`` becomes ``softcap * tanh(s / softcap)`` before
    #: the bias and masks are added; None for none. Only backends with ``serves_softcap`` apply it.
    softcap: float | None = None

    def __post_init__(self) -> None:
        pending = self.mask is _KEYWORDS_PENDING  # from_keywords builds the mask next
        if pending:
            self.mask = None  # type: ignore[assignment]
        self._check_fields()
        self._check_token_states()
        if self.mask is None and not pending:
            self.mask = self._built_mask()

    @classmethod
    def from_keywords(
        cls,
        *,
        causal: bool = False,
        causal_offset: int = 0,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        **fields: object,
    ) -> AttentionRequest:
        """The request of ``fields`` (every field but :attr:`mask`) whose mask the keywords describe:
        ``causal`` and ``causal_offset`` (the key index of the first query, i.e. the cache length:
        query ``i`` sees keys ``j <= i + offset``), ``key_padding_mask [B, Tk]`` (bool, True =
        padding) and ``attn_mask`` (bool, True = may attend, or float added to the logits; 4-D,
        broadcastable to ``[B, H, Tq, Tk]``).

        ``AttentionRequest.from_keywords(q=q, ..., causal=True)`` is what
        ``AttentionRequest(q=q, ..., causal=True)`` was before the request held its mask only; it
        equals ``AttentionRequest(q=q, ..., mask=AttentionMask.build(q_len=..., causal=True))``. A
        ValueError names the field or keyword at fault (``AttentionRequest.key_padding_mask: ...``).
        """
        if "mask" in fields:
            raise TypeError(
                "AttentionRequest.from_keywords: give the mask keywords or mask=, not both "
                "(AttentionRequest(..., mask=mask) takes a built mask)"
            )
        request = cls(**fields, mask=_KEYWORDS_PENDING)  # type: ignore[arg-type]  # every other field checked first
        request.mask = request._built_mask(
            causal=causal, causal_offset=causal_offset, key_padding_mask=key_padding_mask, attn_mask=attn_mask
        )
        return request

    def _built_mask(self, **keywords: object) -> AttentionMask:
        """The mask of this request's shapes that ``keywords`` describe (none: every key)."""
        try:
            return AttentionMask.build(
                q_len=self.q_len,
                k_len=self.k_len,
                batch=self.q.shape[0],
                heads=self.num_heads,
                device=self.q.device,
                **keywords,  # type: ignore[arg-type]
            )
        except MaskKeywordError as error:
            raise _field_error(error.keyword, error.problem) from None

    def _check_fields(self) -> None:
        """Every field against the others, once, in O(1): shapes, dtypes, devices and numbers, never
        tensor values (this runs on every decode step). A ValueError names the field at fault.

        Without it, mismatched heads reached the CPU flash kernel (q with 2 heads and k/v with 3
        killed Python with SIGFPE), float positions were truncated by one backend and used as they
        are by another, and a T5 built for 2 heads served 1-head queries silently.
        """
        batch, heads, q_len, k_len, dim = self._check_qkv()
        if not isinstance(self.encoding, PositionalEncoding):
            raise _field_error(
                "encoding", f"must be a posenc PositionalEncoding, got {described(self.encoding)}"
            )
        allow_float = (
            bool(getattr(self.encoding, "float_positions", False)) and self.encoding.kind is Kind.ROTARY
        )
        for name, pos, length in (("q_pos", self.q_pos, q_len), ("k_pos", self.k_pos, k_len)):
            _check_positions(name, pos, batch, length, self.q.device, allow_float)
        self._check_encoding_sizes(heads, dim)
        self._check_numbers()
        self._check_mask(batch, heads, q_len, k_len)
        known = self.known_finite_keys
        if type(known) is not int or not 0 <= known <= k_len:
            raise _field_error("known_finite_keys", f"must be an int in [0, {k_len}], got {known!r}")
        if self.sinks is not None:
            self._check_sinks(heads)

    def _check_qkv(self) -> tuple[int, int, int, int, int]:
        """q, k and v against each other; returns ``(batch, heads, q_len, k_len, head size)``."""
        q, k, v = self.q, self.k, self.v
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                raise _field_error(name, f"must be a tensor [B, H, T, D], got {described(t)}")
        if not q.is_floating_point():
            raise _field_error("q", f"must be a floating-point tensor, got dtype {q.dtype}")
        batch, heads, q_len, dim = q.shape
        kv_heads, k_len = k.shape[1], k.shape[2]
        for name, t in (("k", k), ("v", v)):
            if t.shape[0] != batch:
                raise _field_error(
                    name, f"has batch {t.shape[0]} but q has {batch}; give every tensor one batch"
                )
            if t.dtype != q.dtype:
                raise _field_error(
                    name, f"has dtype {t.dtype} but q has {q.dtype}; cast q, k and v to one dtype"
                )
            if t.device != q.device:
                raise _field_error(
                    name, f"is on device {t.device} but q is on {q.device}; move it to {q.device}"
                )
        if kv_heads == 0 or heads % kv_heads:
            raise _field_error(
                "k",
                f"has {kv_heads} heads but q has {heads}: q's heads must be a multiple of k's "
                "(grouped-query attention: q [B, H, Tq, D], k and v [B, Hkv, Tk, D])",
            )
        if v.shape[1] != kv_heads:
            raise _field_error(
                "v", f"has {v.shape[1]} heads but k has {kv_heads}; k and v need the same heads"
            )
        if v.shape[2] != k_len:
            raise _field_error("v", f"has {v.shape[2]} positions but k has {k_len}; one value per key")
        if k.shape[3] != dim:
            raise _field_error("k", f"has head size {k.shape[3]} but q has {dim}; q and k need one head size")
        return batch, heads, q_len, k_len, dim

    def _check_numbers(self) -> None:
        """The scale, softcap, dropout probability and ``need_weights``."""
        _check_number("scale", self.scale, "a finite number > 0 (the logit scale, 1/sqrt(D) by default)")
        # A compiled call may see the scale as a symbolic float (dynamo makes a float dynamic once a
        # second value is compiled): math.isfinite cannot be traced there; the layer checked it eagerly.
        if checks_values() and not (math.isfinite(self.scale) and self.scale > 0):
            raise _field_error("scale", f"must be finite and > 0 (1/sqrt(D) by default), got {self.scale!r}")
        try:
            if checks_values():  # the same symbolic float as the scale under compile (checked eagerly)
                self.softcap = check_softcap(self.softcap)
        except ValueError as error:
            raise _field_error("softcap", str(error).removeprefix("softcap ")) from None
        _check_number("dropout_p", self.dropout_p, "a probability in [0, 1)")
        if not 0.0 <= self.dropout_p < 1.0:
            raise _field_error("dropout_p", f"must be in [0, 1), got {self.dropout_p!r}")
        if not isinstance(self.need_weights, bool):
            raise _field_error("need_weights", f"must be True or False, got {self.need_weights!r}")

    def _check_sinks(self, heads: int) -> None:
        """Attention sinks: one float logit per head, on q's device."""
        sinks = self.sinks
        if not isinstance(sinks, Tensor) or tuple(sinks.shape) != (heads,) or not sinks.is_floating_point():
            raise _field_error(
                "sinks", f"must be a float tensor [H] = [{heads}] or None, got {described(sinks)}"
            )
        if sinks.device != self.q.device:
            raise _field_error("sinks", f"is on device {sinks.device} but q is on {self.q.device}")

    def _check_encoding_sizes(self, heads: int, dim: int) -> None:
        """The encoding's layer sizes (what it was built for) against q's heads and head size."""
        enc = self.encoding
        sizes = type(enc).layer_sizes
        if not sizes:
            return
        config = enc._config
        built = config.get("num_heads") if "num_heads" in sizes else None
        if built is not None and built != heads:
            raise _field_error(
                "encoding",
                f"{enc.name} was built for num_heads={built} but q has {heads} heads; build it for the "
                f"layer's query heads (num_heads={heads})",
            )
        built = config.get("head_dim") if "head_dim" in sizes and enc.kind is Kind.CONTENT else None
        if built is not None and built != dim:
            raise _field_error(
                "encoding",
                f"{enc.name} was built for head_dim={built} but q has head size {dim}; build it for head_dim={dim}",
            )

    def _check_mask(self, batch: int, heads: int, q_len: int, k_len: int) -> None:
        if self.mask is None:
            return
        given = self.mask
        if not isinstance(given, AttentionMask):
            raise _field_error(
                "mask", f"must be a posenc.masks.attention_mask.AttentionMask or None, got {described(given)}"
            )
        have = (given.batch, given.heads, given.q_len, given.k_len)
        if have != (batch, heads, q_len, k_len):
            raise _field_error(
                "mask",
                f"was built for [B, H, Tq, Tk] = {list(have)} but q and k give {[batch, heads, q_len, k_len]}",
            )

    def _check_token_states(self) -> None:
        needs = self.encoding.input_dependent
        states = self.token_states
        if needs and states is None:
            raise ValueError(
                f"token_states: {self.encoding.name!r} computes its bias from the layer input; pass "
                "token_states (posenc.encodings.base.TokenStates of encoding.input_bias().token_states(x, None, None)), or call the layer"
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
            return self.input_bias().bias_from_states(self.token_states)
        return self.encoding.bias_for_positions(self.q_pos, self.k_pos)

    def input_bias(self) -> InputBias:
        """The encoding's :class:`~posenc.encodings.base.InputBias` declaration (requests with token states)."""
        return self.derived("input_bias", self.encoding.input_bias)

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
        if not torch.is_grad_enabled():
            return False
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
        Computed once per request, however many backends ask. Keys and values before
        ``known_finite_keys`` are not read again: a decode step checks what it adds, O(new tokens).
        """
        known = self.known_finite_keys
        k, v = (self.k, self.v) if known == 0 else (self.k[:, :, known:], self.v[:, :, known:])
        if not all_finite_together((self.q, k, v)):
            return True
        if self.finite_mark is not None:
            self.finite_mark.finite = True
        tensors = all_parameters(self.encoding)
        tensors += [t for t in (self.sinks, self.mask.additive) if t is not None]
        if self.token_states is not None:
            tensors.extend(self.token_states.tensors())
        return any(t.is_floating_point() and not all_finite(t) for t in tensors)

    def derived(self, key: str, compute: Callable[[], object]) -> object:
        """``compute()``, once per request and ``key``: what a backend derives from the request and
        needs in ``reasons``, ``declines`` and ``run`` alike (an encoding's projected tables)."""
        memo = self.__dict__.setdefault("_derived", {})
        if key not in memo:
            memo[key] = compute()
        return memo[key]

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
            + (f"softcap: {self.softcap:g}; " if self.softcap is not None else "")
            + f"grad: {self.needs_grad}, dropout: {self.dropout_p}, need_weights: {self.need_weights}"
        )
