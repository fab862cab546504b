"""Swap a Llama-family model's rotary embedding for posenc encodings; change its RoPE scaling in place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ..encodings.base import Kind, LayerContext
from ..encodings.registry import build, build_for_layer
from ..encodings.rope import RoPE, check_pairing
from ..seams import SEAMS, parameter_names
from ._attention import register
from ._common import BACKEND
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


def _decoder(model: nn.Module) -> nn.Module:
    """The module holding ``rotary_emb`` and ``layers`` (``model.model`` for a ``...ForCausalLM``)."""
    for candidate in (model, getattr(model, "model", None)):
        has_parts = (
            candidate is not None and hasattr(candidate, "rotary_emb") and hasattr(candidate, "layers")
        )
        if has_parts and all(hasattr(layer, "self_attn") for layer in candidate.layers):
            return candidate
    tables = _absolute_tables(model)
    why = (
        f": it has no rotary embedding to replace; its positions are absolute tables added to the input "
        f"embeddings ({', '.join(tables)}), which an attention implementation cannot take out, so a posenc "
        "encoding in its attention would add a second position signal (to run its attention through posenc, "
        "use attn_implementation='posenc' after posenc.hf.register())"
        if tables
        else ""
    )
    raise ValueError(
        f"swap_encoding: {type(model).__name__} is not a Llama-family decoder (one rotary_emb and layers "
        f"with self_attn){why}; supported: Llama, Mistral, Qwen2, Qwen3 and models built the same way"
    )


#: The names HF models give their absolute position tables (Whisper, BART, OPT; GPT-2; BERT).
_TABLE_NAMES = ("embed_positions", "wpe", "position_embeddings")


def _absolute_tables(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s absolute position tables (embeddings added to the input)."""
    return [
        name
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in _TABLE_NAMES and isinstance(module, nn.Embedding)
    ]


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
            layer.self_attn.register_forward_pre_hook(remember_cache, with_kwargs=True)
            layer.self_attn._posenc_cache_hook = True
    decoder.rotary_emb = _NoRotation(head_dim)
    model.set_attn_implementation(register(BACKEND["name"]))
    return model


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
    attentions = [layer.self_attn for layer in _decoder(model).layers]
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
