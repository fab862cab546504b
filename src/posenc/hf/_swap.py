"""Swap a model's positional encoding for posenc encodings (a Llama-family decoder's rotary embedding;
a BERT or MPNet encoder's learned absolute table and relative bias); change a RoPE scaling in place."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ..encodings.base import Kind, LayerContext, PositionalEncoding
from ..encodings.registry import build, build_for_layer, resolve
from ..encodings.rope import RoPE, check_pairing
from ..seams import SEAMS, parameter_names
from ._attention import register
from ._common import BACKEND
from ._masks import own_attention_model
from ._pairing import check_permutable, permute_attention_channels
from ._positions import remember_cache


class _NoRotation(nn.Module):
    """Stands in for a model's rotary embedding: ``cos = 1, sin = 0``, so HF's rotation is the identity."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def forward(self, x: Tensor, position_ids: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        shape = (*position_ids.shape, self.head_dim)
        return x.new_ones(shape), x.new_zeros(shape)


def _decoder(model: nn.Module) -> nn.Module | None:
    """The module holding ``rotary_emb`` and ``layers`` (``model.model`` for a ``...ForCausalLM``), or None."""
    for candidate in (model, getattr(model, "model", None)):
        has_parts = (
            candidate is not None and hasattr(candidate, "rotary_emb") and hasattr(candidate, "layers")
        )
        if has_parts and all(hasattr(layer, "self_attn") for layer in candidate.layers):
            return candidate
    return None


#: The names HF models give their absolute position tables (Whisper, BART, OPT; GPT-2; BERT).
_TABLE_NAMES = ("embed_positions", "wpe", "position_embeddings")


def _tables_reason(model: nn.Module) -> str:
    """What a model swap_encoding cannot serve has instead of a rotary embedding: its absolute position
    tables by qualified name (Whisper: ``model.encoder.embed_positions``, ``model.decoder.embed_positions``),
    or ``""`` when it has none."""
    tables = [
        name
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in _TABLE_NAMES and isinstance(module, nn.Embedding)
    ]
    if not tables:
        return ""
    return (
        f": it has no rotary embedding to replace; its positions are absolute tables added to the input "
        f"embeddings ({', '.join(tables)}), which swap_encoding takes out only of a BERT or MPNet encoder, "
        "so a posenc encoding in its attention would add a second position signal (to run its attention "
        "through posenc unchanged, use attn_implementation='posenc' after posenc.hf.register())"
    )


def _llama_decoder(model: nn.Module, where: str) -> nn.Module:
    decoder = _decoder(model)
    if decoder is None:
        raise ValueError(
            f"{where}: {type(model).__name__} is not a Llama-family decoder (one rotary_emb and layers "
            "with self_attn); supported: Llama, Mistral, Qwen2, Qwen3 and models built the same way"
        )
    return decoder


