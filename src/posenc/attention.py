"""``posenc.MultiheadAttention``: one attention layer for every encoding, and ``posenc.KVCache``.

The layer projects queries, keys and values, lets its encoding act where its kind says
(ABSOLUTE: added to the layer input; ROTARY: rotates q and k; BIAS: adds a per-head logit bias;
CONTENT: computes the logits and, optionally, a value term), and hands the call to the backend
chosen by stated reasons (:mod:`posenc.backends`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import Tensor, nn

from .backends import AttentionRequest, select_backend
from .base import Kind, LayerContext, PositionalEncoding
from .registry import build_for_layer

__all__ = ["KVCache", "MultiheadAttention"]


@dataclass
class _CacheEntry:
    k: Tensor  # [B, Hkv, T, D], keys after the encoding's rotation
    v: Tensor  # [B, Hkv, T, D]
    k_pos: Tensor  # [B or 1, T] int64
    padding: Tensor | None  # [B, T] bool, True = padding


class KVCache:
    """Keys, values, key positions and padding of past tokens, for incremental decoding.

    One object serves a whole model: each attention layer keeps its entry under its ``layer_idx``.
    Queries of a decoding step get positions that continue from the cache (``past_len + arange(T)``,
    or from the padding mask when there is one).
    """

    def __init__(self) -> None:
        self._entries: dict[int, _CacheEntry] = {}

    def get(self, layer_idx: int = 0) -> _CacheEntry | None:
        return self._entries.get(layer_idx)

    def length(self, layer_idx: int = 0) -> int:
        """Number of cached tokens of layer ``layer_idx`` (0 when empty)."""
        entry = self._entries.get(layer_idx)
        return 0 if entry is None else entry.k.shape[2]

    def __len__(self) -> int:
        return self.length(min(self._entries)) if self._entries else 0

    def update(self, layer_idx: int, entry: _CacheEntry) -> None:
        self._entries[layer_idx] = entry

    def reset(self) -> None:
        self._entries.clear()

    def __repr__(self) -> str:
        return f"KVCache(layers={sorted(self._entries)}, length={len(self)})"


class MultiheadAttention(nn.Module):
    """Multi-head attention that runs any positional encoding on the fastest correct backend.

    Args:
        embed_dim: model width ``E``.
        num_heads: query heads ``H``; ``E`` must be divisible by ``H`` (head size ``D = E / H``).
        encoding: a spec string (``"rope:base=500000"``), a built encoding, or None (NoPE).
            The layer hands the encoding a :class:`~posenc.base.LayerContext` (its sizes,
            ``causal``, device and dtype); the encoding takes the options it declares from it.
        causal: mask future keys in self-attention (cross-attention is never causal).
        backend: ``"auto"`` (first backend with no reasons), or a backend name to force.
        num_kv_heads: key/value heads for grouped-query attention (divides ``num_heads``).
        dropout: attention-probability dropout during training.
        bias: whether the projections have biases.
        scale: logit scale; default the encoding's (``1/sqrt(D)``, DeBERTa ``1/sqrt(D·s)``).
            Pass ``scale=1.0`` to reproduce HF T5, which has no logit scaling.
        layer_idx: key of this layer's entry in a shared :class:`KVCache`.

    Call: ``attn(x [B, Tq, E], context=None [B, Tk, E], *, positions, context_positions,
    key_padding_mask [B, Tk] (True = padding), attn_mask (bool, True = may attend, or float added
    to the logits; [Tq, Tk], [B, Tq, Tk] or [B, H, Tq, Tk]), cache, need_weights)`` returns
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
        factory = {"device": device, "dtype": dtype}
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        context = LayerContext(num_heads, self.head_dim, embed_dim, causal=causal, device=device, dtype=dtype)
        self.encoding = build_for_layer(encoding, context)
        if self.encoding.causal_only and not causal:
            raise ValueError(f"{self._causal_only_message()}: pass causal=True")
        self.encoding.init_layer(self)
        self.scale = self.encoding.logit_scale(self.head_dim) if scale is None else float(scale)
        self.last_backend: str | None = None

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

    def _positions(self, given: Tensor | None, name: str, batch: int, length: int, default: Tensor) -> Tensor:
        if given is None:
            return default
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
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        self._check_input(x, "x")
        batch, q_len, _ = x.shape
        cross = context is not None
        if cross:
            self._check_input(context, "context")
            if context.shape[0] != batch:
                raise ValueError(f"context batch {context.shape[0]} differs from x batch {batch}")
            if self.encoding.causal_only:
                raise ValueError(f"{self._causal_only_message()}; cross-attention is never causal")
        entry = cache.get(self.layer_idx) if cache is not None else None
        past = 0 if entry is None or cross else entry.k.shape[2]
        device = x.device

        # Positions: explicit, from the padding mask (left padding), or continuing the cache.
        if cross:
            padding = (
                None
                if key_padding_mask is None
                else self._check_padding(
                    key_padding_mask,
                    batch,
                    context.shape[1] if entry is None else entry.k.shape[2],
                    "key_padding_mask",
                )
            )
            q_default = torch.arange(q_len, device=device)[None]
            q_pos = self._positions(positions, "positions", batch, q_len, q_default)
            k_default = torch.arange(context.shape[1], device=device)[None]
            k_new_pos = self._positions(
                context_positions, "context_positions", batch, context.shape[1], k_default
            )
            padding_all = padding
        else:
            padding_all = self._padding_with_cache(key_padding_mask, entry, batch, q_len)
            q_default = self._default_positions(padding_all, entry, q_len, past, device)
            q_pos = self._positions(positions, "positions", batch, q_len, q_default)
            k_new_pos = q_pos
        if not cross and positions is None:
            self.encoding.check_positions(q_pos, name="positions")

        # ABSOLUTE encodings act on the layer input (inside a TransformerLM: once, at the embedding).
        x_q = x
        kv_input = context if cross else x
        if self.encoding.kind is Kind.ABSOLUTE:
            x_q = self.encoding.embed(x, q_pos.expand(batch, -1))
            kv_input = x_q if not cross else self.encoding.embed(context, k_new_pos.expand(batch, -1))

        q = self._heads(self.q_proj(x_q), self.num_heads)
        if cross and entry is not None:
            k, v, k_pos = entry.k, entry.v, entry.k_pos
            if self.encoding.kind is Kind.ROTARY:
                q, _ = self.encoding.rotate(q, k[:, :, :0], q_pos, k_pos[:, :0])
        else:
            k = self._heads(self.k_proj(kv_input), self.num_kv_heads)
            v = self._heads(self.v_proj(kv_input), self.num_kv_heads)
            if self.encoding.kind is Kind.ROTARY:
                q, k = self.encoding.rotate(q, k, q_pos, k_new_pos)
            k_pos = k_new_pos
            if entry is not None:
                k = torch.cat([entry.k, k], dim=2)
                v = torch.cat([entry.v, v], dim=2)
                k_pos = torch.cat([entry.k_pos.expand(batch, -1), k_pos.expand(batch, -1)], dim=1)
            if cache is not None:
                cache.update(self.layer_idx, _CacheEntry(k=k, v=v, k_pos=k_pos, padding=padding_all))

        if attn_mask is not None:
            attn_mask = self._check_attn_mask(attn_mask, batch, q_len, k.shape[2])
        request = AttentionRequest(
            q=q,
            k=k,
            v=v,
            encoding=self.encoding,
            q_pos=q_pos,
            k_pos=k_pos,
            scale=self.scale,
            causal=self.causal and not cross,
            causal_offset=past,
            key_padding_mask=padding_all,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            layer=self,
        )
        backend = select_backend(request, self.backend)
        self.last_backend = backend.name
        out, weights = backend.run(request)
        if need_weights and weights is None:
            from .backends.eager import attention_probs

            weights = attention_probs(request)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, q_len, self.embed_dim))
        return (out, weights) if need_weights else out

    def _heads(self, x: Tensor, heads: int) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, heads, self.head_dim).transpose(1, 2)

    def _padding_with_cache(
        self, mask: Tensor | None, entry: _CacheEntry | None, batch: int, q_len: int
    ) -> Tensor | None:
        """The padding mask over all keys: cached padding plus the new tokens' (or the full mask)."""
        past = 0 if entry is None else entry.k.shape[2]
        if mask is None:
            if entry is None or entry.padding is None:
                return None
            return torch.cat([entry.padding, entry.padding.new_zeros(batch, q_len)], dim=1)
        if mask.dtype != torch.bool:
            raise ValueError(
                f"key_padding_mask must be a bool tensor (True = padding), got dtype {mask.dtype}"
            )
        if tuple(mask.shape) == (batch, past + q_len):
            return mask
        if tuple(mask.shape) == (batch, q_len) and entry is not None:
            previous = entry.padding if entry.padding is not None else mask.new_zeros(batch, past)
            return torch.cat([previous, mask], dim=1)
        raise ValueError(
            f"key_padding_mask must have shape [B, Tk] = [{batch}, {past + q_len}] (or [{batch}, {q_len}] "
            f"for the new tokens of a cached step), got {tuple(mask.shape)}"
        )

    @staticmethod
    def _default_positions(
        padding: Tensor | None, entry: _CacheEntry | None, q_len: int, past: int, device
    ) -> Tensor:
        if padding is None:
            return torch.arange(past, past + q_len, device=device)[None]
        # Left padding: a token's position counts the real tokens before it (BLOOM/HF generate).
        real = (~padding).long()
        positions = (real.cumsum(dim=1) - 1).clamp(min=0)
        return positions[:, -q_len:]
