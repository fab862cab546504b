"""``posenc.MultiLatentAttention``: DeepSeek's multi-head latent attention (MLA) with decoupled RoPE.

MLA (DeepSeek-V2, V3; Kimi K2, GLM-4.x and other families reuse it) compresses keys and values
into one small latent per token and keeps position out of that latent:

* queries: ``x -> q_a_proj -> RMSNorm -> q_b_proj`` (a rank-``q_lora_rank`` bottleneck), or one
  ``q_proj`` when ``q_lora_rank`` is None (DeepSeek-V2-Lite); each head's ``q`` splits into
  ``qk_nope_head_dim`` content channels and ``qk_rope_head_dim`` rotary channels;
* keys and values: ``x -> kv_a_proj_with_mqa -> [c (kv_lora_rank) | k_rope (qk_rope_head_dim)]``;
  ``c -> RMSNorm`` is the latent, ``kv_b_proj(c)`` gives every head's ``k_nope`` and ``v``;
  ``k_rope`` is **one rotary key head shared by all heads** (multi-query style);
* RoPE rotates only ``q_rope`` and ``k_rope`` ("decoupled"): the logits are
  ``q_nope·k_nope + RoPE(q_rope)·RoPE(k_rope)``, scaled by ``(qk_nope_head_dim + qk_rope_head_dim)^-1/2``
  times ``mscale(factor, mscale_all_dim)^2`` when the rope is scaled and ``mscale_all_dim`` is set
  (DeepSeek-V3's YaRN: ``mscale(s, m) = 0.1·m·ln s + 1`` for ``s > 1``, else 1), as HF computes it.

Rotary layout. DeepSeek checkpoints pair rotary channels ``(2k, 2k+1)``. HF ``DeepseekV3Attention``
with ``rope_interleave=True`` (the default, and every released V3 checkpoint) takes the even
channels then the odd ones and rotates that with ``rotate_half``; this layer does the same: it
applies the permutation ``[0, 2, ..., d_r-2, 1, 3, ..., d_r-1]`` to ``q_rope`` and ``k_rope`` and then
posenc's RoPE with ``pairing="half"``, so the rotated keys equal HF's element for element.
``rope_interleave=False`` skips the permutation (``rotate_half`` on the channels as they come).
HF ``DeepseekV2Attention`` rotates the interleaved pairs in place (a complex multiply, posenc's
``pairing="interleaved"``); its rotated q and k are the ones here up to that same permutation of
the rotary channels, shared by q and k, so its logits and outputs are the same.

Cache. :class:`LatentCache` keeps, per ``layer_idx``, the latent *after* ``kv_a_layernorm`` (what
HF caches, so a decoding step does not normalise past tokens again) and the rotated ``k_rope``:
``kv_lora_rank + qk_rope_head_dim`` numbers per token, against ``2 · H · D`` for a plain KV cache.
Each call re-expands ``k_nope`` and ``v`` of every cached token from the latent with ``kv_b_proj``.

Attention runs through posenc's backends: the request carries NoPE (``q`` and ``k`` are already
rotated) and ``v`` of width ``v_head_dim``, which may differ from the ``q``/``k`` width. The
backends that serve plain attention (sdpa, eager) take that; ``auto`` picks sdpa.

Parameter names are HF's (``q_a_proj``, ``kv_b_proj``, ``o_proj``, ...), so an HF
``DeepseekV3Attention`` (or V2) state dict loads as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
from torch import Tensor, nn

from ..backends import get_backend
from ..backends.run import attend
from ..cache.kv_cache import CacheFullError, CacheStamp, TimeAxis, check_in_place_write
from ..encodings.base import LayerContext, PositionalEncoding
from ..encodings.registry import build, build_for_layer
from ..encodings.rope import RoPE
from ..encodings.rope_pairing import register_rope_user
from ..encodings.rope_scaling import RopeScaling
from ..masks.attention_mask import AttentionMask
from .inputs import check_scale
from .positions import default_positions, padding_with_cache, temperature_factors
from .temperature import TemperatureForm, layer_temperature

__all__ = ["LatentCache", "MultiLatentAttention", "mla_softmax_scale"]


def _yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's ``mscale(s, m) = 0.1·m·ln s + 1`` (1 for ``s <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(qk_head_dim: int, scaling: RopeScaling) -> float:
    """The logit scale of MLA: ``qk_head_dim^-1/2``, times ``mscale(factor, mscale_all_dim)^2`` when scaled.

    As HF DeepSeek-V2/V3: the factor applies for any scaling type but ``default`` that sets
    ``mscale_all_dim`` (DeepSeek-V3: yarn, factor 40, ``mscale = mscale_all_dim = 1``; YaRN's own
    ``mscale / mscale_all_dim`` ratio, 1 there, multiplies cos/sin inside RoPE). A ``factor`` left
    out is ``max_position_embeddings / original_max_position_embeddings``, as YaRN derives it.
    """
    scale = qk_head_dim**-0.5
    if scaling.type == "default" or not scaling.mscale_all_dim:
        return scale
    factor = scaling.factor
    if factor is None:
        longest, original = scaling.max_position_embeddings, scaling.original_max_position_embeddings
        if not longest or not original:
            raise ValueError(
                "rope: mscale_all_dim needs 'factor' (or max_position_embeddings and "
                "original_max_position_embeddings to derive it)"
            )
        factor = longest / original
    return scale * _yarn_mscale(float(factor), float(scaling.mscale_all_dim)) ** 2


class _RMSNorm(nn.Module):
    """RMSNorm as DeepSeek (and HF ``DeepseekV3RMSNorm``) computes it.

    ``weight * (x / sqrt(mean(x²) + eps))``, the normalisation in float32 and cast back to the
    input dtype before the weight multiplies it.
    """

    def __init__(self, dim: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


@dataclass(kw_only=True)
class _LatentEntry(CacheStamp):
    latent: Tensor  # [B, T, kv_lora_rank], after kv_a_layernorm
    k_rope: Tensor  # [B, T, qk_rope_head_dim], rotated
    k_pos: Tensor  # [B or 1, T] int64
    padding: Tensor | None  # [B, T] bool, True = padding
    axes: dict[str, TimeAxis] | None = None  # LatentCache(max_length=N): the buffers of the views above

    def held(self) -> Tensor:
        return self.latent


class LatentCache:
    """The cache of :class:`MultiLatentAttention`: per layer, the latent and the rotated rotary key.

    Per token and layer it holds ``kv_lora_rank + qk_rope_head_dim`` numbers (the latent after
    ``kv_a_layernorm``, and ``k_rope`` after its rotation), plus the key positions and padding.
    One object serves a whole model; each layer keeps its entry under its ``layer_idx``. As in a
    :class:`~posenc.KVCache`, an entry records the layer that wrote it, and only that layer
    may read it: another layer with the same ``layer_idx``, a changed batch size, or the rotation
    mode changed since (``drop_rotation="eval"`` and ``train()``/``eval()``) raises ``ValueError``.
    """

    def __init__(self, *, max_length: int | None = None) -> None:
        """Args:
        max_length: None (the cache grows by concatenation), or the tokens each layer's
            preallocated latent and rotary-key buffers hold: every step is written in place and
            the expansion reads views (as ``KVCache(max_length=...)``; inference only).
        """
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        ):
            raise ValueError(f"LatentCache: max_length must be a positive int or None, got {max_length!r}")
        self.max_length = max_length
        self._entries: dict[int, _LatentEntry] = {}

    def append(
        self,
        entry: _LatentEntry | None,
        latent: Tensor,
        k_rope: Tensor,
        k_pos: Tensor,
        padding: Tensor | None,
    ) -> _LatentEntry:
        """The entry after ``entry`` (or None) with the new ``latent [B, T, r]``, ``k_rope [B, T, d_r]``
        and ``k_pos`` appended: concatenated, or written in place with ``max_length``."""
        batch = latent.shape[0]
        k_pos = k_pos.expand(batch, -1)
        new = {"latent": latent, "k_rope": k_rope, "k_pos": k_pos}
        if self.max_length is None:
            if entry is not None:
                new = {
                    name: torch.cat([getattr(entry, name).expand(batch, -1, *t.shape[2:]), t], dim=1)
                    for name, t in new.items()
                }
            return _LatentEntry(**new, padding=padding)
        held = None if entry is None else entry.latent
        check_in_place_write(
            f"LatentCache(max_length={self.max_length})", "LatentCache()", "latents", held, latent, k_rope
        )
        steps = latent.shape[1]
        if entry is None:
            if steps > self.max_length:
                raise CacheFullError(
                    f"LatentCache(max_length={self.max_length}) cannot hold a prompt of {steps} tokens; "
                    "pass a larger max_length, or use LatentCache() (grows)"
                )
            axes = {name: TimeAxis(t, 1, self.max_length) for name, t in new.items()}
        else:
            axes = entry.axes
            if not axes["latent"].fits(steps):
                raise CacheFullError(
                    f"LatentCache(max_length={self.max_length}) is full: {axes['latent'].length} tokens "
                    f"cached and the call adds {steps}; pass a larger max_length, or use LatentCache() (grows)"
                )
            for name, t in new.items():
                axes[name].append(t)
        views = {name: axis.view() for name, axis in axes.items()}
        return _LatentEntry(**views, padding=padding, axes=axes)

    def get(self, layer_idx: int = 0) -> _LatentEntry | None:
        return self._entries.get(layer_idx)

    def length(self, layer_idx: int = 0) -> int:
        """Number of cached tokens of layer ``layer_idx`` (0 when empty)."""
        entry = self._entries.get(layer_idx)
        return 0 if entry is None else entry.latent.shape[1]

    def __len__(self) -> int:
        return self.length(min(self._entries)) if self._entries else 0

    def update(self, layer_idx: int, entry: _LatentEntry) -> None:
        self._entries[layer_idx] = entry

    def numel_per_token(self, layer_idx: int = 0) -> int:
        """Cached numbers per token of one layer: ``kv_lora_rank + qk_rope_head_dim`` (0 when empty)."""
        entry = self._entries.get(layer_idx)
        return 0 if entry is None else entry.latent.shape[-1] + entry.k_rope.shape[-1]

    def reset(self) -> None:
        self._entries.clear()

    def __repr__(self) -> str:
        return f"LatentCache(layers={sorted(self._entries)}, length={len(self)})"


def _positive_int(name: str, value: Any, *, allow_zero: bool = False) -> int:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"MultiLatentAttention: {name} must be {kind} int, got {value!r}")
    return value


class MultiLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3) with decoupled RoPE, on posenc's backends.

    Args:
        embed_dim: model width ``E``.
        num_heads: heads ``H``.
        kv_lora_rank: width ``r`` of the key/value latent (DeepSeek-V3: 512).
        qk_nope_head_dim: content channels ``d_n`` of each query/key head (128; may be 0).
        qk_rope_head_dim: rotary channels ``d_r`` (64): even, one rotary key head shared by all heads.
        v_head_dim: value channels ``d_v`` of each head (128).
        q_lora_rank: width of the query bottleneck (1536), or None for one ``q_proj`` (V2-Lite).
        rope: the RoPE of the rotary channels: a spec string (``"rope:base=10000,scaling=yarn,
            factor=40,original_max_position_embeddings=4096,mscale=1,mscale_all_dim=1"``) or a built
            :class:`~posenc.encodings.rope.RoPE` (e.g. from an HF ``rope_parameters`` dict). Its
            ``head_dim`` is ``qk_rope_head_dim``; its pairing must be ``"half"`` (the layout is
            ``rope_interleave``'s business) and it rotates all ``d_r`` channels.
        rope_interleave: the checkpoint pairs rotary channels ``(2k, 2k+1)`` (DeepSeek, HF's
            default); False: ``(k, k + d_r/2)`` (HF ``rope_interleave=False``). See the module doc.
        causal: mask future keys (DeepSeek is causal).
        backend: ``"auto"`` or a backend name to force.
        bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (HF ``attention_bias``).
        norm_eps: epsilon of the two RMSNorms (HF builds them with 1e-6 whatever ``rms_norm_eps``).
        dropout: attention-probability dropout during training.
        scale: logit scale; default :func:`mla_softmax_scale` (HF's, YaRN mscale included).
        query_temperature: a position-dependent query scale applied to the whole query (content and
            rotary channels) after the rotation, as a :class:`~posenc.MultiheadAttention` takes it:
            :class:`~posenc.layers.temperature.LearnedLogTemperature` is Mistral Large 4's learned
            ``s_h · ln(p + 1) + b_h`` (HF ``MistralLarge4TextSoftmaxScaling``; the layer's own
            ``query_temperature.scale`` / ``.bias``, HF's ``softmax_scaling.scale`` / ``.bias``).
        layer_idx: key of this layer's entry in a shared :class:`LatentCache`.

    Call: ``mla(x [B, T, E], *, positions [T] or [B, T] (default: continuing after the cache, or
    counted from the padding), key_padding_mask [B, Tk] or [B, T] for a cached step (True =
    padding), cache (:class:`LatentCache`), need_weights)`` returns ``out [B, T, E]``, or
    ``(out, weights [B, H, T, Tk])`` with ``need_weights=True``.

    Inside: ``q [B, H, T, d_n + d_r]``, ``k [B, H, Tk, d_n + d_r]`` (the rotary part broadcast from
    one head), ``v [B, H, Tk, d_v]``; ``Tk`` counts cached tokens.

    Example::

        mla = posenc.MultiLatentAttention(512, 8, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                                          qk_rope_head_dim=16, v_head_dim=32)
        out = mla(torch.randn(2, 10, 512))                # [2, 10, 512]
        cache = posenc.LatentCache()
        for t in range(10):                               # decoding: 64 + 16 numbers per token cached
            step = mla(x[:, t : t + 1], cache=cache)
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        rope: str | PositionalEncoding = "rope",
        rope_interleave: bool = True,
        causal: bool = True,
        backend: str = "auto",
        bias: bool = False,
        norm_eps: float = 1e-6,
        dropout: float = 0.0,
        scale: float | None = None,
        query_temperature: TemperatureForm | None = None,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if getattr(query_temperature, "reads_visible_keys", False):
            raise ValueError(
                "MultiLatentAttention: query_temperature SSMax (counted from the mask) is served by "
                "posenc.MultiheadAttention; give this layer a position-dependent form"
            )
        if query_temperature is not None and not isinstance(query_temperature, TemperatureForm):
            raise ValueError(
                "MultiLatentAttention: query_temperature must be a posenc.layers.patterns TemperatureForm "
                f"(LearnedLogTemperature for Mistral Large 4), got {query_temperature!r}"
            )
        self.embed_dim = _positive_int("embed_dim", embed_dim)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.kv_lora_rank = _positive_int("kv_lora_rank", kv_lora_rank)
        self.qk_nope_head_dim = _positive_int("qk_nope_head_dim", qk_nope_head_dim, allow_zero=True)
        self.qk_rope_head_dim = _positive_int("qk_rope_head_dim", qk_rope_head_dim)
        if qk_rope_head_dim % 2:
            raise ValueError(
                f"MultiLatentAttention: qk_rope_head_dim must be even (rotary channels turn in pairs), "
                f"got {qk_rope_head_dim}"
            )
        self.v_head_dim = _positive_int("v_head_dim", v_head_dim)
        self.q_lora_rank = None if q_lora_rank is None else _positive_int("q_lora_rank", q_lora_rank)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MultiLatentAttention: dropout must be in [0, 1), got {dropout}")
        if not norm_eps > 0:
            raise ValueError(f"MultiLatentAttention: norm_eps must be positive, got {norm_eps}")
        if backend != "auto":
            get_backend(backend)
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.rope_interleave, self.causal, self.backend = bool(rope_interleave), causal, backend
        self.dropout, self.layer_idx = dropout, layer_idx
        factory = {"device": device, "dtype": dtype}
        heads = num_heads
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(embed_dim, heads * self.qk_head_dim, bias=False, **factory)
        else:
            self.q_a_proj = nn.Linear(embed_dim, self.q_lora_rank, bias=bias, **factory)
            self.q_a_layernorm = _RMSNorm(self.q_lora_rank, norm_eps, **factory)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * self.qk_head_dim, bias=False, **factory)
        self.kv_a_proj_with_mqa = nn.Linear(embed_dim, kv_lora_rank + qk_rope_head_dim, bias=bias, **factory)
        self.kv_a_layernorm = _RMSNorm(kv_lora_rank, norm_eps, **factory)
        self.kv_b_proj = nn.Linear(
            kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim), bias=False, **factory
        )
        self.o_proj = nn.Linear(heads * v_head_dim, embed_dim, bias=bias, **factory)
        self.rope = self._build_rope(rope, device, dtype)
        self.query_temperature = layer_temperature(query_temperature, heads, **factory)
        register_rope_user(self.rope, self)
        self.attention_encoding = build("nope")  # q and k arrive rotated: plain attention
        self.scale = (
            mla_softmax_scale(self.qk_head_dim, self.rope.scaling) if scale is None else check_scale(scale)
        )
        self.last_backend: str | None = None

    def __setstate__(self, state: dict) -> None:  # a copy (deepcopy, pickle) is a user of its rope too
        super().__setstate__(state)
        register_rope_user(self.rope, self)

    def _build_rope(self, rope: str | PositionalEncoding, device, dtype) -> RoPE:
        context = LayerContext(
            self.num_heads,
            self.qk_rope_head_dim,
            self.embed_dim,
            causal=self.causal,
            device=device,
            dtype=dtype,
        )
        if isinstance(rope, str) and rope.split(":", 1)[0].strip() != "rope":
            raise ValueError(f"MultiLatentAttention: rope must be a 'rope' spec, got {rope!r}")
        encoding = build_for_layer(rope, context)
        if not isinstance(encoding, RoPE):
            raise ValueError(
                f"MultiLatentAttention: rope must be a 'rope' encoding (posenc RoPE), got {encoding.name!r}"
            )
        encoding.bind(self.qk_rope_head_dim)  # an error naming both sizes if it was built for another
        if encoding.pairing != "half":
            raise ValueError(
                "MultiLatentAttention: rope must use pairing='half'; the checkpoint's interleaved layout "
                "is rope_interleave=True (the default)"
            )
        if encoding.rotary_dim != self.qk_rope_head_dim:
            raise ValueError(
                f"MultiLatentAttention: rope rotates {encoding.rotary_dim} channels but qk_rope_head_dim="
                f"{self.qk_rope_head_dim}; the rotary head rotates whole (no partial rotary_dim)"
            )
        return encoding

    @classmethod
    def from_hf_config(cls, config: Any, layer_idx: int = 0, **overrides: Any) -> MultiLatentAttention:
        """The layer an HF ``DeepseekV3Config`` / ``DeepseekV2Config`` describes (any object with its fields).

        Reads ``hidden_size``, ``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``,
        ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``attention_bias``,
        ``attention_dropout``, ``rope_interleave`` (absent, as in V2: True), ``rope_parameters``
        (or the older ``rope_theta`` / ``rope_scaling``) and ``max_position_embeddings``. ``overrides``
        go to the constructor. Load the weights with ``load_state_dict(hf_attention.state_dict())``.
        """
        rope_parameters = getattr(config, "rope_parameters", None)
        if rope_parameters is None:  # older configs: rope_theta + rope_scaling
            rope_parameters = {"rope_theta": getattr(config, "rope_theta", 10000.0)}
            rope_parameters.update(getattr(config, "rope_scaling", None) or {})
        rope = RoPE(
            head_dim=config.qk_rope_head_dim,
            rope_parameters=dict(rope_parameters),
            max_position_embeddings=getattr(config, "max_position_embeddings", None),
        )
        interleave = getattr(config, "rope_interleave", None)
        options: dict[str, Any] = {
            "kv_lora_rank": config.kv_lora_rank,
            "qk_nope_head_dim": config.qk_nope_head_dim,
            "qk_rope_head_dim": config.qk_rope_head_dim,
            "v_head_dim": config.v_head_dim,
            "q_lora_rank": getattr(config, "q_lora_rank", None),  # absent in Mistral Large 4 (no Q-LoRA)
            "rope": rope,
            "rope_interleave": True if interleave is None else bool(interleave),
            "bias": bool(getattr(config, "attention_bias", False)),
            "dropout": float(getattr(config, "attention_dropout", 0.0) or 0.0),
            "layer_idx": layer_idx,
        }
        return cls(config.hidden_size, config.num_attention_heads, **{**options, **overrides})

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, "
            f"kv_lora_rank={self.kv_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}, "
            f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, "
            f"rope_interleave={self.rope_interleave}, causal={self.causal}, backend={self.backend!r}, "
            f"scale={self.scale:.4g}"
        )

    # ------------------------------------------------------------------ forward
    @overload
    def forward(self, x: Tensor, *, need_weights: Literal[False] = ..., **kw: Any) -> Tensor: ...

    @overload
    def forward(self, x: Tensor, *, need_weights: Literal[True], **kw: Any) -> tuple[Tensor, Tensor]: ...

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        cache: LatentCache | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        self._check_input(x)
        if cache is not None and not isinstance(cache, LatentCache):
            raise ValueError(
                f"cache must be a LatentCache (posenc.layers.mla.LatentCache: MLA caches the latent), got {type(cache).__name__}"
            )
        batch, q_len, _ = x.shape
        entry = self._cache_entry(cache, batch)
        past = 0 if entry is None else entry.latent.shape[1]
        padding = self._padding_with_cache(key_padding_mask, entry, batch, q_len)
        q_pos = self._positions(positions, batch, q_len, default_positions(q_len, past, padding, x.device))

        q_nope, q_rope = self._queries(x)
        latent, k_rope = self._latent(x)
        q_rope, k_rope = self._rotate(q_rope, k_rope, q_pos)
        k_pos = q_pos
        if cache is not None:
            written = cache.append(entry, latent, k_rope, k_pos, padding)
            written.stamp(self, entry)
            cache.update(self.layer_idx, written)
            latent, k_rope, k_pos = written.latent, written.k_rope, written.k_pos
        k, v = self.expand_latent(latent, k_rope)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.query_temperature is not None:  # after the rotation, on every channel (HF Mistral Large 4)
            q = q * temperature_factors(self.query_temperature, q_pos).to(q.dtype)

        mask = AttentionMask.build(
            q_len=q_len,
            k_len=k.shape[2],
            batch=batch,
            heads=self.num_heads,
            device=x.device,
            causal=self.causal,
            causal_offset=past,
            key_padding_mask=padding,
        )
        self.last_backend, out, weights = attend(
            q,
            k,
            v,
            encoding=self.attention_encoding,
            q_pos=q_pos,
            k_pos=k_pos,
            scale=self.scale,
            mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            layer=self,
            backend=self.backend,
        )
        out = self.o_proj(out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.v_head_dim))
        return (out, weights) if need_weights else out

    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``q_nope [B, H, T, d_n]`` and the unrotated ``q_rope [B, H, T, d_r]``."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        batch, length, _ = x.shape
        q = q.view(batch, length, self.num_heads, self.qk_head_dim).transpose(1, 2)
        return q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

    def _latent(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The normalised latent ``[B, T, r]`` and the unrotated shared key ``k_rope [B, T, d_r]``."""
        compressed = self.kv_a_proj_with_mqa(x)
        latent, k_rope = compressed.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(latent), k_rope

    def _rotate(self, q_rope: Tensor, k_rope: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """RoPE on ``q_rope [B, H, T, d_r]`` and the single key head ``k_rope [B, T, d_r]``."""
        if self.rope_interleave:  # pairs (2k, 2k+1) -> evens then odds, rotated as halves (HF V3)
            order = _deinterleave_order(self.qk_rope_head_dim, q_rope.device)
            q_rope, k_rope = q_rope[..., order], k_rope[..., order]
        q_rope, k_rope = self.rope.rotate(q_rope, k_rope[:, None], positions, positions)
        return q_rope, k_rope[:, 0]

    def expand_latent(self, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Keys ``[B, H, Tk, d_n + d_r]`` and values ``[B, H, Tk, d_v]`` from the latent ``[B, Tk, r]``
        (after ``kv_a_layernorm``) and the rotated shared key ``k_rope [B, Tk, d_r]``."""
        batch, length, _ = latent.shape
        kv = self.kv_b_proj(latent).view(
            batch, length, self.num_heads, self.qk_nope_head_dim + self.v_head_dim
        )
        k_nope, v = kv.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        shared = k_rope[:, None].expand(batch, self.num_heads, length, self.qk_rope_head_dim)
        return torch.cat([k_nope, shared], dim=-1), v

    # ------------------------------------------------------------------ input checks
    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.embed_dim:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [B, T, {self.embed_dim}], got {shape}")
        weight_dtype = self.o_proj.weight.dtype
        if x.dtype != weight_dtype:
            raise ValueError(f"x has dtype {x.dtype} but the layer's parameters are {weight_dtype}; cast one")

    # ------------------------------------------------------------------ cache
    qk_layout = 0  # the channel layout stamped on cache entries (switch_rope_pairing_ leaves MLA alone)

    def describe(self) -> str:
        """The layer in one line, for error messages (a cache entry names its writer with it)."""
        return (
            f"MultiLatentAttention(layer_idx={self.layer_idx}, heads={self.num_heads}, "
            f"kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}, "
            f"rope={self.rope.spec()!r})"
        )

    def rotary_encoding(self) -> RoPE:
        """The encoding whose rotation the cached ``k_rope`` carries (read by the cache's stamp)."""
        return self.rope

    def _cache_entry(self, cache: LatentCache | None, batch: int) -> _LatentEntry | None:
        """This layer's entry of ``cache``, after checking that this layer wrote it for this batch."""
        entry = None if cache is None else cache.get(self.layer_idx)
        if entry is not None:
            entry.check_reader(
                self,
                what=f"the entry of layer_idx={self.layer_idx}",
                batch=batch,
                device=self.o_proj.weight.device,
                fresh="LatentCache",
            )
        return entry

    def _positions(self, given: Tensor | None, batch: int, length: int, default: Tensor) -> Tensor:
        if given is None:
            return default
        positions = self.rope.check_positions(given, name="positions")
        if positions.shape[-1] != length or positions.shape[0] not in (1, batch):
            raise ValueError(
                f"positions must have shape [{length}] or [{batch}, {length}], got {tuple(given.shape)}"
            )
        return positions.to(default.device)

    def _padding_with_cache(
        self, mask: Tensor | None, entry: _LatentEntry | None, batch: int, q_len: int
    ) -> Tensor | None:
        """The padding mask over all keys: cached padding plus the new tokens' (or the full mask)."""
        if entry is None:
            return padding_with_cache(mask, None, batch, q_len)
        return padding_with_cache(mask, (entry.latent.shape[1], entry.padding), batch, q_len)


def _deinterleave_order(width: int, device: torch.device) -> Tensor:
    """``[0, 2, ..., width-2, 1, 3, ..., width-1]``: interleaved pairs to ``rotate_half`` halves."""
    return torch.cat((torch.arange(0, width, 2, device=device), torch.arange(1, width, 2, device=device)))