def swap_encoding(
    model: nn.Module, encoding: str | Sequence[str], *, keep_absolute: bool = False
) -> nn.Module:
    """Replace the positional encoding of an HF model by posenc encodings, in place.

    Args:
        model: a Llama-family decoder (e.g. ``LlamaForCausalLM``): its rotary embedding becomes the
            identity and its attention implementation becomes ``"posenc"`` (:func:`register` is
            called). Or a bidirectional encoder with a learned absolute table: BERT (``BertModel`` and
            models built the same way, whose attention goes through HF's ``AttentionInterface``) or
            MPNet (its learned table and T5-bucketed relative bias; its attention is served by
            :func:`~posenc.hf.use_posenc_attention`, applied here); a warning then says what changed.
        encoding: one spec for every layer (``"alibi"``, ``"nope"``, ``"rope:scaling=yarn,..."``), or
            one spec per layer. Each layer gets its own encoding module (``posenc_encoding`` of its
            attention, trainable where the encoding has parameters), on the model's device and dtype.
            A decoder refuses ABSOLUTE encodings other than ``nope`` (they act on the input
            embeddings). In an encoder's bidirectional layers a spec takes its class's
            ``noncausal_options`` (ALiBi's symmetric form; a causal-only encoding is refused); an
            ABSOLUTE spec (one for the model) replaces BERT's table by posenc's encoding at the same
            positions, and any other removes the table (zeros in its place, unless ``keep_absolute``)
            and acts inside every layer's attention (MPNet: in place of its relative bias).
        keep_absolute: an encoder keeps its learned absolute table beside an in-attention spec (MPNet
            with another bias). A decoder has no such table and refuses it.

    Returns:
        ``model``.
    """
    decoder = _decoder(model)
    if decoder is None:
        parts = _encoder_parts(model)
        if parts is not None:
            return _swap_encoder(model, parts, encoding, keep_absolute)
        raise ValueError(
            f"swap_encoding: {type(model).__name__} is not a Llama-family decoder (one rotary_emb and "
            "layers with self_attn: Llama, Mistral, Qwen2, Qwen3, ...) nor a BERT or MPNet encoder "
            f"(embeddings.position_embeddings and encoder.layer){_tables_reason(model)}"
        )
    if keep_absolute:
        raise ValueError(
            f"swap_encoding: keep_absolute=True, but {type(model).__name__} has no learned absolute table "
            "(its positions are its rotary embedding): leave keep_absolute False"
        )
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
            layer.self_attn.register_forward_pre_hook(remember_cache, with_kwargs=True)
            layer.self_attn._posenc_cache_hook = True
    decoder.rotary_emb = _NoRotation(head_dim)
    model.set_attn_implementation(register(BACKEND["name"]))
    return model


# ---------------------------------------------------------------------------- encoders: BERT, MPNet


class _NoPositions(nn.Module):
    """Stands in for a removed learned position table: zeros ``[*position_ids.shape, dim]``."""

    def __init__(self, dim: int, like: Tensor) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("like", like.new_zeros(0), persistent=False)  # follows .to(device, dtype)

    def forward(self, position_ids: Tensor) -> Tensor:
        return self.like.new_zeros(*position_ids.shape, self.dim)


class _PositionTable(nn.Module):
    """posenc's ABSOLUTE ``encoding`` in place of a learned table: the rows at HF's ``position_ids``."""

    def __init__(self, encoding: PositionalEncoding, like: Tensor) -> None:
        super().__init__()
        self.encoding = encoding
        self.register_buffer("like", like.new_zeros(0), persistent=False)

    def forward(self, position_ids: Tensor) -> Tensor:
        return self.encoding.encode(position_ids, dtype=self.like.dtype)  # type: ignore[attr-defined]


