"""``posenc.MultiheadAttention``: one attention layer for every encoding, and ``posenc.KVCache``.

The layer projects queries, keys and values, lets its encoding act where its kind says
(ABSOLUTE: added to the layer input; ROTARY: rotates q and k; BIAS: adds a per-head logit bias;
CONTENT: computes the logits and, optionally, a value term), and hands the call to the backend
chosen by stated reasons (:mod:`posenc.backends`).
"""

from __future__ import annotations

import math
import numbers
import weakref
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
from torch import Tensor, nn

from . import backends as _backends
from .backends import AttentionRequest, Backend, NoBackendError, get_backend, select_backend
from .backends.eager import attention_probs
from .base import Kind, LayerContext, PositionalEncoding, TokenStates, checks_values
from .masks import AttentionMask
from .patterns import QueryTemperature
from .registry import build_for_layer

__all__ = [
    "KVCache",
    "MultiheadAttention",
    "default_positions",
    "document_positions",
    "embed_positions",
    "padding_with_cache",
    "run_attention",
    "switch_rope_pairing_",
]


@dataclass(kw_only=True)
class _CacheStamp:
    """Who wrote a cache entry, and in which form: a layer reads only an entry it wrote in its current form.

    :class:`KVCache` and :class:`~posenc.mla.LatentCache` entries carry it; :meth:`stamp` fills it
    when a layer writes the entry and :meth:`check_reader` refuses, with a ``ValueError`` naming the
    writer, what another layer, another batch, another device or another channel layout or rotation
    mode would otherwise read silently.
    """

    writer_id: int = 0  # id() of the layer that wrote the entry
    writer: str = ""  # that layer, described for error messages
    layout: int = 0  # the writer's q/k channel layout then (switch_rope_pairing_ changes it)
    # Whether the writer's encoding skipped its rotation then (RoPE drop_rotation="eval" in eval
    # mode); None: the keys are stored unrotated (a streaming KVCache rotates them at every step).
    rotation_dropped: bool | None = False

    def held(self) -> Tensor:
        """The tensor whose batch size (dim 0) and device are the entry's."""
        raise NotImplementedError

    def stamp(self, layer: nn.Module) -> None:
        self.writer_id, self.writer = id(layer), layer._describe()
        self.layout, self.rotation_dropped = layer._layout, _rotation_dropped(layer)

    def check_reader(
        self, layer: nn.Module, *, what: str, batch: int, device: torch.device, fresh: str
    ) -> None:
        """Raise unless ``layer`` wrote this entry (``what``, e.g. "the self-attention entry of
        layer_idx=0") in its current form, for a batch of ``batch`` on ``device``; ``fresh`` names
        the cache class to start again with."""
        held = self.held()
        if held.device != device:
            raise ValueError(
                f"cache: {what} is on device {held.device} but the layer is on {device}; "
                f"use a fresh {fresh} on this device"
            )
        if self.writer_id != id(layer):
            raise ValueError(
                f"cache: {what} was written by {self.writer}, not by this layer, {layer._describe()}; "
                f"give every layer its own layer_idx, or use a fresh {fresh}"
            )
        if self.layout != layer._layout:
            raise ValueError(
                f"cache: {what} holds keys in the q/k channel order this layer had before "
                f"switch_rope_pairing_ permuted it; use a fresh {fresh}"
            )
        dropped = _rotation_dropped(layer)
        if self.rotation_dropped is not None and self.rotation_dropped != dropped:
            then, now = ("without", "with") if self.rotation_dropped else ("with", "without")
            raise ValueError(
                f"cache: {what} holds keys written {then} rotation, but this layer's encoding now runs "
                f"{now} it (drop_rotation='eval' rotates in training mode only, and the layer was switched "
                f"to {'training' if layer.training else 'eval'} mode since); use a fresh {fresh} after "
                "train() or eval()"
            )
        if held.shape[0] != batch:
            raise ValueError(
                f"cache: {what} holds a batch of {held.shape[0]}, this call has {batch}; use a fresh "
                f"{fresh} (or cache.reset()) for a new batch"
            )


#: The layers built on each encoding (weakly held): an encoding object may serve several layers, and
#: switch_rope_pairing_ must find those outside the module it is given.
_ENCODING_USERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _register_user(encoding: PositionalEncoding, layer: nn.Module) -> None:
    _ENCODING_USERS.setdefault(encoding, weakref.WeakSet()).add(layer)


def _users(encoding: PositionalEncoding) -> list[nn.Module]:
    """The live layers whose rotary encoding is ``encoding`` (those since given another one left out)."""
    return [layer for layer in list(_ENCODING_USERS.get(encoding, ())) if layer._rotary() is encoding]


def _rotation_dropped(layer: nn.Module) -> bool:
    """Whether ``layer``'s rotary encoding leaves q and k unrotated now (RoPE's ``drop_rotation``)."""
    return bool(getattr(layer._rotary(), "rotation_dropped", False))


@dataclass(kw_only=True)
class _CacheEntry(_CacheStamp):
    k: Tensor  # [B, Hkv, T, D], keys after the encoding's rotation
    v: Tensor  # [B, Hkv, T, D]
    k_pos: Tensor  # [B or 1, T] int64
    padding: Tensor | None  # [B, T] bool, True = padding
    document_ids: Tensor | None = None  # [B, T] int64, the keys' documents
    context_key: tuple | None = None  # cross-attention: which context tensor the keys came from
    evicted: int = 0  # tokens dropped from the front (a windowed layer keeps what its window sees)
    token_state: Tensor | None = None  # [B, S, T]: an input-dependent bias's states of the keys (FoX)
    token_index: Tensor | None = None  # [T] int64: the keys' indices among all tokens seen

    def held(self) -> Tensor:
        return self.k


