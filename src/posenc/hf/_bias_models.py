"""Bias models without HF's attention hook, served by posenc's structured biases: BLOOM (ALiBi), T5 / mT5,
MPNet (T5's bidirectional buckets)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from ..backends.run import attend
from ..encodings.base import PositionalEncoding
from ..encodings.registry import build
from ..kernels.position_ranges import counting_positions
from ..seams import SEAMS
from ._attention import register
from ._common import BACKEND, NOPE, allowed_keys, check_interface, note_backend
from ._masks import note_own_attention_served


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
    allowed = allowed_keys(attention_mask)
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
        backend=BACKEND["name"],
    )
    note_backend(name)
    context = out.transpose(1, 2).reshape(batch, q_len, self.hidden_size)
    output = nn.functional.dropout(self.dense(context), p=self.hidden_dropout, training=self.training)
    return residual + output, weights


#: What :func:`_bloom_attention_forward` needs of ``BloomAttention``.
_BLOOM_PARAMETERS = (
    "hidden_states", "residual", "alibi", "attention_mask", "layer_past", "use_cache", "output_attentions",
)  # fmt: skip
_BLOOM_ATTRIBUTES = (
    "query_key_value", "_reshape", "num_heads", "inv_norm_factor", "attention_dropout", "hidden_size", "dense",
    "hidden_dropout", "pretraining_tp", "slow_but_exact", "layer_idx",
)  # fmt: skip


def _bloom_encoding(module: nn.Module) -> PositionalEncoding:
    check_interface(module, "BloomAttention.forward", _BLOOM_PARAMETERS, _BLOOM_ATTRIBUTES)
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
    near_far backend runs long unpadded sequences); cross-attention has no bias. T5
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
        encoding=NOPE if cross else self.posenc_encoding,
        q_pos=torch.arange(past, past + q_len, device=device)[None],  # HF's cache_position
        k_pos=torch.arange(k_len, device=device)[None],
        scale=1.0,
        causal=causal,
        causal_offset=past if causal else 0,
        attn_mask=allowed_keys(mask),
        dropout_p=self.dropout if self.training else 0.0,
        need_weights=bool(kwargs.get("output_attentions", False)),
        backend=BACKEND["name"],
    )
    note_backend(name)
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
    check_interface(attention, "T5Attention.forward", _T5_PARAMETERS, _T5_ATTRIBUTES, one_of=_T5_CACHE_NAMES)
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
        implementation = register(BACKEND["name"])
        owners = [model] if hasattr(model, "set_attn_implementation") else _t5_stacks(model)
        for owner in owners:
            owner.set_attn_implementation(implementation)
    return len(patched)


def _t5_stacks(model: nn.Module) -> list[nn.Module]:
    names = set(_T5_CLASSES.values())
    return [module for module in model.modules() if type(module).__name__ in names]


# ---------------------------------------------------------------------------- MPNet
#: MPNet's encoder, its self-attention (by class name), and what the bridge needs of each.
_MPNET_ENCODER, _MPNET_ATTENTION = "MPNetEncoder", "MPNetSelfAttention"
_MPNET_PARAMETERS = ("hidden_states", "attention_mask", "position_bias", "output_attentions")
_MPNET_ATTRIBUTES = ("q", "k", "v", "o", "attention_head_size", "all_head_size", "dropout")
_MPNET_ENCODER_ATTRIBUTES = ("layer", "n_heads", "relative_attention_bias")
#: What to use instead when the installed MPNet is not the interface the bridge binds to.
_MPNET_INSTEAD = "MPNet's own attention (attn_implementation='eager')"


def _mpnet_attention_forward(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    position_bias: Tensor | None = None,
    output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, ...]:
    """``MPNetSelfAttention.forward`` on posenc's backends, with MPNet's relative bias as posenc's ``t5``.

    HF's MPNet adds ``table[bucket(j - i)]`` (T5's bidirectional buckets over token indices, padding
    included: ``MPNetEncoder.compute_position_bias`` without ``position_ids``) and the mask to
    ``q·k / √D``. Here the bias is the layer's ``posenc_encoding`` (the encoder's one table, shared,
    or what :func:`~posenc.hf.swap_encoding` put there) evaluated by the backend, never a dense
    ``[B, H, L, L]`` tensor, and the mask is read for what it is (:func:`allowed_keys`): HF's eager
    float mask (0 or the dtype's minimum) and ``sdpa_mask``'s bool mask (True = attend) hide the
    same keys. (MPNet's own attention adds whatever mask it gets as numbers: a bool one hides nothing.)

    Shapes: ``hidden_states [B, T, E]``, ``attention_mask [B, 1, T, T]`` or None. Returns
    ``(out [B, T, E],)``, or ``(out, weights [B, H, T, T])`` when ``output_attentions``.
    """
    if position_bias is not None:
        raise ValueError(
            "use_posenc_attention: an MPNet attention served by posenc computes its bias from the encoder's "
            "table; position_bias must be None"
        )
    batch, length, _ = hidden_states.shape
    shape = (batch, length, -1, self.attention_head_size)
    query, key, value = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q, self.k, self.v))
    positions = counting_positions(length, query.device)
    name, out, weights = attend(
        query,
        key,
        value,
        encoding=_layer_encoding(self),
        q_pos=positions,
        k_pos=positions,
        scale=self.attention_head_size**-0.5,
        attn_mask=allowed_keys(attention_mask),
        dropout_p=self.dropout.p if self.training else 0.0,
        need_weights=bool(output_attentions),
        backend=BACKEND["name"],
    )
    note_backend(name)
    out = self.o(out.transpose(1, 2).reshape(batch, length, self.all_head_size))
    return (out, weights) if output_attentions else (out,)


def _layer_encoding(module: nn.Module) -> PositionalEncoding:
    """``module.posenc_encoding``: a plain attribute (the shared table's encoding) or a submodule (one
    :func:`~posenc.hf.swap_encoding` built for the layer)."""
    found = module.__dict__.get("posenc_encoding")
    return found if found is not None else module._modules["posenc_encoding"]


def _no_dense_bias(*args: Any, **kwargs: Any) -> None:
    """Stands in for a served encoder's ``compute_position_bias``: its layers compute the bias themselves."""
    return None


def _signature_default(function: Any, seam: str, parameter: str) -> int:
    """The integer default of ``parameter`` in the installed ``function`` (MPNet's bucket settings live
    there, not in its config), or a refusal naming the seam."""
    try:
        default = inspect.signature(function).parameters[parameter].default
    except (KeyError, TypeError, ValueError):
        default = None
    if isinstance(default, bool) or not isinstance(default, int):
        raise ValueError(
            "use_posenc_attention: "
            + SEAMS[seam].mismatch(f"an integer default for {parameter}")
            + f"; or use {_MPNET_INSTEAD}"
        )
    return default


def _mpnet_encoding(encoder: nn.Module) -> PositionalEncoding:
    """posenc's ``t5`` on ``encoder``'s ``relative_attention_bias`` (HF's module itself: one parameter).

    The buckets are HF's: ``compute_position_bias``'s ``num_buckets`` and ``relative_position_bucket``'s
    ``max_distance`` defaults (32 and 128; the encoder passes neither, whatever the config's
    ``relative_attention_num_buckets`` says), bidirectional."""
    check_interface(
        encoder, "MPNetEncoder.compute_position_bias", (), _MPNET_ENCODER_ATTRIBUTES, instead=_MPNET_INSTEAD
    )
    owner = type(encoder)
    num_buckets = _signature_default(
        owner.compute_position_bias, "MPNetEncoder.compute_position_bias", "num_buckets"
    )
    max_distance = _signature_default(
        owner.relative_position_bucket, "MPNetEncoder.relative_position_bucket", "max_distance"
    )
    table = encoder.relative_attention_bias
    if table.num_embeddings < num_buckets:
        raise ValueError(
            f"use_posenc_attention: MPNet's relative_attention_bias has {table.num_embeddings} rows but its "
            f"compute_position_bias buckets into {num_buckets}: set relative_attention_num_buckets={num_buckets}"
        )
    try:
        encoding = build(
            "t5",
            num_heads=encoder.n_heads,
            num_buckets=num_buckets,
            max_distance=max_distance,
            bidirectional=True,
        )
    except ValueError as err:
        raise ValueError(
            f"use_posenc_attention: MPNet's bucket settings (num_buckets={num_buckets}, "
            f"max_distance={max_distance}) are outside what posenc's t5 bucket function serves: {err}"
        ) from err
    encoding.table = table
    return encoding


def _patch_mpnet(model: nn.Module) -> int:
    """Serve every MPNet self-attention of ``model`` (:func:`_mpnet_attention_forward`); returns how many."""
    import types

    patched = []
    for encoder in [m for m in model.modules() if type(m).__name__ == _MPNET_ENCODER]:
        attentions = [layer.attention.attn for layer in encoder.layer]
        for attention in attentions:  # every interface checked before anything is changed
            check_interface(
                attention,
                "MPNetSelfAttention.forward",
                _MPNET_PARAMETERS,
                _MPNET_ATTRIBUTES,
                instead=_MPNET_INSTEAD,
            )
        encoding = _mpnet_encoding(encoder)
        for attention in attentions:
            if "posenc_encoding" not in attention._modules:  # (a swapped layer keeps its own)
                _use_attribute(attention, encoding)
            attention.forward = types.MethodType(_mpnet_attention_forward, attention)
            patched.append(attention)
        encoder.compute_position_bias = _no_dense_bias
        note_own_attention_served(encoder.config)
    missed = [
        name for name, m in model.named_modules() if type(m).__name__ == _MPNET_ATTENTION and m not in patched
    ]
    if missed:
        raise ValueError(
            f"use_posenc_attention: {type(model).__name__} has MPNet attention outside an MPNetEncoder "
            f"({missed[0]}); only attention built the way MPNetEncoder builds it is served"
        )
    return len(patched)


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
    * MPNet (``MPNetModel``, ``MPNetForMaskedLM``, ...): each ``MPNetSelfAttention`` runs posenc's
      ``t5`` encoding (T5's bidirectional buckets with HF's MPNet settings, 32 and 128) on the
      encoder's one ``relative_attention_bias`` table, shared with HF, and the encoder no longer
      builds its dense ``[B, H, L, L]`` bias (``compute_position_bias`` returns None on it). The
      learned absolute positions stay HF's. Its attention implementation is left as it is: the
      bridge reads HF's eager float mask and posenc's bool mask alike.

    Models with HF's ``AttentionInterface`` and no bias of their own take ``attn_implementation="posenc"``
    (:func:`register`) instead. Raises ``ValueError`` naming the model class when nothing is served.
    """
    import types

    patched = _patch_t5(model) + _patch_mpnet(model)
    for module in model.modules():
        entry = _PATCHED.get(type(module).__name__)
        if entry is not None:
            forward, encoding = entry
            module.posenc_encoding = encoding(module)
            module.forward = types.MethodType(forward, module)
            patched += 1
    if not patched:
        served = ", ".join([*_PATCHED, *_T5_CLASSES, _MPNET_ATTENTION])
        raise ValueError(
            f"use_posenc_attention: {type(model).__name__} has no attention posenc patches (served: "
            f"{served}); models with HF's AttentionInterface take attn_implementation='posenc'"
        )
    return model
