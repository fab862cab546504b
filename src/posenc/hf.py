"""posenc inside HF transformers models: an attention implementation, ``attn_implementation="posenc"``.

:func:`register` adds posenc's attention to HF's ``AttentionInterface`` (and its mask builder to
``AttentionMaskInterface``) under the name ``"posenc"``. A model loaded or switched to it
(``model.set_attn_implementation("posenc")``) then runs every attention call through posenc's
backends (:mod:`posenc.backends`): the dispatcher picks the fastest one that can serve the call, and
attention sinks (gpt-oss's ``s_aux``) are served exactly.

What HF hands the attention function: ``query [B, H, Tq, D]`` and ``key``/``value [B, Hkv, Tk, D]``,
already rotated by the model's own rotary embedding (so posenc adds no position term: the request's
encoding is NoPE), and the mask HF's ``sdpa_mask`` builds from the model's own mask functions (causal,
sliding window, chunks, packed sequences, padding), a bool ``[B, 1, Tq, Tk]`` (True = attend) or None for
a plain causal mask. The rules for None follow HF's sdpa implementation: causal when ``Tq > 1`` (keys
past the first ``Tq`` are empty static-cache slots), no mask for a single query. T5's relative bias
arrives as ``position_bias`` (dense, trainable) and is added to the logits as a float mask; for
T5's structured path (no dense bias) use :func:`use_posenc_attention`.

transformers is optional (``pip install posenc[hf]``): importing this module does not import it;
:func:`register` does, and says how to install it when it is missing.

Not served (each a ValueError naming it): logit soft-capping (Gemma 2's ``softcap``) and HF's paged
cache (continuous batching).

:func:`swap_encoding` replaces the rotary embedding of a Llama-family model (a decoder with one
``rotary_emb`` and layers whose ``self_attn`` rotates q and k with it) by any posenc encoding, one
spec for every layer or one per layer: the model's own rotation becomes the identity, and each
layer's attention applies its posenc encoding inside :func:`attention_forward` (rotations of q and
k, biases, relative terms) at the positions HF gives (``position_ids``). Keys then sit in HF's cache
unrotated; the layer remembers their positions. :func:`set_rope_scaling` changes the RoPE scaling
of a loaded model in place, as if it had been loaded with those ``rope_parameters``.

:func:`use_posenc_attention` serves bias models whose bias HF computes outside the attention
function, BLOOM (ALiBi) and T5 / mT5 (relative buckets), through posenc's own encodings: the bias is
never a dense ``[B, H, L, L]`` tensor, and T5's table stays HF's parameter.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .backends import get_backend
from .backends.run import attend
from .base import Kind, LayerContext, PositionalEncoding
from .registry import build, build_for_layer

__all__ = [
    "ATTN_IMPLEMENTATION",
    "attention_forward",
    "last_backend",
    "register",
    "set_rope_scaling",
    "swap_encoding",
    "use_posenc_attention",
]

#: The name posenc's attention is registered under in HF's ``AttentionInterface``.
ATTN_IMPLEMENTATION = "posenc"

_state = threading.local()
_nope = build("nope")
_backend = {"name": "auto"}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - transformers is installed for the tests
        raise ImportError("posenc.hf needs HF transformers: pip install 'posenc[hf]'") from err
    return transformers


def register(backend: str = "auto") -> str:
    """Register posenc's attention in HF transformers as ``attn_implementation="posenc"``.

    Args:
        backend: the posenc backend every call uses (``"auto"``: the dispatcher's choice per call).

    Returns:
        The implementation name to pass to ``from_pretrained(..., attn_implementation=...)`` or
        ``model.set_attn_implementation(...)``.
    """
    if backend != "auto":
        get_backend(backend)  # an unknown name fails here, naming the available ones
    transformers = _transformers()
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _backend["name"] = backend
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


#: Arguments HF's continuous batching hands the attention function with its paged cache: the cache
#: itself (transformers 5.19-5.23) or the read/write indices into it (5.24).
_PAGED_ARGUMENTS = ("read_index", "write_index", "block_table")


def _check_supported(kwargs: dict[str, Any]) -> None:
    if kwargs.get("softcap") is not None:
        raise ValueError(
            "posenc attention does not serve logit soft-capping (softcap, Gemma 2); use "
            "attn_implementation='eager' for this model"
        )
    paged = type(kwargs.get("cache")).__name__ == "PagedAttentionCache" or any(
        kwargs.get(name) is not None for name in _PAGED_ARGUMENTS
    )
    if paged:
        raise ValueError("posenc attention does not serve HF's paged cache (continuous batching)")


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    s_aux: Tensor | None = None,
    position_bias: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """HF's attention-function signature, served by posenc's backends.

    Shapes: ``query [B, H, Tq, D]``, ``key``/``value [B, Hkv, Tk, D]``; ``attention_mask`` bool or float
    ``[B, 1, Tq, Tk]`` or None; ``s_aux [H]`` attention sinks. Returns ``(out [B, Tq, H, D], weights)``
    with weights ``[B, H, Tq, Tk]`` only when HF asks for them (``output_attentions``).
    ``position_bias [B or 1, H, Tq, Tk]`` (T5's relative bias, trainable): added to the logits.
    """
    _check_supported(kwargs)
    q_len = query.shape[2]
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    causal = causal and attention_mask is None and q_len > 1
    if causal and key.shape[2] > q_len:  # empty static-cache slots after the prompt (HF's sdpa rule)
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    if position_bias is not None:
        attention_mask = _with_position_bias(attention_mask, position_bias, causal, key.shape[2])
        causal = False
    encoding = getattr(module, "posenc_encoding", None)
    if encoding is None:  # HF's own positions are already in q and k
        encoding = _nope
        q_pos = torch.arange(q_len, device=query.device)[None]
        k_pos = torch.arange(key.shape[2], device=query.device)[None]
    else:
        q_pos, k_pos = _swapped_positions(
            module, kwargs.get("position_ids"), q_len, key.shape[2], query.device
        )
        if encoding.kind is Kind.ROTARY:
            query, key = encoding.rotate(query, key, q_pos, k_pos)
            encoding = _nope
    name, out, weights = attend(
        query,
        key,
        value,
        encoding=encoding,
        q_pos=q_pos,
        k_pos=k_pos,
        scale=scale,
        causal=causal,
        attn_mask=attention_mask,
        dropout_p=float(dropout),
        need_weights=bool(kwargs.get("output_attentions", False)),
        sinks=s_aux,
        backend=_backend["name"],
    )
    _state.last_backend = name
    return out.transpose(1, 2).contiguous(), weights


def _with_position_bias(mask: Tensor | None, bias: Tensor, causal: bool, k_len: int) -> Tensor:
    """One float mask: ``bias`` where ``mask`` (bool, True = attend; or float, added) lets a key through,
    ``-inf`` elsewhere (posenc's mask module turns those into hidden keys, as a bool mask would)."""
    bias = bias[..., :k_len]
    if causal:
        q_len = bias.shape[-2]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=bias.device).tril()[None, None]
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask


def last_backend() -> str | None:
    """The posenc backend that served the last HF attention call in this thread (None before any)."""
    return getattr(_state, "last_backend", None)


# ---------------------------------------------------------------------------- swapping the encoding
class _NoRotation(nn.Module):
    """Stands in for a model's rotary embedding: ``cos = 1, sin = 0``, so HF's rotation is the identity."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def forward(self, x: Tensor, position_ids: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        shape = (*position_ids.shape, self.head_dim)
        return x.new_ones(shape), x.new_zeros(shape)


def _decoder(model: nn.Module) -> nn.Module:
    """The module holding ``rotary_emb`` and ``layers`` (``model.model`` for a ``...ForCausalLM``)."""
    for candidate in (model, getattr(model, "model", None)):
        has_parts = (
            candidate is not None and hasattr(candidate, "rotary_emb") and hasattr(candidate, "layers")
        )
        if has_parts and all(hasattr(layer, "self_attn") for layer in candidate.layers):
            return candidate
    raise ValueError(
        f"swap_encoding: {type(model).__name__} is not a Llama-family decoder (one rotary_emb and layers "
        "with self_attn); supported: Llama, Mistral, Qwen2, Qwen3 and models built the same way"
    )


def swap_encoding(model: nn.Module, encoding: str | Sequence[str]) -> nn.Module:
    """Replace the rotary embedding of a Llama-family HF model by posenc encodings, in place.

    Args:
        model: e.g. ``LlamaForCausalLM``; its rotary embedding becomes the identity and its attention
            implementation becomes ``"posenc"`` (:func:`register` is called).
        encoding: one spec for every layer (``"alibi"``, ``"nope"``, ``"rope:scaling=yarn,..."``), or
            one spec per layer. ABSOLUTE encodings other than ``nope`` act on the input embeddings and
            are refused. Each layer gets its own encoding module (``self_attn.posenc_encoding``,
            trainable where the encoding has parameters), on the model's device and dtype.

    Returns:
        ``model``.
    """
    decoder = _decoder(model)
    layers = list(decoder.layers)
    specs = [encoding] * len(layers) if isinstance(encoding, str) else list(encoding)
    if len(specs) != len(layers):
        raise ValueError(f"swap_encoding: got {len(specs)} specs for a model of {len(layers)} layers")
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    reference = next(model.parameters())
    context = LayerContext(
        num_heads=heads,
        head_dim=head_dim,
        dim=config.hidden_size,
        causal=True,
        max_len=getattr(config, "max_position_embeddings", None),
        device=reference.device,
        dtype=reference.dtype,
    )
    built = []
    for index, spec in enumerate(specs):
        enc = build_for_layer(spec, context)
        if enc.kind is Kind.ABSOLUTE and enc.name != "nope":
            raise ValueError(
                f"swap_encoding: layer {index}: {enc.name!r} adds positions to the input embeddings, which "
                "an attention implementation cannot do; use a rotary, bias or relative encoding (or nope)"
            )
        built.append(enc)
    _check_rotary_interface(decoder.rotary_emb)
    for layer, enc in zip(layers, built, strict=True):
        layer.self_attn.posenc_encoding = enc
        if not getattr(layer.self_attn, "_posenc_cache_hook", False):
            layer.self_attn.register_forward_pre_hook(_remember_cache, with_kwargs=True)
            layer.self_attn._posenc_cache_hook = True
    decoder.rotary_emb = _NoRotation(head_dim)
    model.set_attn_implementation(register(_backend["name"]))
    return model


#: The names HF's attention modules take their KV cache under (5.24: ``cache``; before: ``past_key_values``).
_CACHE_NAMES = ("cache", "past_key_values")


def _remember_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a swapped layer's attention: the KV cache of this call (None without one),
    so :func:`_swapped_positions` keeps the key positions with the cache they belong to."""
    cache = next((kwargs[name] for name in _CACHE_NAMES if kwargs.get(name) is not None), None)
    if cache is None and args:  # passed by position: bind to find it
        import inspect

        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        cache = next((bound[name] for name in _CACHE_NAMES if bound.get(name) is not None), None)
    module.__dict__["_posenc_call_cache"] = cache


def _key_positions_store(cache: Any) -> dict[int, Tensor]:
    """The key positions posenc keeps with an HF cache object, per layer index."""
    store = getattr(cache, "_posenc_key_positions", None)
    if store is None:
        store = {}
        cache._posenc_key_positions = store
    return store


def _swapped_positions(
    module: nn.Module, position_ids: Tensor | None, q_len: int, k_len: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Query positions from HF's ``position_ids`` and key positions: the cached keys' (kept with the
    cache object this call uses, so two caches, or an uncached call between two steps, never mix)
    followed by the queries'."""
    if position_ids is None:
        raise ValueError("swap_encoding: the model did not pass position_ids to its attention")
    q_pos = position_ids.to(device).long()
    if q_pos.dim() == 1:
        q_pos = q_pos[None]
    past = k_len - q_len
    cache = module.__dict__.get("_posenc_call_cache")
    layer = getattr(module, "layer_idx", 0)
    previous = None if cache is None else _key_positions_store(cache).get(layer)
    if past == 0:
        k_pos = q_pos
    elif previous is not None and previous.shape[1] >= past:
        # A sliding-window cache keeps the newest keys only: the last ``past`` positions.
        batch = max(previous.shape[0], q_pos.shape[0])
        k_pos = torch.cat(
            [previous[:, previous.shape[1] - past :].expand(batch, -1), q_pos.expand(batch, -1)], 1
        )
    else:
        had = "none" if previous is None else previous.shape[1]
        raise ValueError(
            f"swap_encoding: the attention got {past} cached keys but the cache remembers the positions of "
            f"{had}; a swapped model decodes with HF's dynamic cache from a fresh start (no static cache)"
        )
    if cache is not None:
        _key_positions_store(cache)[layer] = k_pos
    return q_pos, k_pos


def _check_rotary_interface(rotary: nn.Module) -> None:
    """``_NoRotation`` stands in for ``rotary_emb(x, position_ids)``: refuse another call convention."""
    from .seams import SEAMS, parameter_names

    if isinstance(rotary, _NoRotation):
        return
    found = parameter_names(type(rotary).forward)
    if found[1:3] != ("x", "position_ids"):
        raise ValueError(
            f"swap_encoding: {type(rotary).__name__}: "
            + SEAMS["LlamaRotaryEmbedding.forward"].mismatch(
                "forward(x, position_ids)", f"forward{found[1:]}"
            )
        )


def set_rope_scaling(model: nn.Module, rope_parameters: dict[str, Any]) -> nn.Module:
    """Change the RoPE scaling of a loaded Llama-family HF model in place.

    Equal to loading the model with ``config.rope_parameters = rope_parameters`` (the HF rope types:
    ``default``, ``linear``, ``dynamic``, ``yarn``, ``longrope``, ``llama3``, ...). A model whose encoding
    was swapped by :func:`swap_encoding` is refused: give the scaling in its posenc spec instead.

    The parameters are checked first (posenc's own RoPE scaling reads them: an unknown ``rope_type``, a
    missing or out-of-range option is a ValueError naming the key), and the new rotary embedding is
    built from a copy of the config: on any error the model and its config are left as they were.
    """
    import copy

    decoder = _decoder(model)
    if isinstance(decoder.rotary_emb, _NoRotation):
        raise ValueError(
            "set_rope_scaling: this model's encoding was swapped; put the scaling in the posenc spec"
        )
    if not isinstance(rope_parameters, dict) or "rope_type" not in rope_parameters:
        raise ValueError(
            f"set_rope_scaling: rope_parameters must be a dict with a rope_type, got {rope_parameters!r}"
        )
    config = model.config
    merged = {"rope_theta": config.rope_parameters.get("rope_theta"), **rope_parameters}
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    try:  # posenc's RoPE reads the same dict: its checks name the key at fault
        build(
            "rope",
            head_dim=head_dim,
            rope_parameters=merged,
            max_position_embeddings=getattr(config, "max_position_embeddings", None),
        )
    except (ValueError, TypeError) as err:
        raise ValueError(f"set_rope_scaling: {err}") from err
    old = decoder.rotary_emb
    trial = copy.deepcopy(config)
    trial.rope_parameters = merged
    try:
        type(old)(config=trial)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"set_rope_scaling: {type(old).__name__} cannot be built with rope_parameters={merged!r}: "
            f"{type(err).__name__}: {err}"
        ) from err
    config.rope_parameters = merged
    device = old.inv_freq.device if hasattr(old, "inv_freq") else next(model.parameters()).device
    decoder.rotary_emb = type(old)(config=config).to(device)
    return model


# ---------------------------------------------------------------------------- binding to HF's internals
def _check_interface(
    module: nn.Module,
    seam: str,
    parameters: Sequence[str],
    attributes: Sequence[str],
    one_of: Sequence[str] = (),
) -> None:
    """Bind by what the installed module offers, not by a version number: its ``forward`` must take
    ``parameters`` (and one of ``one_of``, when given) and the module must have ``attributes``.
    Anything else is refused naming what posenc expected, what it found, and the supported range
    (:data:`posenc.seams.SEAMS` ``[seam]``)."""
    from .seams import SEAMS, parameter_names

    found = [name for name in parameter_names(type(module).forward) if name != "self"]
    missing = [name for name in parameters if name not in found]
    if one_of and not any(name in found for name in one_of):
        missing.append(" or ".join(one_of))
    missing += [f"attribute {name}" for name in attributes if not hasattr(module, name)]
    if missing:
        wanted = [*parameters, *([" or ".join(one_of)] if one_of else [])]
        expected = f"forward({', '.join(wanted)}, ...) and attributes {', '.join(attributes)}"
        raise ValueError(
            "use_posenc_attention: "
            + SEAMS[seam].mismatch(expected, f"forward({', '.join(found)}), lacking {', '.join(missing)}")
            + "; or use attn_implementation='posenc' (dense position_bias)"
        )


# ---------------------------------------------------------------------------- models without the interface
def _bloom_attention_forward(
    self: nn.Module,
    hidden_states: Tensor,
    residual: Tensor,
    alibi: Tensor,
    attention_mask: Tensor | None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """``BloomAttention.forward`` on posenc's backends, with posenc's ALiBi (BLOOM's slopes).

    BLOOM adds ``m_h · pos_j`` (key positions counted over real tokens); posenc adds ``−m_h · (i − j)``
    over token indices. Under BLOOM's causal mask the two differ per query row by a constant (the
    query's index, and the number of left-padding tokens), which the softmax cancels.
    """
    if self.pretraining_tp > 1 and self.slow_but_exact:
        raise ValueError("use_posenc_attention: BLOOM's slow_but_exact tensor-parallel path is not served")
    batch, q_len, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    k_len = key.shape[2]
    allowed = _allowed_keys(attention_mask)
    name, out, weights = attend(
        query,
        key,
        value,
        encoding=self.posenc_encoding,
        q_pos=torch.arange(k_len - q_len, k_len, device=query.device)[None],
        k_pos=torch.arange(k_len, device=query.device)[None],
        scale=self.inv_norm_factor,
        causal=True,
        causal_offset=k_len - q_len,
        attn_mask=allowed,
        dropout_p=self.attention_dropout.p if self.training else 0.0,
        need_weights=output_attentions,
        backend=_backend["name"],
    )
    _state.last_backend = name
    context = out.transpose(1, 2).reshape(batch, q_len, self.hidden_size)
    output = nn.functional.dropout(self.dense(context), p=self.hidden_dropout, training=self.training)
    return residual + output, weights


def _allowed_keys(mask: Tensor | None) -> Tensor | None:
    """HF's 4-D attention mask as a bool mask (True = attend): a bool mask as it is; HF's eager float
    mask (0 where allowed, the dtype's minimum or -inf where not) compared with half that minimum."""
    if mask is not None and not isinstance(mask, Tensor):
        raise ValueError(
            f"use_posenc_attention: the model passed its attention a {type(mask).__name__} mask; posenc reads "
            "tensor masks: set the model's attn_implementation to 'posenc' (or 'sdpa' / 'eager')"
        )
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


#: What :func:`_bloom_attention_forward` needs of ``BloomAttention``.
_BLOOM_PARAMETERS = (
    "hidden_states", "residual", "alibi", "attention_mask", "layer_past", "use_cache", "output_attentions",
)  # fmt: skip
_BLOOM_ATTRIBUTES = (
    "query_key_value", "_reshape", "num_heads", "inv_norm_factor", "attention_dropout", "hidden_size", "dense",
    "hidden_dropout", "pretraining_tp", "slow_but_exact", "layer_idx",
)  # fmt: skip


def _bloom_encoding(module: nn.Module) -> PositionalEncoding:
    _check_interface(module, "BloomAttention.forward", _BLOOM_PARAMETERS, _BLOOM_ATTRIBUTES)
    reference = next(module.parameters())
    return build("alibi", num_heads=module.num_heads).to(reference.device)


# ---------------------------------------------------------------------------- T5
#: HF's T5 relatives with T5's attention, stack and bias sharing, by class name: attention, stack.
_T5_CLASSES = {"T5Attention": "T5Stack", "MT5Attention": "MT5Stack"}


def _t5_attention_forward(
    self: nn.Module,
    hidden_states: Tensor,
    mask: Tensor | None = None,
    key_value_states: Tensor | None = None,
    position_bias: Tensor | None = None,
    past_key_values: Any = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, None, Tensor | None]:
    """``T5Attention.forward`` on posenc's backends, with the relative bias as posenc's ``t5`` encoding.

    The KV cache arrives as ``cache`` (transformers 5.24) or ``past_key_values`` (5.15-5.23): the
    caller passes exactly one of the two, whichever the installed ``T5Attention.forward`` names
    (:func:`_check_t5_interface` checks at patch time that it names one).

    Self-attention reads the stack's one bias table (``relative_attention_bias`` of its first layer,
    shared, not copied) through ``bias_at``, so no backend builds a dense ``[B, H, L, L]`` bias (the
    blocked backend's near/far split runs long unpadded sequences); cross-attention has no bias. T5
    does not scale ``q·k``. Shapes: ``hidden_states [B, Tq, d_model]``, ``key_value_states [B, Tk,
    d_model]`` (cross-attention), ``mask`` HF's ``[B, 1, Tq, Tk]`` (bool, or eager's float) or None.
    Returns ``(out [B, Tq, d_model], None, weights)``: the None stands for HF's dense position bias,
    which the stack hands to the next layers, and which they do not need.
    """
    if position_bias is not None:
        raise ValueError(
            "use_posenc_attention: a T5 attention served by posenc computes its bias from the shared table; "
            "position_bias must be None"
        )
    batch, q_len, _ = hidden_states.shape
    cross = key_value_states is not None
    query = self.q(hidden_states).view(batch, q_len, -1, self.key_value_proj_dim).transpose(1, 2)
    key, value, past = _t5_keys_values(
        self,
        key_value_states if cross else hidden_states,
        cross,
        cache if cache is not None else past_key_values,
    )
    k_len = key.shape[2]
    causal = bool(self.is_causal) and not cross and mask is None and q_len > 1
    device = query.device
    name, out, weights = attend(
        query,
        key,
        value,
        encoding=_nope if cross else self.posenc_encoding,
        q_pos=torch.arange(past, past + q_len, device=device)[None],  # HF's cache_position
        k_pos=torch.arange(k_len, device=device)[None],
        scale=1.0,
        causal=causal,
        causal_offset=past if causal else 0,
        attn_mask=_allowed_keys(mask),
        dropout_p=self.dropout if self.training else 0.0,
        need_weights=bool(kwargs.get("output_attentions", False)),
        backend=_backend["name"],
    )
    _state.last_backend = name
    return self.o(out.transpose(1, 2).reshape(batch, q_len, -1)), None, weights


def _t5_keys_values(module: nn.Module, source: Tensor, cross: bool, cache: Any) -> tuple[Tensor, Tensor, int]:
    """Keys and values ``[B, H, Tk, D]`` of ``source``, through HF's cache, and the number of tokens the
    self-attention cache held before this call (the first query's position)."""
    from transformers.cache_utils import EncoderDecoderCache

    layer = module.layer_idx
    past = 0 if cache is None or cross else int(cache.get_seq_length(layer))
    own_cache, reuse = cache, False
    if isinstance(cache, EncoderDecoderCache):
        own_cache = cache.cross_attention_cache if cross else cache.self_attention_cache
        reuse = cross and bool(cache.is_updated.get(layer))
    if reuse:  # the encoder's keys and values, projected at the first decoding step
        return own_cache.layers[layer].keys, own_cache.layers[layer].values, past
    batch, length, _ = source.shape
    key = module.k(source).view(batch, length, -1, module.key_value_proj_dim).transpose(1, 2)
    value = module.v(source).view(batch, length, -1, module.key_value_proj_dim).transpose(1, 2)
    if own_cache is not None:
        key, value = own_cache.update(key, value, layer)
        if cross and isinstance(cache, EncoderDecoderCache):
            cache.is_updated[layer] = True
    return key, value, past


def _t5_encoding(owner: nn.Module, model: nn.Module) -> PositionalEncoding:
    """posenc's ``t5`` encoding on ``owner``'s bias table: HF's ``relative_attention_bias`` module itself
    (one parameter: HF's state dict, optimiser and gradients see it as before)."""
    try:
        encoding = build(
            "t5",
            num_heads=owner.n_heads,
            num_buckets=owner.relative_attention_num_buckets,
            max_distance=owner.relative_attention_max_distance,
            bidirectional=not owner.is_decoder,  # HF's rule: decoder stacks bucket causally
        )
    except ValueError as err:
        raise ValueError(
            f"use_posenc_attention: {type(model).__name__}'s relative_attention_num_buckets / "
            f"relative_attention_max_distance are outside what posenc's t5 bucket function serves: {err}"
        ) from err
    encoding.table = owner.relative_attention_bias
    return encoding


#: What :func:`_t5_attention_forward` needs of ``T5Attention``: these ``forward`` parameters, one of
#: the cache names, and these attributes (``is_causal``: HF 5.15+, which passes the mask apart from the bias).
_T5_PARAMETERS = ("hidden_states", "mask", "key_value_states", "position_bias")
_T5_CACHE_NAMES = ("cache", "past_key_values")
_T5_ATTRIBUTES = (
    "is_causal", "q", "k", "v", "o", "key_value_proj_dim", "n_heads", "layer_idx", "dropout", "is_decoder",
    "relative_attention_num_buckets", "relative_attention_max_distance",
)  # fmt: skip


def _check_t5_interface(attention: nn.Module) -> None:
    _check_interface(attention, "T5Attention.forward", _T5_PARAMETERS, _T5_ATTRIBUTES, one_of=_T5_CACHE_NAMES)
    return None


def _use_attribute(module: nn.Module, encoding: PositionalEncoding) -> None:
    """``module.posenc_encoding = encoding`` without registering it as a submodule: the table it holds is
    the stack owner's parameter, which must not appear twice in HF's state dict."""
    module.__dict__["posenc_encoding"] = encoding


def _patch_t5(model: nn.Module) -> int:
    """Serve every T5 attention of ``model`` (:func:`_t5_attention_forward`); returns how many."""
    import types

    patched = []
    for stack in _t5_stacks(model):
        owner = stack.block[0].layer[0].SelfAttention
        _check_t5_interface(owner)
        if not getattr(owner, "has_relative_attention_bias", False):
            raise ValueError(
                f"use_posenc_attention: the first block of {type(stack).__name__} has no relative_attention_bias"
            )
        encoding = _t5_encoding(owner, model)
        for block in stack.block:
            _use_attribute(block.layer[0].SelfAttention, encoding)
            patched.append(block.layer[0].SelfAttention)
            if stack.is_decoder:
                patched.append(block.layer[1].EncDecAttention)
    for module in patched:
        module.forward = types.MethodType(_t5_attention_forward, module)
    missed = [
        name
        for name, module in model.named_modules()
        if type(module).__name__ in _T5_CLASSES and module not in patched
    ]
    if missed:
        raise ValueError(
            f"use_posenc_attention: {type(model).__name__} has T5 attention outside a T5 stack ({missed[0]}); "
            "only attention built the way T5Stack builds it is served"
        )
    if patched:  # HF then builds bool masks, and none without padding
        implementation = register(_backend["name"])
        owners = [model] if hasattr(model, "set_attn_implementation") else _t5_stacks(model)
        for owner in owners:
            owner.set_attn_implementation(implementation)
    return len(patched)


def _t5_stacks(model: nn.Module) -> list[nn.Module]:
    names = set(_T5_CLASSES.values())
    return [module for module in model.modules() if type(module).__name__ in names]


#: Attention classes (by class name) that have no AttentionInterface hook, and how posenc serves them.
_PATCHED = {"BloomAttention": (_bloom_attention_forward, _bloom_encoding)}


def use_posenc_attention(model: nn.Module) -> nn.Module:
    """Run the attention of a bias model (BLOOM, T5) on posenc's backends and structured biases, in place.

    Served:

    * BLOOM (ALiBi): each ``BloomAttention`` gets posenc's ``alibi`` (equal slopes) and a forward that
      runs through :func:`~posenc.backends.run.attend`, so the dispatcher picks the backend (the
      blocked and split paths for long sequences).
    * T5 and mT5 (``T5ForConditionalGeneration``, ``T5EncoderModel``, ``T5Model``, ...): each stack's
      self-attention runs posenc's ``t5`` encoding (bidirectional buckets in the encoder, causal in
      the decoder, HF's ``relative_attention_num_buckets`` and ``relative_attention_max_distance``)
      on the stack's ``relative_attention_bias`` table, shared with HF (gradients reach it, the state
      dict is unchanged); cross-attention has no bias. The model's attention implementation becomes
      ``"posenc"`` (:func:`register`), so HF passes bool masks, and none without padding.

    Models with HF's ``AttentionInterface`` and no bias of their own take ``attn_implementation="posenc"``
    (:func:`register`) instead. Raises ``ValueError`` naming the model class when nothing is served.
    """
    import types

    patched = _patch_t5(model)
    for module in model.modules():
        entry = _PATCHED.get(type(module).__name__)
        if entry is not None:
            forward, encoding = entry
            module.posenc_encoding = encoding(module)
            module.forward = types.MethodType(forward, module)
            patched += 1
    if not patched:
        served = ", ".join([*_PATCHED, *_T5_CLASSES])
        raise ValueError(
            f"use_posenc_attention: {type(model).__name__} has no attention posenc patches (served: "
            f"{served}); models with HF's AttentionInterface take attn_implementation='posenc'"
        )
    return model