class KVCache:
    """Keys, values, key positions and padding of past tokens, for incremental decoding.

    One object serves a whole model: each attention layer keeps its entries under its
    ``layer_idx``, one for self-attention and one for cross-attention. An entry records the layer
    that wrote it, and only that layer may read it (a layer that finds another layer's entry, a
    changed batch size or, in cross-attention, another context raises ``ValueError``). Queries of a
    decoding step get positions that continue from the cache (``past_len + arange(T)``, or from the
    padding mask or document ids when there are some).
    """

    def __init__(self, window: int | None = None, sink_tokens: int = 0) -> None:
        """Args:
        window: None (keep every token), or StreamingLLM (Xiao et al. 2023): every layer keeps the
            first ``sink_tokens`` tokens and the last ``window`` ones, memory ``O(sink_tokens +
            window)`` for any number of steps. Positions are those inside the cache (the paper's
            rule): cached keys are kept unrotated and rotary encodings rotate them at each step.
        sink_tokens: with ``window``, the first tokens that are never evicted (attention sinks).
        """
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"KVCache: window must be a positive int or None, got {window!r}")
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"KVCache: sink_tokens must be an int >= 0, got {sink_tokens!r}")
        if sink_tokens and window is None:
            raise ValueError("KVCache: sink_tokens needs a window (StreamingLLM keeps sinks plus a window)")
        self.window, self.sink_tokens = window, sink_tokens
        self._entries: dict[tuple[int, bool], _CacheEntry] = {}

    @property
    def streaming(self) -> bool:
        """True for a StreamingLLM cache (a window of recent tokens plus sink tokens)."""
        return self.window is not None

    def get(self, layer_idx: int = 0, *, cross: bool = False) -> _CacheEntry | None:
        return self._entries.get((layer_idx, cross))

    def length(self, layer_idx: int = 0, *, cross: bool | None = None) -> int:
        """Number of cached tokens of layer ``layer_idx`` (0 when empty).

        ``cross=None``: the self-attention entry, or the cross-attention one when there is no other.
        """
        entry = self.get(layer_idx, cross=bool(cross))
        if entry is None and cross is None:
            entry = self.get(layer_idx, cross=True)
        return 0 if entry is None else entry.k.shape[2]

    def __len__(self) -> int:
        selfs = sorted(idx for idx, cross in self._entries if not cross)
        return self.length(selfs[0], cross=False) if selfs else 0

    def update(self, layer_idx: int, entry: _CacheEntry, *, cross: bool = False) -> None:
        self._entries[(layer_idx, cross)] = entry

    def reset(self) -> None:
        self._entries.clear()

    def __repr__(self) -> str:
        layers = sorted({idx for idx, _ in self._entries})
        return f"KVCache(layers={layers}, length={len(self)})"


