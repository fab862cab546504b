"""``posenc.MultiheadAttention``: one attention layer for every encoding.

The layer projects queries, keys and values, lets its encoding act where its kind says
(ABSOLUTE: added to the layer input; ROTARY: rotates q and k; BIAS: adds a per-head logit bias;
CONTENT: computes the logits and, optionally, a value term), and hands the call to the backend
chosen by stated reasons (:func:`posenc.backends.run.attend`). Its cache is :mod:`posenc.cache.kv_cache`,
its position rules :mod:`posenc.layers.positions`.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor, nn

from ..backends import get_backend
from ..backends.run import attend
from ..cache.carried_keys import check_carrying_cache, input_transform, store_carried, transform_heads
from ..cache.kv_cache import KVCache, KVCacheEntry, context_key, token_states_with_cache
from ..encodings.base import Kind, LayerContext, PositionalEncoding, TokenStates
from ..encodings.registry import build_for_layer
from ..encodings.rope_pairing import register_rope_user
from ..masks.attention_mask import AttentionMask
from .inputs import (
    AttentionInputs,
    check_attn_mask,
    check_devices,
    check_group_ids,
    check_input,
    check_padding,
    check_pattern,
    check_projections,
    check_scale,
    check_sizes,
)
from .patterns import LayerSpec
from .positions import (
    Step,
    checked_positions,
    embed_positions,
    prefix_lengths,
    read_step,
    step_positions,
    temperature_factors,
)
from .step import plan_for, run
from .temperature import TemperatureForm, layer_temperature

__all__ = ["AttentionInputs", "MultiheadAttention"]  # (AttentionInputs: posenc.layers.inputs)


class MultiheadAttention(nn.Module):
    """Multi-head attention that runs any positional encoding on the fastest correct backend.

    Args:
        embed_dim: model width ``E``.
        num_heads: query heads ``H``; ``E`` must be divisible by ``H`` (head size ``D = E / H``).
        encoding: a spec string (``"rope:base=500000"``), a built encoding, or None (NoPE).
            The layer hands the encoding a :class:`~posenc.encodings.base.LayerContext` (its sizes,
            ``causal``, device and dtype); the encoding takes the options it declares from it.
        causal: mask future keys in self-attention (cross-attention is never causal).
        window: sliding window ``W``: query ``i`` sees keys ``|i - j| < W``, and with ``causal`` keys
            ``i - W < j <= i`` (the HF / Mistral convention: its own key and the ``W - 1`` before it;
            without ``causal``, a band of ``W - 1`` keys on each side; docs/conventions.md §1.7 and
            :func:`posenc.masks.attention_mask.convert_window` convert the other conventions).
        chunk: chunked attention ``C`` (causal layers, Llama 4): query ``i`` sees keys ``j <= i``
            with ``j // C == i // C`` (with a ``key_padding_mask``, counted from each row's first
            real token, as HF does for a left-padded batch).
        sinks: learned attention sinks (gpt-oss): one logit per head, :attr:`sinks` ``[H]``
            (initialised to 0), joins every row's softmax denominator and carries no value.
        value_from_key: K = V (Gemma 4's global layers, ``attention_k_eq_v``): the values are the key
            projection before the encoding acts (before RoPE), and the layer has no ``v_proj``.
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``): each logit
            ``s = q·k·scale`` becomes ``softcap * tanh(s / softcap)`` before the softmax (a BIAS
            encoding's bias and the masks are added after the cap); None (default) for none. Served
            by the eager, blocked, relative and flex backends, not by sdpa or the exact splits.
        query_temperature: a :class:`~posenc.layers.temperature.QueryTemperature` (Llama 4's NoPE layers:
            queries at position ``p`` are scaled by ``log1p(floor((p + 1) / floor_scale)) *
            attn_scale + 1``) or :class:`~posenc.layers.temperature.LogQueryTemperature` (Inkling's global
            layers: ``1 + alpha * ln(max((p + 1) / n_floor, 1))``), applied after the encoding acts;
            or :class:`~posenc.layers.temperature.LearnedLogTemperature` (Mistral Large 4: the layer builds
            its own :class:`~posenc.layers.temperature.LogPositionQueryScaling`, per-head learned
            ``s_h · ln(p + 1) + b_h``, parameters ``query_temperature.scale`` / ``.bias``).
        pattern: this layer's entry of a model's pattern (a :class:`~posenc.layers.patterns.LayerSpec`):
            its window, chunk, sinks, temperature, softcap and value_from_key, given instead of those six
            arguments (its encoding is ``encoding``, which a model builds from it).
        backend: ``"auto"`` (first backend with no reasons), or a backend name to force.
        num_kv_heads: key/value heads for grouped-query attention (divides ``num_heads``).
        head_dim: per-head size ``D``; default ``E / H``. Another size (Gemma 4's global layers,
            ``global_head_dim``) makes ``q_proj`` ``E -> H·D`` and ``out_proj`` ``H·D -> E``.
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
    layer, a prefix LM), group_ids [B, Tq] (int, causal self-attention: tokens with the same
    non-negative id also see each other's later keys, Gemma 3's image tokens; -1 for none), cache,
    need_weights)`` returns
    ``out [B, Tq, E]``, or ``(out, weights [B, H, Tq, Tk])`` with ``need_weights=True``. The weights
    are the attention probabilities before dropout, from any backend (recomputed on the eager
    reference path when the backend does not produce them).
    """

    #: :func:`~posenc.encodings.rope_pairing.switch_rope_pairing_` may permute this layer's q/k projection
    #: rows (``q_proj``, ``k_proj``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``encoding``,
    #: ``qk_layout``); read by that function, so the encodings never import the layer.
    permutes_rope_channels = True

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
        value_from_key: bool = False,
        softcap: float | None = None,
        query_temperature: TemperatureForm | None = None,
        pattern: LayerSpec | None = None,
        backend: str = "auto",
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        scale: float | None = None,
        layer_idx: int = 0,
        head_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = check_sizes(embed_dim, num_heads, num_kv_heads, head_dim)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if backend != "auto":
            get_backend(backend)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads if head_dim is None else head_dim
        self.causal, self.backend, self.dropout, self.layer_idx = causal, backend, dropout, layer_idx
        self.window, self.chunk, sinks, self.query_temperature, self.softcap, value_from_key = check_pattern(
            pattern, window, chunk, sinks, query_temperature, causal, softcap, value_from_key
        )
        factory = {"device": device, "dtype": dtype}
        self.query_temperature = layer_temperature(self.query_temperature, num_heads, **factory)
        kv_dim, q_dim = num_kv_heads * self.head_dim, num_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, q_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.value_from_key = value_from_key
        self.v_proj = None if value_from_key else nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(q_dim, embed_dim, bias=bias, **factory)
        self.sinks = nn.Parameter(torch.zeros(num_heads, **factory)) if sinks else None
        context = LayerContext(num_heads, self.head_dim, embed_dim, causal=causal, device=device, dtype=dtype)
        self.encoding = build_for_layer(encoding, context)
        if self.encoding.causal_only and not causal:
            raise ValueError(f"{self._causal_only_message()}: pass causal=True")
        self.encoding.init_layer(self)
        register_rope_user(self.encoding, self)
        self.scale = self.encoding.logit_scale(self.head_dim) if scale is None else check_scale(scale)
        self.last_backend: str | None = None
        self.qk_layout = 0  # bumped when switch_rope_pairing_ permutes the q/k channels

    def __setstate__(self, state: dict) -> None:  # a copy (deepcopy, pickle) is a user of its encoding too
        super().__setstate__(state)
        register_rope_user(self.encoding, self)

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
            + (f", softcap={self.softcap:g}" if self.softcap is not None else "")
            + (", value_from_key=True" if self.value_from_key else "")
        )

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
        group_ids: Tensor | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        call = {
            "context": context,
            "positions": positions,
            "context_positions": context_positions,
            "key_padding_mask": key_padding_mask,
            "attn_mask": attn_mask,
            "document_ids": document_ids,
            "prefix_len": prefix_len,
            "group_ids": group_ids,
            "need_weights": need_weights,
        }
        return run(plan_for(self, x, cache, call), self, x, cache, call)

    def full_step(
        self,
        x: Tensor,
        cache: KVCache | None,
        *,
        context: Tensor | None = None,
        positions: Tensor | None = None,
        context_positions: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        prefix_len: int | Tensor | None = None,
        group_ids: Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """The full plan's tensor work (:mod:`posenc.layers.step`): every argument checked, positions,
        projections and the encoding, the cache, the mask, and the backend the dispatcher picks.
        Returns ``(out [B, Tq, E], weights or None)``."""
        check_input(x, "x", self.embed_dim, self.q_proj.weight)
        check_projections(self.q_proj.weight, k_proj=self.k_proj, v_proj=self.v_proj, out_proj=self.out_proj)
        given = {"context": context, "positions": positions, "context_positions": context_positions}
        given |= {"key_padding_mask": key_padding_mask, "attn_mask": attn_mask, "document_ids": document_ids}
        check_devices(x, **given, prefix_len=prefix_len, group_ids=group_ids)
        batch, q_len, _ = x.shape
        if context is None:
            inputs = self._self_inputs(x, positions, key_padding_mask, document_ids, prefix_len, cache)
        else:
            self._check_context(context, batch, document_ids, prefix_len, group_ids)
            inputs = self._cross_inputs(x, context, positions, context_positions, key_padding_mask, cache)
        mask = self._mask(inputs, attn_mask, prefix_len, group_ids, self_attention=context is None)
        out, weights = self._attend(inputs, mask, cache, need_weights, cross=context is not None)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim))
        return out, weights

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
        the token's document start (:func:`posenc.layers.positions.step_positions`, which a model calls once
        for every layer).
        """
        entry = self._cache_entry(cache, cross=False, batch=batch)
        streaming = cache is not None and cache.streaming
        device = self.q_proj.weight.device
        return step_positions(
            entry, batch, q_len, key_padding_mask, document_ids, device, streaming=streaming
        )

    # ------------------------------------------------------------------ the steps of forward
    def _self_inputs(
        self,
        x: Tensor,
        positions: Tensor | None,
        key_padding_mask: Tensor | None,
        document_ids: Tensor | None,
        prefix_len: int | Tensor | None,
        cache: KVCache | None,
    ) -> AttentionInputs:
        """Self-attention's queries, keys and values with their positions (the cached keys first),
        its padding and documents over every key, read once from this layer's cache entry."""
        batch, q_len, _ = x.shape
        entry = self._cache_entry(cache, cross=False, batch=batch)
        check_carrying_cache(self.encoding, cache)
        if cache is not None and cache.streaming:
            given = {"positions": positions, "key_padding_mask": key_padding_mask}
            given |= {"document_ids": document_ids, "prefix_len": prefix_len}
            cache.check_streaming_layer(self.encoding, window=self.window, chunk=self.chunk, **given)
            return self._streaming_inputs(x, entry, cache)
        step = read_step(entry, batch, q_len, key_padding_mask, document_ids, x.device)
        q_pos = checked_positions(self.encoding, positions, "positions", batch, q_len, step.positions)
        states = token_states_with_cache(self.encoding, x, entry, step.padding)
        q, k, v, k_pos = self._new_keys(x, q_pos, entry, cache, step, states, prefix=prefix_len is not None)
        return AttentionInputs(q, k, v, q_pos, k_pos, step.past, step.padding, step.documents, states, entry)

    def _streaming_inputs(self, x: Tensor, entry: KVCacheEntry | None, cache: KVCache) -> AttentionInputs:
        """Self-attention's inputs with positions inside the cache (StreamingLLM), which then evicts."""
        past = 0 if entry is None else entry.k.shape[2]
        states = token_states_with_cache(self.encoding, x, entry, None)
        q, k, v = self.project(x)
        k, v, q_pos, k_pos = cache.append_streaming(self, entry, k, v, states)  # k unrotated
        if self.encoding.kind is Kind.ROTARY:
            q, k = self.encoding.rotate(q, k, q_pos, k_pos)
        return AttentionInputs(q, k, v, q_pos, k_pos, past, states=states, entry=entry)

    def _new_keys(
        self,
        x: Tensor,
        q_pos: Tensor,
        entry: KVCacheEntry | None,
        cache: KVCache | None,
        step: Step,
        states: TokenStates | None,
        *,
        prefix: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``q, k, v, k_pos`` of self-attention: the new tokens' keys after the cached ones, appended
        to the cache (which keeps what this layer's window needs, see ``KVCache.append``)."""
        if self.encoding.kind is Kind.ABSOLUTE:
            x = embed_positions(self.encoding, x, q_pos)
        q, k, v = self.project(x)
        if self.encoding.kind is Kind.ROTARY:  # fresh projections: rotated in place where the encoding can
            q, k = self.encoding.rotate_fresh(q, k, q_pos, q_pos)
        transform = input_transform(self.encoding)
        if transform is not None:
            k, v = transform_heads(self.encoding, transform.key_heads, self.num_kv_heads, k, v)
        if cache is None:
            return q, k, v, q_pos
        layout = {"window": self.window, "chunk": self.chunk, "prefix": prefix}
        k, v, k_pos = cache.append(
            self,
            entry,
            k,
            v,
            q_pos,
            padding=step.padding,
            document_ids=step.documents,
            states=states,
            **layout,
        )
        if transform is not None and transform.carry_keys is not None:
            k = store_carried(cache, self.layer_idx, k, transform.carry_keys(k, states))
        return q, k, v, k_pos

    def _mask(
        self,
        inputs: AttentionInputs,
        attn_mask: Tensor | None,
        prefix_len: int | Tensor | None,
        group_ids: Tensor | None,
        *,
        self_attention: bool,
    ) -> AttentionMask:
        """The call's :class:`~posenc.masks.attention_mask.AttentionMask`: this layer's causality, window and chunk (in
        self-attention), the padding, documents, prefix or groups, and the caller's ``attn_mask``."""
        batch, _, q_len, _ = inputs.q.shape
        k_len, device, docs = inputs.k.shape[2], inputs.q.device, inputs.documents
        if attn_mask is not None:
            attn_mask = check_attn_mask(attn_mask, batch, self.num_heads, q_len, k_len)
        return AttentionMask.build(
            q_len=q_len,
            k_len=k_len,
            batch=batch,
            heads=self.num_heads,
            device=device,
            causal=self.causal and self_attention,
            causal_offset=inputs.past,
            key_padding_mask=inputs.padding,
            attn_mask=attn_mask,
            window=self.window if self_attention else None,
            chunk=self.chunk if self_attention else None,
            q_document_ids=None if docs is None else docs[:, inputs.past :],
            k_document_ids=docs,
            prefix_len=self._prefix_lengths(prefix_len, batch, k_len, device),
            group_ids=self._group_ids(group_ids, prefix_len, batch, q_len),
        )

    def _attend(
        self,
        inputs: AttentionInputs,
        mask: AttentionMask,
        cache: KVCache | None,
        need_weights: bool,
        *,
        cross: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """``(out [B, H, Tq, Dv], weights or None)`` from the backend the dispatcher picks (recorded in
        :attr:`last_backend`); the cache says how many of the keys it already knows finite."""
        q = inputs.q
        if self.query_temperature is not None:
            q = q * self._query_scale(inputs, mask).to(q.dtype)
        known, mark = (
            (0, None) if cache is None else cache.checked_keys(self.layer_idx, inputs.entry, cross=cross)
        )
        name, out, weights = attend(
            q,
            inputs.k,
            inputs.v,
            encoding=self.encoding,
            q_pos=inputs.q_pos,
            k_pos=inputs.k_pos,
            scale=self.scale,
            mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            sinks=self.sinks,
            token_states=inputs.states,
            layer=self,
            backend=self.backend,
            known_finite_keys=known,
            finite_mark=mark,
            softcap=self.softcap,
        )
        self.__dict__["last_backend"] = name  # a plain attribute: nn.Module's __setattr__ costs a step 1%
        return out, weights

    def _query_scale(self, inputs: AttentionInputs, mask: AttentionMask) -> Tensor:
        """The query temperature's scale ``[B|1, 1|H, Tq, 1]``: of the queries' positions, or, for SSMax,
        of the number of keys each query sees (counted from ``mask``)."""
        if self.query_temperature.reads_visible_keys:
            return self.query_temperature.factors_from_counts(mask.visible_keys())
        return temperature_factors(self.query_temperature, inputs.q_pos)

    def _check_context(
        self,
        context: Tensor,
        batch: int,
        document_ids: Tensor | None,
        prefix_len: int | Tensor | None,
        group_ids: Tensor | None = None,
    ) -> None:
        check_input(context, "context", self.embed_dim, self.q_proj.weight)
        if context.shape[0] != batch:
            raise ValueError(f"context batch {context.shape[0]} differs from x batch {batch}")
        given = {"document_ids": document_ids, "prefix_len": prefix_len, "group_ids": group_ids}
        for name, value in given.items():
            if value is not None:
                raise ValueError(
                    f"{name} applies to self-attention only; cross-attention got it with a context"
                )
        if self.encoding.causal_only:
            raise ValueError(f"{self._causal_only_message()}; cross-attention is never causal")
        if self.encoding.self_attention_only:
            raise ValueError(
                f"{self.encoding.name!r} needs queries and keys from one sequence (self-attention); "
                "cross-attention got a context: use another encoding in cross-attention layers"
            )

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
        return prefix_lengths(prefix_len, batch, k_len, device)

    def _group_ids(
        self, group_ids: Tensor | None, prefix_len: int | Tensor | None, batch: int, q_len: int
    ) -> Tensor | None:
        """``group_ids`` checked (``[B, Tq]`` integer ids of this call's tokens); None when not given."""
        if group_ids is None:
            return None
        group_ids = check_group_ids(group_ids, batch, q_len)
        if not self.causal:
            raise ValueError("group_ids needs a causal layer (a non-causal layer already sees every key)")
        if prefix_len is not None:
            raise ValueError("give prefix_len or group_ids, not both (each replaces the causal mask)")
        if self.encoding.causal_only:
            raise ValueError(
                f"group_ids: {self._causal_only_message()}, and a group attends to its later keys"
            )
        return group_ids

    def _cross_inputs(
        self,
        x: Tensor,
        context: Tensor,
        positions: Tensor | None,
        context_positions: Tensor | None,
        key_padding_mask: Tensor | None,
        cache: KVCache | None,
    ) -> AttentionInputs:
        """Cross-attention's queries, keys, values, positions and padding (keys from the cache when it
        has them)."""
        batch, q_len, _ = x.shape
        entry = self._cache_entry(cache, cross=True, batch=batch, context=context)
        k_len = context.shape[1] if entry is None else entry.k.shape[2]
        padding = None
        if key_padding_mask is not None:
            padding = check_padding(key_padding_mask, batch, k_len, "key_padding_mask")
        q_default = torch.arange(q_len, device=x.device)[None]
        q_pos = checked_positions(self.encoding, positions, "positions", batch, q_len, q_default)
        if self.encoding.kind is Kind.ABSOLUTE:
            x = embed_positions(self.encoding, x, q_pos)
        q = self._heads(self.q_proj(x), self.num_heads)
        if entry is not None:
            k, v, k_pos = entry.k, entry.v, entry.k_pos
            if self.encoding.kind is Kind.ROTARY:
                q, _ = self.encoding.rotate(q, k[:, :, :0], q_pos, k_pos[:, :0])
            return AttentionInputs(q, k, v, q_pos, k_pos, padding=padding)
        k_default = torch.arange(context.shape[1], device=x.device)[None]
        k_pos = checked_positions(
            self.encoding, context_positions, "context_positions", batch, context.shape[1], k_default
        )
        given = context_key(context) if cache is not None else None  # the caller's tensor, not a sum
        if self.encoding.kind is Kind.ABSOLUTE:
            context = embed_positions(self.encoding, context, k_pos)
        k, v = self.key_values(context)
        if self.encoding.kind is Kind.ROTARY:
            q, k = self.encoding.rotate(q, k, q_pos, k_pos)
        if cache is not None:
            entry = KVCacheEntry(k=k, v=v, k_pos=k_pos, padding=padding, context_key=given)
            cache.write(self, entry, cross=True)
        return AttentionInputs(q, k, v, q_pos, k_pos, padding=padding)

    # ------------------------------------------------------------------ cache
    def describe(self) -> str:
        """The layer in one line, for error messages (a cache entry names its writer with it)."""
        return (
            f"MultiheadAttention(layer_idx={self.layer_idx}, encoding={self.encoding.spec()!r}, "
            f"heads={self.num_heads}/{self.num_kv_heads}, head_dim={self.head_dim}, sinks={self.sinks is not None})"
        )

    def rotary_encoding(self) -> PositionalEncoding:
        """The encoding whose rotation the cached keys carry (read by the cache's stamp)."""
        return self.encoding

    def _cache_entry(
        self, cache: KVCache | None, *, cross: bool, batch: int, context: Tensor | None = None
    ) -> KVCacheEntry | None:
        """This layer's entry of ``cache``, after checking that this layer wrote it for this batch."""
        if cache is None:
            return None
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a posenc.KVCache, got {type(cache).__name__}")
        return cache.read(self, cross=cross, batch=batch, device=self.q_proj.weight.device, context=context)

    @property
    def pattern(self) -> LayerSpec:
        """This layer's attention pattern as a :class:`~posenc.layers.patterns.LayerSpec`: its encoding's spec,
        window, chunk, sinks (present or not), query temperature, softcap and K = V, the fields a model's
        pattern gives each layer (what a caller that serves only some patterns reads)."""
        return LayerSpec(
            self.encoding.spec(),
            window=self.window,
            chunk=self.chunk,
            sinks=self.sinks is not None,
            temperature=None if self.query_temperature is None else self.query_temperature.declared(),
            softcap=self.softcap,
            value_from_key=self.value_from_key,
        )

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``[B, H, T, D]``, keys and values ``[B, Hkv, T, D]`` of ``x [B, T, E]``, before the
        encoding acts on them (an ABSOLUTE encoding acts on ``x`` before: pass the embedded input)."""
        q = self._heads(self.q_proj(x), self.num_heads)
        k, v = self.key_values(x)
        return q, k, v

    def key_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values ``[B, Hkv, T, D]`` of ``x [B, T, E]``, before the encoding acts; with
        ``value_from_key`` the values are a copy of the keys (a rotation in place leaves them be)."""
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        if self.value_from_key:
            return k, k.clone()
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def _heads(self, x: Tensor, heads: int) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, heads, self.head_dim).transpose(1, 2)