def _encoder_parts(model: nn.Module) -> tuple[str, nn.Module, list[nn.Module]] | None:
    """``(family, embeddings, attentions)`` of a BERT-built or MPNet encoder, or None: the base model
    (``model.base_model``) has ``embeddings.position_embeddings`` and ``encoder.layer``, and each
    layer's ``attention.self`` (BERT: HF's ``AttentionInterface`` serves it) or ``attention.attn``
    (MPNet's own attention)."""
    base = getattr(model, "base_model", model)
    embeddings = getattr(base, "embeddings", None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if embeddings is None or not hasattr(embeddings, "position_embeddings") or layers is None:
        return None
    attentions = [getattr(layer, "attention", None) for layer in layers]
    if all(hasattr(a, "attn") for a in attentions) and type(base.encoder).__name__ == "MPNetEncoder":
        return "mpnet", embeddings, [a.attn for a in attentions]
    if all(hasattr(a, "self") for a in attentions):
        return "bert", embeddings, [a.self for a in attentions]
    return None


def _swap_encoder(
    model: nn.Module, parts: tuple[str, nn.Module, list[nn.Module]], encoding: str | Sequence[str], keep: bool
) -> nn.Module:
    """:func:`swap_encoding` on an encoder (see there); every check before any change."""
    family, embeddings, attentions = parts
    name, config = type(model).__name__, model.config
    table = _check_encoder(model, family, embeddings)
    specs = [encoding] * len(attentions) if isinstance(encoding, str) else list(encoding)
    if len(specs) != len(attentions):
        raise ValueError(f"swap_encoding: got {len(specs)} specs for a model of {len(attentions)} layers")
    heads = config.num_attention_heads
    weight = table.weight
    context = LayerContext(
        num_heads=heads,
        head_dim=config.hidden_size // heads,
        dim=config.hidden_size,
        causal=False,
        max_len=table.num_embeddings,
        device=weight.device,
        dtype=weight.dtype,
    )
    parsed = [resolve(spec) for spec in specs]
    absolute = [spec.cls.kind is Kind.ABSOLUTE and spec.name != "nope" for spec in parsed]
    described = f"the learned absolute positions ({table.num_embeddings} x {table.embedding_dim})"
    if any(absolute):
        _check_table_replacement(name, family, table, encoding, keep, described)
        replacement = _PositionTable(build_for_layer(parsed[0], context), weight)
        embeddings.position_embeddings = replacement
        _say(name, [f"replaced {described} by posenc's {replacement.encoding.spec()!r}"])
        return model
    built = [_encoder_layer_encoding(spec, context, index) for index, spec in enumerate(parsed)]
    shown = ", ".join(repr(spec) for spec in sorted({enc.spec() for enc in built}))
    where = f"in the attention of its {len(built)} layers"
    if family == "mpnet":
        from ._bias_models import use_posenc_attention

        use_posenc_attention(model)  # MPNet's attention on posenc's backends (checks its interface)
        changes = [f"replaced its relative bias (T5 buckets, one table for every layer) by {shown} {where}"]
    else:
        model.set_attn_implementation(register(BACKEND["name"]))
        changes = [f"added {shown} {where}"]
    for attention, enc in zip(attentions, built, strict=True):
        attention.posenc_encoding = enc
    if keep:
        changes.append(f"kept {described}")
    else:
        embeddings.position_embeddings = _NoPositions(table.embedding_dim, weight)
        changes.append(f"removed {described}: zeros in their place")
    _say(name, changes)
    return model


def _check_encoder(model: nn.Module, family: str, embeddings: nn.Module) -> nn.Embedding:
    """The encoder's learned table, once the encoder is one :func:`swap_encoding` serves."""
    name, config = type(model).__name__, model.config
    if family == "bert" and own_attention_model(type(config)) is not None:
        raise ValueError(
            f"swap_encoding: {name}'s attention does not go through HF's AttentionInterface, so posenc "
            "cannot act inside it; served encoders: BERT-built models and MPNet"
        )
    if getattr(config, "is_decoder", False):
        raise ValueError(
            f"swap_encoding: {name} is configured as a decoder (is_decoder=True); swap_encoding serves "
            "it as a bidirectional encoder: load it with is_decoder=False"
        )
    table = embeddings.position_embeddings
    if not isinstance(table, nn.Embedding):
        raise ValueError(
            f"swap_encoding: {name}'s position table was swapped already ({type(table).__name__}); "
            "swap a freshly loaded model"
        )
    return table


def _check_table_replacement(
    name: str, family: str, table: nn.Embedding, encoding: str | Sequence[str], keep: bool, described: str
) -> None:
    """An ABSOLUTE spec replaces the table: one spec, the table not kept, positions counted from 0."""
    if not isinstance(encoding, str):
        raise ValueError(
            "swap_encoding: an ABSOLUTE encoding replaces the model's one position table: give one spec, "
            f"not one per layer (got {list(encoding)})"
        )
    if keep:
        raise ValueError(
            f"swap_encoding: keep_absolute=True keeps {described}, but {encoding!r} would replace them: "
            "give an in-attention spec (rotary, bias, relative) or leave keep_absolute False"
        )
    if table.padding_idx is not None or family == "mpnet":
        raise ValueError(
            f"swap_encoding: {name} counts its absolute positions from padding_idx + 1 = "
            f"{(table.padding_idx or 0) + 1}, its pads at padding_idx, so posenc's {encoding!r} cannot "
            "take its place at the same positions; give an in-attention spec (the table is then removed, "
            "or kept with keep_absolute=True)"
        )


def _encoder_layer_encoding(spec: Any, context: LayerContext, index: int) -> PositionalEncoding:
    """The encoding of one bidirectional layer: the class's ``noncausal_options`` unless the spec sets them."""
    extra = {k: v for k, v in spec.cls.noncausal_options.items() if k not in spec.options}
    enc = build_for_layer(spec, context, **extra)
    if enc.causal_only:
        raise ValueError(
            f"swap_encoding: layer {index}: {enc.spec()!r} is defined for causal attention only, and the "
            "model's layers are bidirectional; use an encoding that serves encoders"
        )
    return enc


def _say(name: str, changes: list[str]) -> None:
    warnings.warn(f"swap_encoding: {name}: " + "; ".join(changes), UserWarning, stacklevel=4)


def switch_rope_pairing_(model: nn.Module, pairing: str = "interleaved") -> int:
    """Switch the posenc RoPE of a swapped HF model to ``pairing``, in place, exactly.

    The HF counterpart of :func:`posenc.switch_rope_pairing_`: each layer whose ``swap_encoding`` gave
    it a RoPE of another pairing gets its ``q_proj`` and ``k_proj`` output rows (weights and biases),
    and the per-channel weights of its ``q_norm``/``k_norm`` permuted by
    :func:`~posenc.encodings.rope.convert_rope_pairing` (``posenc.hf._pairing``; a module whose values
    are its keys, or that holds any other parameter, is refused, naming it), and its encoding
    switched, so the logits stay the same up to float rounding while the rotation takes the faster
    interleaved path.
    Keys an HF cache holds from before the switch are in the old layout: a later call that hands
    them over is refused (start a fresh cache).

    Returns:
        How many layers were switched (layers already in ``pairing``, or not RoPE, are left alone).
    """
    check_pairing(pairing)
    attentions = [layer.self_attn for layer in _llama_decoder(model, "switch_rope_pairing_").layers]
    if not any(hasattr(attention, "posenc_encoding") for attention in attentions):
        raise ValueError(
            "switch_rope_pairing_: the model's encoding was not swapped; call swap_encoding first"
        )
    switched = [
        a for a in attentions if isinstance(a.posenc_encoding, RoPE) and a.posenc_encoding.pairing != pairing
    ]
    for attention in switched:  # every module checked before any is changed
        check_permutable(attention, attention.posenc_encoding)
    for attention in switched:
        permute_attention_channels(attention, attention.posenc_encoding, pairing)
        attention.posenc_qk_layout = int(getattr(attention, "posenc_qk_layout", 0)) + 1
    for enc in {id(a.posenc_encoding): a.posenc_encoding for a in switched}.values():
        enc.switch_pairing_(pairing)
    return len(switched)


def _check_rotary_interface(rotary: nn.Module) -> None:
    """``_NoRotation`` stands in for ``rotary_emb(x, position_ids)``: refuse another call convention."""
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

    A model with RoPE per layer type (HF's ``config.rope_parameters`` keyed by ``config.layer_types``:
    Gemma 3, Olmo 3, ...) takes the same per-type form: ``{"full_attention": {"rope_type": "linear",
    "factor": 8.0}}`` scales the global layers only (Gemma 3's own long-context recipe), and the types
    not given keep their RoPE. One flat dict on such a model, a per-type dict on a model without layer
    types, or a type the model does not have is refused by name.

    The parameters are checked first (posenc's own RoPE scaling reads them: an unknown ``rope_type``, a
    missing or out-of-range option is a ValueError naming the key), and the new rotary embedding is
    built from a copy of the config: on any error the model and its config are left as they were.
    """
    import copy

    decoder = _llama_decoder(model, "set_rope_scaling")
    if isinstance(decoder.rotary_emb, _NoRotation):
        raise ValueError(
            "set_rope_scaling: this model's encoding was swapped; put the scaling in the posenc spec"
        )
    config = model.config
    merged = _merged_rope_parameters(model, rope_parameters)
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
    device = next((b.device for b in old.buffers()), next(model.parameters()).device)
    decoder.rotary_emb = type(old)(config=config).to(device)
    return model


def rope_layer_types(config: Any) -> list[str] | None:
    """The layer types of a model whose ``rope_parameters`` are given per type (Gemma 3, Olmo 3), in
    order of first appearance; None for a model with one RoPE for every layer."""
    types = list(dict.fromkeys(getattr(config, "layer_types", None) or []))
    params = getattr(config, "rope_parameters", None)
    if not (types and isinstance(params, dict)):
        return None
    # A type may have no RoPE at all (None: Beam's full-attention layers are NoPE).
    keyed = all(t in params and (params[t] is None or isinstance(params[t], dict)) for t in types)
    return types if keyed and any(isinstance(params[t], dict) for t in types) else None


def _merged_rope_parameters(model: nn.Module, rope_parameters: Any) -> dict[str, Any]:
    """The model's new ``rope_parameters``: each given dict over its own ``rope_theta``, per layer
    type where the model has types; checked by posenc's RoPE (a ValueError naming the key)."""
    config, family = model.config, type(model).__name__
    per_type = isinstance(rope_parameters, dict) and bool(rope_parameters)
    per_type = per_type and all(isinstance(v, dict) for v in rope_parameters.values())
    types = rope_layer_types(config)
    own = config.rope_parameters
    if types is None and isinstance(own, dict) and own and all(isinstance(v, dict) for v in own.values()):
        raise ValueError(
            f"set_rope_scaling: {family} keeps RoPE per part ({', '.join(own)}), not per layer type; "
            "posenc cannot rescale it: load the model with the scaling in its config"
        )
    if types is None:
        if per_type:
            raise ValueError(
                f"set_rope_scaling: {family} has one RoPE for every layer (no layer_types with rope_parameters "
                f"per type); give one dict with a rope_type, not one per {', '.join(rope_parameters)}"
            )
        return _checked_rope(model, rope_parameters, config.rope_parameters, "")
    if not per_type:
        raise ValueError(
            f"set_rope_scaling: {family} has RoPE per layer type ({', '.join(types)}); give a dict per type to "
            "scale, e.g. {'full_attention': {'rope_type': 'linear', 'factor': 8.0}} (Gemma 3 scales its global "
            "layers only); the types not given keep their RoPE"
        )
    unknown = [t for t in rope_parameters if t not in types]
    if unknown:
        raise ValueError(
            f"set_rope_scaling: {family} has no layer type {', '.join(map(repr, unknown))}; its types: {', '.join(types)}"
        )
    bare = [t for t in rope_parameters if config.rope_parameters[t] is None]
    if bare:
        raise ValueError(
            f"set_rope_scaling: {family}'s {', '.join(map(repr, bare))} layers have no RoPE to scale (NoPE); "
            f"scale the types with RoPE: {', '.join(t for t in types if t not in bare)}"
        )
    merged = {t: None if own[t] is None else dict(own[t]) for t in types}
    for layer_type, given in rope_parameters.items():
        merged[layer_type] = _checked_rope(
            model, given, config.rope_parameters[layer_type], f"[{layer_type!r}]"
        )
    return merged


#: The rope types whose pretraining length HF fills in from the config when a dict leaves it out.
_PRETRAINING_LENGTH_TYPES = ("llama3", "yarn", "longrope")


def _checked_rope(model: nn.Module, given: Any, own: dict[str, Any], where: str) -> dict[str, Any]:
    """``given`` over the model's own ``rope_theta``, checked by posenc's RoPE (``where``: the layer
    type, in messages)."""
    if not isinstance(given, dict) or "rope_type" not in given:
        raise ValueError(
            f"set_rope_scaling: rope_parameters{where} must be a dict with a rope_type, got {given!r}"
        )
    config = model.config
    merged = {"rope_theta": own.get("rope_theta"), **given}
    if merged["rope_type"] in _PRETRAINING_LENGTH_TYPES and "original_max_position_embeddings" not in merged:
        # HF's standardize_rope_params: the pretraining length defaults to the config's own.
        length = getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings
        merged["original_max_position_embeddings"] = length
    try:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    except Exception:  # per-layer head sizes (Gemma 4): HF's own build below checks the scaling
        return merged
    try:  # posenc's RoPE reads the same dict: its checks name the key at fault
        build(
            "rope",
            head_dim=head_dim,
            rope_parameters=merged,
            max_position_embeddings=getattr(config, "max_position_embeddings", None),
        )
    except (ValueError, TypeError) as err:
        raise ValueError(f"set_rope_scaling{where}: {err}") from err
    return merged