class MultiheadAttention(nn.Module):
    """Multi-head attention that runs any positional encoding on the fastest correct backend.

    Args:
        embed_dim: model width ``E``.
        num_heads: query heads ``H``; ``E`` must be divisible by ``H`` (head size ``D = E / H``).
        encoding: a spec string (``"rope:base=500000"``), a built encoding, or None (NoPE).
            The layer hands the encoding a :class:`~posenc.base.LayerContext` (its sizes,
            ``causal``, device and dtype); the encoding takes the options it declares from it.
        causal: mask future keys in self-attention (cross-attention is never causal).
        window: sliding window ``W`` (causal layers): query ``i`` sees keys ``i - W < j <= i``
            (the HF / Mistral convention: its own key and the ``W - 1`` before it).
        chunk: chunked attention ``C`` (causal layers, Llama 4): query ``i`` sees keys ``j <= i``
            with ``j // C == i // C``.
        sinks: learned attention sinks (gpt-oss): one logit per head, :attr:`sinks` ``[H]``
            (initialised to 0), joins every row's softmax denominator and carries no value.
        query_temperature: a :class:`~posenc.patterns.QueryTemperature` (Llama 4's NoPE layers):
            queries at position ``p`` are scaled by ``log1p(floor((p + 1) / floor_scale)) *
            attn_scale + 1`` after the encoding acts.
        backend: ``"auto"`` (first backend with no reasons), or a backend name to force.
        num_kv_heads: key/value heads for grouped-query attention (divides ``num_heads``).
        dropout: attention-probability dropout during training.
        bias: whether the projections have biases.
        scale: logit scale; default the encoding's (``1/sqrt(D)``, DeBERTa ``1/sqrt(D·s)``).
            Pass ``scale=1.0`` to reproduce HF T5, which has no logit scaling.
        layer_idx: key of this layer's entry in a shared :class:`KVCache`.

    Call: ``attn(x [B, Tq, E], context=None [B, Tk, E], *, positions, context_positions,
    key_padding_mask [B, Tk] (True = padding), attn_mask (bool, True = may attend, or float added
    to the logits; [Tq, Tk], [B, Tq, Tk] or [B, H, Tq, Tk]), document_ids [B, Tq] (packed
    documents: a token sees its own document only, and its default position counts from the
    document's start), prefix_len (int or [B]: bidirectional over the first tokens of a causal
    layer, a prefix LM), cache, need_weights)`` returns
    ``out [B, Tq, E]``, or ``(out, weights [B, H, Tq, Tk])`` with ``need_weights=True``. The weights
    are the attention probabilities before dropout, from any backend (recomputed on the eager
    reference path when the backend does not produce them).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        encoding: str | PositionalEncoding | None = None,
        *,
        causal: bool = False,
        window: int | None = None,
        chunk: int | None = None,
        sinks: bool = False,
        query_temperature: QueryTemperature | None = None,
        backend: str = "auto",
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        scale: float | None = None,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for label, value in (
            ("embed_dim", embed_dim),
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{label} must be an int, got {value!r} ({type(value).__name__})")
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be positive, got {embed_dim} and {num_heads}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must be positive and divide num_heads={num_heads}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if backend != "auto":
            from .backends import get_backend

            get_backend(backend)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.backend, self.dropout, self.layer_idx = causal, backend, dropout, layer_idx
        self.window = _check_span("window", window, causal)
        self.chunk = _check_span("chunk", chunk, causal)
        factory = {"device": device, "dtype": dtype}
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if not isinstance(sinks, bool):
            raise ValueError(f"sinks must be True or False, got {sinks!r}")
        self.sinks = nn.Parameter(torch.zeros(num_heads, **factory)) if sinks else None
        if query_temperature is not None and not isinstance(query_temperature, QueryTemperature):
            raise ValueError(
                f"query_temperature must be a posenc.patterns.QueryTemperature, got {query_temperature!r}"
            )
        self.query_temperature = query_temperature
        context = LayerContext(num_heads, self.head_dim, embed_dim, causal=causal, device=device, dtype=dtype)
        self.encoding = build_for_layer(encoding, context)
        if self.encoding.causal_only and not causal:
            raise ValueError(f"{self._causal_only_message()}: pass causal=True")
        self.encoding.init_layer(self)
        _register_user(self.encoding, self)
        self.scale = self.encoding.logit_scale(self.head_dim) if scale is None else check_scale(scale)
        self.last_backend: str | None = None
        self._layout = 0  # bumped when switch_rope_pairing_ permutes the q/k channels

    def __setstate__(self, state: dict) -> None:  # a copy (deepcopy, pickle) is a user of its encoding too
        super().__setstate__(state)
        _register_user(self.encoding, self)

    def _causal_only_message(self) -> str:
        hint = self.encoding.noncausal_options
        alternative = (
            f" (or build it with {', '.join(f'{k}={v!r}' for k, v in hint.items())})" if hint else ""
        )
        return f"encoding {self.encoding.name!r} is defined for causal attention only{alternative}"

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"causal={self.causal}, backend={self.backend!r}, scale={self.scale:.4g}"
            + (f", window={self.window}" if self.window is not None else "")
            + (f", chunk={self.chunk}" if self.chunk is not None else "")
            + (", sinks=True" if self.sinks is not None else "")
        )

    # ------------------------------------------------------------------ input checks
    def _check_input(self, x: Tensor, name: str) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.embed_dim:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must have shape [B, T, {self.embed_dim}], got {shape}")
        weight_dtype = self.q_proj.weight.dtype
        if x.dtype != weight_dtype:
            raise ValueError(
                f"{name} has dtype {x.dtype} but the layer's parameters are {weight_dtype}; cast one of them"
            )
        if x.device != self.q_proj.weight.device:
            raise ValueError(
                f"{name} is on device {x.device} but the layer's parameters are on {self.q_proj.weight.device}; "
                "move one of them (layer.to(device) or x.to(device))"
            )

    @staticmethod
    def _check_devices(x: Tensor, **arguments: Any) -> None:
        """Every tensor argument lies on ``x``'s device; a ValueError names the first that does not."""
        for name, value in arguments.items():
            if isinstance(value, Tensor) and value.device != x.device:
                raise ValueError(
                    f"{name} is on device {value.device} but x is on {x.device}; move {name} to {x.device}"
                )

    def _positions(self, given: Tensor | None, name: str, batch: int, length: int, default: Tensor) -> Tensor:
        if given is None:
            return self.encoding.check_positions(default, name=name)
        positions = self.encoding.check_positions(given, name=name)
        if positions.shape[-1] != length or positions.shape[0] not in (1, batch):
            raise ValueError(
                f"{name} must have shape [{length}] or [{batch}, {length}], got {tuple(given.shape)}"
            )
        return positions.to(default.device)

    def _check_padding(self, mask: Tensor, batch: int, length: int, name: str) -> Tensor:
        if mask.dtype != torch.bool:
            raise ValueError(f"{name} must be a bool tensor (True = padding), got dtype {mask.dtype}")
        if tuple(mask.shape) != (batch, length):
            raise ValueError(f"{name} must have shape [{batch}, {length}], got {tuple(mask.shape)}")
        return mask

    def _check_attn_mask(self, mask: Tensor, batch: int, q_len: int, k_len: int) -> Tensor:
        if mask.dim() == 2:
            mask = mask[None, None]
        elif mask.dim() == 3:
            mask = mask[:, None]
        ok = (
            mask.dim() == 4
            and mask.shape[0] in (1, batch)
            and mask.shape[1] in (1, self.num_heads)
            and tuple(mask.shape[2:]) == (q_len, k_len)
        )
        if not ok:
            raise ValueError(
                f"attn_mask must have shape [Tq, Tk], [B, Tq, Tk] or [B, H, Tq, Tk] with Tq={q_len}, Tk={k_len}, "
                f"B in (1, {batch}), H in (1, {self.num_heads}); got {tuple(mask.shape)}"
            )
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise ValueError(f"attn_mask must be bool (True = may attend) or float, got dtype {mask.dtype}")
        return mask

    # ------------------------------------------------------------------ forward
    @overload
    def forward(
        self, x: Tensor, context: Tensor | None = ..., *, need_weights: Literal[False] = ..., **kw
    ) -> Tensor: ...

    @overload
    def forward(
        self, x: Tensor, context: Tensor | None = ..., *, need_weights: Literal[True], **kw
    ) -> tuple[Tensor, Tensor]: ...

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        positions: Tensor | None = None,
        context_positions: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        prefix_len: int | Tensor | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        self._check_input(x, "x")
        self._check_devices(
            x,
            context=context,
            positions=positions,
            context_positions=context_positions,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            document_ids=document_ids,
            prefix_len=prefix_len,
        )
        batch, q_len, _ = x.shape
        docs, states = None, None
        if context is not None:
            self._check_context(context, batch, document_ids, prefix_len)
            q, k, v, q_pos, k_pos, padding = self._cross_inputs(
                x, context, positions, context_positions, key_padding_mask, cache
            )
            past = 0
        else:
            entry = self._cache_entry(cache, cross=False, batch=batch)
            past = 0 if entry is None else entry.k.shape[2]
            if cache is not None and cache.streaming:
                self._check_streaming(positions, key_padding_mask, document_ids, prefix_len)
                states = self._token_states(x, entry, None)
                q, k, v, q_pos, k_pos = self._streaming_inputs(x, entry, cache, states)
                padding = None
            else:
                padding = self._padding_with_cache(key_padding_mask, entry, batch, q_len)
                docs = self._documents_with_cache(document_ids, entry, batch, q_len)
                evicted = 0 if entry is None else entry.evicted
                if docs is None:
                    default = default_positions(q_len, past + evicted, padding, x.device)
                else:
                    default = document_positions(docs)[:, past:]
                q_pos = self._positions(positions, "positions", batch, q_len, default)
                states = self._token_states(x, entry, padding)
                q, k, v, k_pos = self._self_inputs(x, q_pos, entry, cache, padding, docs, states)
                if cache is not None and padding is None and docs is None and prefix_len is None:
                    self._trim_to_window(cache)
        if attn_mask is not None:
            attn_mask = self._check_attn_mask(attn_mask, batch, q_len, k.shape[2])
        if self.query_temperature is not None:
            q = q * temperature_factors(self.query_temperature, q_pos).to(q.dtype)
        self_attention = context is None
        mask = AttentionMask.build(
            q_len=q_len,
            k_len=k.shape[2],
            batch=batch,
            heads=self.num_heads,
            device=x.device,
            causal=self.causal and self_attention,
            causal_offset=past,
            key_padding_mask=padding,
            attn_mask=attn_mask,
            window=self.window if self_attention else None,
            chunk=self.chunk if self_attention else None,
            q_document_ids=None if docs is None else docs[:, past:],
            k_document_ids=docs,
            prefix_len=self._prefix_lengths(prefix_len, batch, k.shape[2], x.device),
        )
        request = AttentionRequest(
            q=q,
            k=k,
            v=v,
            encoding=self.encoding,
            q_pos=q_pos,
            k_pos=k_pos,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            layer=self,
            mask=mask,
            sinks=self.sinks,
            token_states=states,
        )
        out, weights = self._run(request)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, q_len, self.embed_dim))
        return (out, weights) if need_weights else out

    def default_positions(
        self,
        batch: int,
        q_len: int,
        key_padding_mask: Tensor | None = None,
        cache: KVCache | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Positions ``[B or 1, q_len]`` this layer gives new tokens when none are passed.

        ``arange`` continuing after the tokens in ``cache``; with a ``key_padding_mask`` (left
        padding), the number of real tokens before each one; with ``document_ids``, the offset from
        the token's document start. A model computes them once and hands them to every layer.
        """
        entry = self._cache_entry(cache, cross=False, batch=batch)
        past = 0 if entry is None else entry.k.shape[2]
        docs = self._documents_with_cache(document_ids, entry, batch, q_len)
        if docs is not None:
            return document_positions(docs)[:, past:]
        if cache is not None and cache.streaming:
            return torch.arange(past, past + q_len, device=self.q_proj.weight.device)[None]
        padding = self._padding_with_cache(key_padding_mask, entry, batch, q_len)
        evicted = 0 if entry is None else entry.evicted
        return default_positions(q_len, past + evicted, padding, self.q_proj.weight.device)

    # ------------------------------------------------------------------ bounded caches
    def _trim_to_window(self, cache: KVCache) -> None:
        """A windowed layer keeps only the ``window - 1`` newest keys: the next query sees no older one.

        Chunked layers keep everything (chunk boundaries count keys from the first token).
        """
        entry = cache.get(self.layer_idx)
        if self.window is None or self.chunk is not None or entry is None:
            return
        drop = entry.k.shape[2] - (self.window - 1)
        if drop <= 0:
            return
        entry.k, entry.v = entry.k[:, :, drop:], entry.v[:, :, drop:]
        entry.k_pos = entry.k_pos[:, drop:]
        if entry.token_state is not None:
            entry.token_state, entry.token_index = entry.token_state[..., drop:], entry.token_index[drop:]
        entry.evicted += drop

    def _token_states(
        self, x: Tensor, entry: _CacheEntry | None, padding: Tensor | None
    ) -> TokenStates | None:
        """An input-dependent bias's states: the new tokens' (queries) after the cached ones (keys: all).

        ``padding [B, past + T]`` covers every key; None for position-only encodings.
        """
        if not self.encoding.input_dependent:
            return None
        q_len = x.shape[1]
        new_padding = None if padding is None else padding[:, padding.shape[1] - q_len :]
        previous = None if entry is None else entry.token_state
        new = self.encoding.token_states(x, previous, new_padding)
        if entry is None or previous is None:
            return TokenStates.same_sequence(new)
        cached = entry.token_index
        start = int(cached[-1]) + 1 if cached.numel() else 0  # only the order of indices matters
        q_index = torch.arange(start, start + q_len, device=x.device)
        keys = torch.cat([previous, new], dim=-1)
        return TokenStates(q=new, k=keys, q_index=q_index, k_index=torch.cat([cached, q_index]))

    def _check_streaming(
        self,
        positions: Tensor | None,
        key_padding_mask: Tensor | None,
        document_ids: Tensor | None,
        prefix_len: int | Tensor | None,
    ) -> None:
        given = {
            "positions": positions,
            "key_padding_mask": key_padding_mask,
            "document_ids": document_ids,
            "prefix_len": prefix_len,
        }
        for name, value in given.items():
            if value is not None:
                raise ValueError(
                    f"{name}: a streaming KVCache (window=...) assigns positions inside the cache; "
                    f"it takes no {name}"
                )
        if self.encoding.kind is Kind.ABSOLUTE and not self.encoding.shift_invariant:
            raise ValueError(
                f"a streaming KVCache re-assigns positions, but {self.encoding.name!r} adds absolute positions "
                "to the layer input, which cached keys cannot shed; use a rotary, bias or relative encoding"
            )
        if self.window is not None or self.chunk is not None:
            raise ValueError("a streaming KVCache serves layers without window or chunk of their own")

    def _streaming_inputs(
        self, x: Tensor, entry: _CacheEntry | None, cache: KVCache, states: TokenStates | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``q, k, v, q_pos, k_pos`` with positions inside the cache (StreamingLLM), then evicts."""
        past = 0 if entry is None else entry.k.shape[2]
        q_len = x.shape[1]
        device = x.device
        q = self._heads(self.q_proj(x), self.num_heads)
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        if entry is not None:  # cached keys are unrotated
            k, v = torch.cat([entry.k, k], dim=2), torch.cat([entry.v, v], dim=2)
        q_pos = torch.arange(past, past + q_len, device=device)[None]
        k_pos = torch.arange(past + q_len, device=device)[None]
        kept = _streaming_keep(past + q_len, cache.sink_tokens, cache.window)
        stored = _CacheEntry(k=k[:, :, kept], v=v[:, :, kept], k_pos=k_pos[:, kept], padding=None)
        if states is not None:
            stored.token_state, stored.token_index = states.k[..., kept], states.k_index[kept]
        self._write_cache(cache, stored)
        if self.encoding.kind is Kind.ROTARY:
            q, k = self.encoding.rotate(q, k, q_pos, k_pos)
        return q, k, v, q_pos, k_pos

    def _check_context(
        self, context: Tensor, batch: int, document_ids: Tensor | None, prefix_len: int | Tensor | None
    ) -> None:
        self._check_input(context, "context")
        if context.shape[0] != batch:
            raise ValueError(f"context batch {context.shape[0]} differs from x batch {batch}")
        if document_ids is not None or prefix_len is not None:
            name = "document_ids" if document_ids is not None else "prefix_len"
            raise ValueError(f"{name} applies to self-attention only; cross-attention got it with a context")
        if self.encoding.causal_only:
            raise ValueError(f"{self._causal_only_message()}; cross-attention is never causal")
        if self.encoding.self_attention_only:
            raise ValueError(
                f"{self.encoding.name!r} needs queries and keys from one sequence (self-attention); "
                "cross-attention got a context: use another encoding in cross-attention layers"
            )

    def _self_inputs(
        self,
        x: Tensor,
        q_pos: Tensor,
        entry: _CacheEntry | None,
        cache: KVCache | None,
        padding: Tensor | None,
        docs: Tensor | None,
        states: TokenStates | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``q, k, v, k_pos`` of self-attention: the new tokens' keys after the cached ones."""
        batch = x.shape[0]
        if self.encoding.kind is Kind.ABSOLUTE:
            x = embed_positions(self.encoding, x, q_pos)
        q = self._heads(self.q_proj(x), self.num_heads)
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        if self.encoding.kind is Kind.ROTARY:  # fresh projections: rotated in place where the encoding can
            q, k = self.encoding.rotate_fresh(q, k, q_pos, q_pos)
        k_pos = q_pos
        if entry is not None:
            k = torch.cat([entry.k, k], dim=2)
            v = torch.cat([entry.v, v], dim=2)
            k_pos = torch.cat([entry.k_pos.expand(batch, -1), k_pos.expand(batch, -1)], dim=1)
        if cache is not None:
            self._write_cache(
                cache,
                _CacheEntry(
                    k=k,
                    v=v,
                    k_pos=k_pos,
                    padding=padding,
                    document_ids=docs,
                    evicted=0 if entry is None else entry.evicted,
                    token_state=None if states is None else states.k,
                    token_index=None if states is None else states.k_index,
                ),
            )
        return q, k, v, k_pos

    def _documents_with_cache(
        self, document_ids: Tensor | None, entry: _CacheEntry | None, batch: int, q_len: int
    ) -> Tensor | None:
        """Document ids of every key ``[B, past + q_len]`` (cached ones first), checked; or None."""
        cached = None if entry is None else entry.document_ids
        if document_ids is None:
            if cached is not None:
                raise ValueError(
                    "document_ids: the cache was written with document ids; pass the new tokens' ids too"
                )
            return None
        if (
            not isinstance(document_ids, Tensor)
            or document_ids.dtype.is_floating_point
            or document_ids.dtype
            in (
                torch.bool,
                torch.complex64,
                torch.complex128,
            )
        ):
            raise ValueError("document_ids must be an integer tensor [B, T] (one document id per token)")
        if tuple(document_ids.shape) != (batch, q_len):
            raise ValueError(
                f"document_ids must have shape [B, T] = [{batch}, {q_len}], got {tuple(document_ids.shape)}"
            )
        if entry is not None and cached is None:
            raise ValueError(
                "document_ids: the cache was written without document ids; pass them from the first step"
            )
        docs = document_ids.long().to(self.q_proj.weight.device)
        if cached is not None:
            docs = torch.cat([cached, docs], dim=1)
        if docs.shape[1] > 1 and checks_values() and bool((docs[:, 1:] < docs[:, :-1]).any()):
            raise ValueError(
                "document_ids must be non-decreasing along each row (packed documents are contiguous "
                "runs of one id), so that positions can restart at each document's first token"
            )
        return docs

    def _prefix_lengths(
        self, prefix_len: int | Tensor | None, batch: int, k_len: int, device
    ) -> Tensor | None:
        """``prefix_len`` as ``[B]`` int64, checked against the keys; None when not given."""
        if prefix_len is None:
            return None
        if not self.causal:
            raise ValueError("prefix_len needs a causal layer (a non-causal layer already sees every key)")
        if self.encoding.causal_only:
            raise ValueError(
                f"prefix_len: {self._causal_only_message()}, and a prefix LM attends to future keys of the prefix"
            )
        if not (isinstance(prefix_len, Tensor) or _is_int(prefix_len)) and not (
            isinstance(prefix_len, (list, tuple)) and all(_is_int(n) for n in prefix_len)
        ):
            raise ValueError(
                f"prefix_len must be an int or an integer tensor [B] (the prefix length of each sequence), "
                f"got {prefix_len!r} ({type(prefix_len).__name__})"
            )
        lengths = torch.as_tensor(prefix_len, device=device)
        if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.dim() > 1:
            raise ValueError(f"prefix_len must be an int or an integer tensor [B], got {prefix_len!r}")
        lengths = lengths.long().expand(batch) if lengths.dim() == 0 else lengths.long()
        if lengths.shape != (batch,):
            raise ValueError(f"prefix_len must have shape [B] = [{batch}], got {tuple(lengths.shape)}")
        if checks_values() and (bool((lengths < 0).any()) or bool((lengths > k_len).any())):
            raise ValueError(
                f"prefix_len must be in [0, {k_len}] (the number of keys), got {lengths.tolist()}"
            )
        return lengths

    def _cross_inputs(
        self,
        x: Tensor,
        context: Tensor,
        positions: Tensor | None,
        context_positions: Tensor | None,
        key_padding_mask: Tensor | None,
        cache: KVCache | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """``q, k, v, q_pos, k_pos, padding`` of cross-attention (keys from the cache when it has them)."""
        batch, q_len, _ = x.shape
        entry = self._cache_entry(cache, cross=True, batch=batch, context=context)
        k_len = context.shape[1] if entry is None else entry.k.shape[2]
        padding = None
        if key_padding_mask is not None:
            padding = self._check_padding(key_padding_mask, batch, k_len, "key_padding_mask")
        q_pos = self._positions(
            positions, "positions", batch, q_len, torch.arange(q_len, device=x.device)[None]
        )
        if self.encoding.kind is Kind.ABSOLUTE:
            x = embed_positions(self.encoding, x, q_pos)
        q = self._heads(self.q_proj(x), self.num_heads)
        if entry is not None:
            k, v, k_pos = entry.k, entry.v, entry.k_pos
            if self.encoding.kind is Kind.ROTARY:
                q, _ = self.encoding.rotate(q, k[:, :, :0], q_pos, k_pos[:, :0])
            return q, k, v, q_pos, k_pos, padding
        k_default = torch.arange(context.shape[1], device=x.device)[None]
        k_pos = self._positions(context_positions, "context_positions", batch, context.shape[1], k_default)
        if self.encoding.kind is Kind.ABSOLUTE:
            context = embed_positions(self.encoding, context, k_pos)
        k = self._heads(self.k_proj(context), self.num_kv_heads)
        v = self._heads(self.v_proj(context), self.num_kv_heads)
        if self.encoding.kind is Kind.ROTARY:
            q, k = self.encoding.rotate(q, k, q_pos, k_pos)
        if cache is not None:
            entry = _CacheEntry(k=k, v=v, k_pos=k_pos, padding=padding, context_key=_tensor_key(context))
            self._write_cache(cache, entry, cross=True)
        return q, k, v, q_pos, k_pos, padding

    # ------------------------------------------------------------------ cache
    def _describe(self) -> str:
        return (
            f"MultiheadAttention(layer_idx={self.layer_idx}, encoding={self.encoding.spec()!r}, "
            f"heads={self.num_heads}/{self.num_kv_heads}, head_dim={self.head_dim}, sinks={self.sinks is not None})"
        )

    def _cache_entry(
        self, cache: KVCache | None, *, cross: bool, batch: int, context: Tensor | None = None
    ) -> _CacheEntry | None:
        """This layer's entry of ``cache``, after checking that this layer wrote it for this batch."""
        if cache is None:
            return None
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a posenc.KVCache, got {type(cache).__name__}")
        entry = cache.get(self.layer_idx, cross=cross)
        if entry is None:
            return None
        kind = "cross-attention" if cross else "self-attention"
        entry.check_reader(
            self,
            what=f"the {kind} entry of layer_idx={self.layer_idx}",
            batch=batch,
            device=self.q_proj.weight.device,
            fresh="KVCache",
        )
        if cross and context is not None and entry.context_key != _tensor_key(context):
            raise ValueError(
                f"cache: the cross-attention entry of layer_idx={self.layer_idx} holds the keys of another "
                "context; pass the same context tensor, or reset the cache for a new one"
            )
        return entry

    def _write_cache(self, cache: KVCache, entry: _CacheEntry, *, cross: bool = False) -> None:
        entry.stamp(self)
        if cache.streaming and not cross:
            entry.rotation_dropped = None  # stored unrotated: every step rotates them in its own mode
        cache.update(self.layer_idx, entry, cross=cross)

    def _rotary(self) -> PositionalEncoding:
        """The encoding whose rotation the cached keys carry (read by the cache's stamp)."""
        return self.encoding

    def _run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        self.last_backend, out, weights = run_attention(request, self.backend)
        return out, weights

    def _heads(self, x: Tensor, heads: int) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, heads, self.head_dim).transpose(1, 2)

    def _padding_with_cache(
        self, mask: Tensor | None, entry: _CacheEntry | None, batch: int, q_len: int
    ) -> Tensor | None:
        """The padding mask over all keys: cached padding plus the new tokens' (or the full mask)."""
        if entry is None:
            return padding_with_cache(mask, None, batch, q_len)
        return padding_with_cache(mask, (entry.k.shape[2], entry.padding), batch, q_len)


def run_attention(request: AttentionRequest, backend: str = "auto") -> tuple[str, Tensor, Tensor | None]:
    """Run ``request`` on ``backend`` (or the one ``auto`` picks): ``(backend name, out, weights)``.

    With ``need_weights`` the weights come from the backend, or from the eager reference when the
    backend returns none.
    """
    check_dense_size(request, _requested_backend(backend))
    chosen = select_backend(request, backend) if checks_values() else _traced_backend(request, backend)
    out, weights = chosen.run(request)
    if request.need_weights and weights is None:
        weights = attention_probs(request)
    return chosen.name, out, weights


def _requested_backend(backend: str) -> str:
    """The backend a call asks for: ``use_backend(...)``'s wins over the layer's, as in ``select_backend``."""
    return getattr(_backends._forced, "name", None) or backend


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


_backends.available_backends()  # register every backend now: a compiled forward cannot import them

#: The backends a compiled forward (``torch.compile(layer, fullgraph=True)``) may run, in ``auto``'s
#: order there: their checks and kernels trace into one graph. The others' checks read tensor
#: values or the file system (a compiler's presence), which a graph cannot hold.
TRACEABLE_BACKENDS = ("sdpa", "eager")


def _traced_backend(request: AttentionRequest, backend: str) -> Backend:
    """The backend of a call traced by ``torch.compile``: the requested one if it can be traced and
    run, else the first of :data:`TRACEABLE_BACKENDS` that can run the request."""
    # Value checks stay out of the graph (posenc.base.checks_values): the nan check is settled here.
    request.__dict__.setdefault("has_nonfinite", False)
    forced = _requested_backend(backend)
    names = (forced,) if forced != "auto" else TRACEABLE_BACKENDS
    for name in names:
        if name not in TRACEABLE_BACKENDS:
            raise NoBackendError(
                f"backend {name!r} cannot be traced by torch.compile; use one of {', '.join(TRACEABLE_BACKENDS)} "
                "or 'auto' in a compiled layer"
            )
        candidate = get_backend(name)
        if not candidate.reasons(request):
            return candidate
    return select_backend(request, backend)  # none fits: the dispatcher's error names every reason


def padding_with_cache(
    mask: Tensor | None, cached: tuple[int, Tensor | None] | None, batch: int, q_len: int
) -> Tensor | None:
    """The key padding ``[B, past + q_len]`` (True = padding) of a call, or None when nothing is padded.

    ``cached`` is ``(past, cached padding or None)`` when a cache holds ``past`` tokens. ``mask`` may
    cover every key ``[B, past + q_len]`` or, after a cache, only the new tokens ``[B, q_len]``.
    """
    past, previous = cached if cached is not None else (0, None)
    if mask is None:
        if previous is None:
            return None
        return torch.cat([previous, previous.new_zeros(batch, q_len)], dim=1)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = f"dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"key_padding_mask must be a bool tensor (True = padding), got {got}")
    if tuple(mask.shape) == (batch, past + q_len):
        return mask
    if tuple(mask.shape) == (batch, q_len) and cached is not None:
        previous = previous if previous is not None else mask.new_zeros(batch, past)
        return torch.cat([previous, mask], dim=1)
    raise ValueError(
        f"key_padding_mask must have shape [B, Tk] = [{batch}, {past + q_len}] (or [{batch}, {q_len}] "
        f"for the new tokens of a cached step), got {tuple(mask.shape)}"
    )


def default_positions(q_len: int, past: int, padding: Tensor | None, device: torch.device) -> Tensor:
    """Positions ``[B or 1, q_len]`` of ``q_len`` new tokens after ``past`` earlier ones.

    ``past`` counts every earlier token, those a windowed cache has evicted included. Without
    padding, ``past + arange(q_len)``. With ``padding [B, S]`` (True = padding, left padding as HF
    ``generate`` and BLOOM use it) over the last ``S`` of the ``past + q_len`` tokens, a token's
    position counts the real tokens before it, so every sequence starts at 0 whatever its padding;
    the ``past + q_len - S`` tokens before the mask (evicted from a windowed cache, which evicts
    only tokens it holds no padding for) count as real.
    """
    if padding is None:
        return torch.arange(past, past + q_len, device=device)[None]
    before = past + q_len - padding.shape[1]
    if before < 0:
        raise ValueError(
            f"default_positions: the padding covers {padding.shape[1]} tokens, more than the "
            f"{past + q_len} of past={past} and q_len={q_len}"
        )
    real = (~padding).long()
    positions = (real.cumsum(dim=1) - 1 + before).clamp(min=0)
    return positions[:, positions.shape[1] - q_len :]


def _streaming_keep(length: int, sinks: int, window: int) -> slice | Tensor:
    """Indices of the tokens a StreamingLLM cache keeps out of ``length``: the first ``sinks`` and
    the last ``window``."""
    if length <= sinks + window:
        return slice(None)
    return torch.cat([torch.arange(sinks), torch.arange(length - window, length)])


def _tensor_key(x: Tensor) -> tuple:
    """Identifies a tensor's contents without reading them: storage, shape, strides, in-place version."""
    return (x.data_ptr(), tuple(x.shape), x.stride(), x._version, x.device.type)


def temperature_factors(temperature: QueryTemperature, positions: Tensor) -> Tensor:
    """Query scales ``[B|1, 1, T, 1]`` (float32): ``log1p(floor((p + offset) / floor_scale)) * attn_scale + 1``."""
    p = positions.to(torch.float32)
    shifted = (p + temperature.position_offset) / temperature.floor_scale
    factors = torch.log1p(torch.floor(shifted)) * temperature.attn_scale + 1.0
    return factors[:, None, :, None]


def document_positions(document_ids: Tensor) -> Tensor:
    """Positions ``[B, T]`` that restart at 0 at each document's first token.

    ``document_ids [B, T]`` holds non-decreasing integer ids per row (packed documents).
    """
    length = document_ids.shape[1]
    index = torch.arange(length, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_scale(scale: object) -> float:
    """A layer's ``scale=`` as a float: finite and > 0, else a ValueError naming ``scale`` (a nan or
    inf scale made every row of the output the same vector; a negative one inverts the attention)."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(
            f"scale must be a number (the logit scale; None for 1/sqrt(head_dim)), got {scale!r}"
        )
    value = float(scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"scale must be finite and > 0 (the logit scale; None for 1/sqrt(head_dim)), got {scale!r}"
        )
    return value


def _check_span(name: str, value: int | None, causal: bool) -> int | None:
    """A window or chunk size: None, or a positive int on a causal layer."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int (a number of tokens) or None, got {value!r}")
    if not causal:
        raise ValueError(f"{name}={value} needs causal=True: the {name} is defined over past keys only")
    return value


def embed_positions(encoding: PositionalEncoding, x: Tensor, positions: Tensor) -> Tensor:
    """ABSOLUTE encodings act here and nowhere else: ``x [B, T, E]`` plus the encoding of ``positions``.

    ``positions`` is ``[T]``, ``[1, T]`` or ``[B, T]``; it is checked against the encoding's range.
    A :class:`MultiheadAttention` with an ABSOLUTE encoding calls it on its input; a model calls it
    once on the token embeddings.
    """
    positions = encoding.check_positions(positions)
    return encoding.embed(x, positions.expand(x.shape[0], -1))


def switch_rope_pairing_(module: nn.Module, pairing: Literal["half", "interleaved"] = "interleaved") -> int:
    """Switch the RoPE of every attention layer in ``module`` to ``pairing``, in place, exactly.

    Half pairing (HF/GPT-NeoX: channel ``k`` with ``k + d_r/2``) and interleaved pairing (the paper,
    Meta's original Llama: ``2k`` with ``2k+1``) are one model up to a permutation of each head's q
    and k channels (docs/conventions.md §7.3). This permutes the output rows of every such layer's
    ``q_proj`` and ``k_proj`` (weights and biases; :func:`posenc.functional.convert_rope_pairing`) and
    switches the encoding, so every attention score, and so the layer's output, stays the same up
    to float rounding. Values and the output projection are untouched.

    Why: the layer rotates its fresh q/k projections in place, and interleaved pairs rotate as one
    complex multiply (one pass; 145% of the time of copying q and k, measured on 2 CPU threads),
    while half pairs take five eager elementwise passes (35%). A checkpoint in HF's half layout runs
    its rotations faster after one switch. Save it with the encodings' new spec (``pairing`` is in
    :meth:`~posenc.base.PositionalEncoding.spec`): its weights are now in the interleaved layout.

    Args:
        module: a model, or one :class:`MultiheadAttention`.
        pairing: the pairing to switch to.

    Returns:
        How many layers were switched (layers already in ``pairing`` are left alone).

    Raises:
        ValueError: ``pairing`` is not ``"half"`` or ``"interleaved"``; or an encoding to switch also
            serves a module other than a :class:`MultiheadAttention` in ``module`` (such as
            :class:`~posenc.mla.MultiLatentAttention`, which keeps HF's half layout), or a layer
            outside ``module`` (one RoPE object passed to two layers, only one of them in
            ``module``): nothing is changed. Layers in ``module`` that share one encoding (a model
            built with one RoPE object) are all switched.
        A :class:`KVCache` entry written before the switch is refused afterwards.
    """
    from .encodings.rope import RoPE, _check_pairing, convert_rope_pairing

    _check_pairing(pairing)
    layers = [
        m
        for m in module.modules()
        if isinstance(m, MultiheadAttention)
        and isinstance(m.encoding, RoPE)
        and m.encoding.pairing != pairing
    ]
    encodings = {id(layer.encoding): layer.encoding for layer in layers}
    for name, parent in module.named_modules(remove_duplicate=False):
        for child_name, child in parent.named_children():
            if id(child) in encodings and not (
                isinstance(parent, MultiheadAttention) and child_name == "encoding"
            ):
                where = f"{name}.{child_name}" if name else child_name
                raise ValueError(
                    f"switch_rope_pairing_: the RoPE at {where!r} also serves {type(parent).__name__}, which "
                    "keeps its own channel layout; give the attention layers their own encoding"
                )
    inside = {id(layer) for layer in layers}
    names = {id(m): f"layer {name!r}" if name else "the layer passed" for name, m in module.named_modules()}
    for layer in layers:
        outside = [user for user in _users(layer.encoding) if id(user) not in inside]
        if outside:
            raise ValueError(
                f"switch_rope_pairing_: the RoPE of {names[id(layer)]} also serves another layer, "
                f"{outside[0]._describe()}, which is not in the module passed, and would rotate its unpermuted q/k with the new "
                "pairing; pass a module that holds every layer using that encoding (the whole model), or "
                "give the layers their own encoding. Nothing was changed"
            )
    with torch.no_grad():
        for layer in layers:
            enc = layer.encoding
            for proj, heads in ((layer.q_proj, layer.num_heads), (layer.k_proj, layer.num_kv_heads)):
                for param in (proj.weight, proj.bias):
                    if param is not None:
                        param.copy_(
                            convert_rope_pairing(
                                param, heads, layer.head_dim, enc.pairing, pairing, enc.rotary_dim
                            )
                        )
            layer._layout += 1
    for enc in encodings.values():
        enc.switch_pairing_(pairing)
    return len(layers)
