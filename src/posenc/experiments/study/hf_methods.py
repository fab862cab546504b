"""The piecewise-RoPE methods ``--eval-variants`` applies to a pretrained model beside the RoPE
scalings: ``self_extend``, ``rerope``, ``leaky_rerope`` and ``dca`` (posenc's exact encodings of the
same names, :mod:`posenc.encodings.self_extend`, :mod:`~posenc.encodings.rerope`,
:mod:`~posenc.encodings.dca`), swapped into the model with :func:`posenc.hf.swap_encoding`.

An item is ``NAME`` (every option derived from the model's context ``c`` and ``--eval-len`` ``E``)
or ``NAME:OPTION=VALUE,OPTION=VALUE`` (``self_extend:group_size=4,neighbor_window=512``; the
options not given are still derived). The defaults, as the papers advise:

==================  ======================================================================
method              defaults
==================  ======================================================================
``self_extend``     ``neighbor_window = c/4`` (Jin et al. 2024 use 512-1024 on 4k models)
                    and the smallest ``group_size G`` whose reach ``(c - w_n)·G + w_n``
                    covers ``E``
``rerope``          ``window = c/2`` (every rectified pair sits at a trained distance)
``leaky_rerope``    ``window = c/2`` and the smallest whole ``leaky_factor k`` that keeps
                    the largest relative position ``w + (E - w)/k`` at most ``c``
``dca``             ChunkLlama's ``chunk_size = 3c/4`` and ``local_size = c/8``
``dpe``             ``window = c/8`` (the reference's 1024 on 8k Llama 3) and one factor per
                    group of 8 (or fewer) equal groups of pairs, from YaRN's ramp over the
                    group's slowest pair (:func:`dpe_factors`): 1 where it turns at least 32
                    times in the context, Self-Extend's ``G`` where it turns at most once,
                    rounded up in between; ``factors=A/B/...`` gives them
==================  ======================================================================

Every method keeps the model's own RoPE (``rope_parameters``: its base, rotary width and fixed
scaling, e.g. Llama 3.1's ``llama3``); ``scaling=linear|ntk|yarn`` (with ``factor=F``, default
``E / c``) replaces that scaling inside the method. The piecewise families re-rotate keys at their
own positions, so a length-dependent scaling (``dynamic``, ``longrope``: the given one or the
model's own) is refused. Everything is checked from the model's config, before any weight loads
(:func:`method_parameters`), each error naming ``--eval-variants``, the item and the option.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ...encodings.registry import build
from ...encodings.rope import rope_inv_freq
from ...encodings.rope_scaling import LENGTH_DEPENDENT
from .hf_scaling import VARIANTS as SCALINGS
from .hf_scaling import (
    apply_scaling,
    kept_model_keys,
    ntk_parameters,
    rope_parameters_for,
    scaled_layer_types,
)
from .hf_scaling import parse_variants as parse_scalings
from .sweep import expand_grid

__all__ = [
    "METHODS",
    "Method",
    "apply_variant",
    "default_options",
    "dpe_factors",
    "method_parameters",
    "parse_method",
    "parse_variants",
    "restore_rotary",
    "variant_parameters",
]

#: The options of an item that choose the method's RoPE scaling, not the method's own.
_SCALING_OPTIONS = {"scaling": str, "factor": float}


def _self_extend(context: int, eval_len: int, given: dict[str, Any], wavelengths=()) -> dict[str, Any]:
    window = given.get("neighbor_window", context // 4)
    if "group_size" in given:
        return {"neighbor_window": window}
    if window >= context:
        raise ValueError(
            f"neighbor_window={window} is not below the model's context {context}, so no group_size "
            "reaches further; give a smaller neighbor_window or the group_size"
        )
    return {
        "neighbor_window": window,
        "group_size": max(1, math.ceil((eval_len - window) / (context - window))),
    }


def _rerope(context: int, eval_len: int, given: dict[str, Any], wavelengths=()) -> dict[str, Any]:
    return {"window": given.get("window", context // 2)}


def _leaky_rerope(context: int, eval_len: int, given: dict[str, Any], wavelengths=()) -> dict[str, Any]:
    window = given.get("window", context // 2)
    if "leaky_factor" in given:
        return {"window": window}
    if window >= context:
        raise ValueError(
            f"window={window} is not below the model's context {context}, so no leaky_factor keeps the "
            "relative positions inside it; give a smaller window or the leaky_factor"
        )
    return {"window": window, "leaky_factor": max(1, math.ceil((eval_len - window) / (context - window)))}


def _string_shift(context: int, eval_len: int, given: dict[str, Any], wavelengths=()) -> dict[str, Any]:
    window = given.get("window", min(128, context // 8))
    # the reference's 0.33 of the length, or more: the largest relative position E - 1 - S + W
    # stays inside the context
    shift = given.get("shift", max(int(0.33 * eval_len), eval_len - context + window))
    if shift == window:
        raise ValueError(f"shift={shift} equals window: every pair keeps RoPE's positions (plain RoPE)")
    return {"window": window, "shift": shift}


def _dca(context: int, eval_len: int, given: dict[str, Any], wavelengths=()) -> dict[str, Any]:
    return {
        "chunk_size": given.get("chunk_size", 3 * context // 4),
        "local_size": given.get("local_size", context // 8),
    }


def _reach_factor(context: int, eval_len: int, window: int, what: str) -> int:
    """Self-Extend's smallest group size whose reach ``(c - w)·G + w`` covers ``eval_len``."""
    if window >= context:
        raise ValueError(
            f"{what}={window} is not below the model's context {context}, so no factor reaches further; "
            f"give a smaller {what}"
        )
    return max(1, math.ceil((eval_len - window) / (context - window)))


def dpe_factors(wavelengths: Sequence[float], context: int, reach: int, groups: int = 8) -> list[int]:
    """DPE's factors without the reference's per-group needle test: the rotary pairs (``wavelengths``,
    fastest first) split into ``groups`` equal groups (fewer when ``groups`` does not divide them: the
    largest count that does), and each group's factor read off YaRN's ramp at its slowest pair, whose
    turns in the context are ``r = c / λ``: ``1`` (extrapolated, every phase trained) where
    ``r >= 32``, ``reach`` (interpolated as Self-Extend) where ``r <= 1``, and
    ``ceil(1 + (reach - 1)(32 - r) / 31)`` between (YaRN's ``β = 32``, ``α = 1``)."""
    pairs = len(wavelengths)
    count = max(g for g in range(1, min(groups, pairs) + 1) if pairs % g == 0)
    size = pairs // count
    factors = []
    for g in range(count):
        turns = context / max(wavelengths[g * size : (g + 1) * size])
        ramp = min(1.0, max(0.0, (32 - turns) / 31))
        factors.append(math.ceil(1 + (reach - 1) * ramp - 1e-9))
    return factors


def _dpe(context: int, eval_len: int, given: dict[str, Any], wavelengths=()) -> dict[str, Any]:
    window = given.get("window", context // 8)
    if "factors" in given:
        factors = given["factors"]
    else:
        factors = dpe_factors(wavelengths, context, _reach_factor(context, eval_len, window, "window"))
    if all(f == 1 for f in factors):
        how = "" if "factors" in given else " (derived: --eval-len is within the model's context)"
        raise ValueError(
            f"factors={factors} moves no position, so dpe is plain RoPE{how}; give a factor above 1"
        )
    return {"window": window, "factors": factors}


def _factor_list(text: str) -> list[int]:
    """``"2/8/2/8"`` -> ``[2, 8, 2, 8]`` (a study item separates a list's values by ``/``: ``|`` is a grid)."""
    return [int(part) for part in text.split("/")]


@dataclass(frozen=True)
class Method:
    """One piecewise-RoPE method of ``--eval-variants``: its posenc encoding, its options (name ->
    type), the options derived when not given (``derive(c, E, given)``), the options that must stay
    below ``--eval-len`` (else the method is plain RoPE over the whole window), and its defaults in words."""

    encoding: str
    options: dict[str, type]
    derive: Callable[[int, int, dict[str, Any]], dict[str, Any]]
    below_eval_len: tuple[str, ...]
    defaults: str
    #: Option values at which the method changes no position (plain RoPE): refused by name.
    plain_at: dict[str, float] = field(default_factory=dict)
    #: Its derivation reads the wavelengths of the model's RoPE pairs (worked out only then).
    reads_wavelengths: bool = False


#: Every method ``--eval-variants`` takes beside the scalings, by name.
METHODS: dict[str, Method] = {
    "self_extend": Method(
        "self_extend",
        {"group_size": int, "neighbor_window": int, "log_scale_length": int},
        _self_extend,
        ("neighbor_window",),
        "neighbor_window c/4, group_size the smallest G with (c - w_n)G + w_n >= E",
        {"group_size": 1},
    ),
    "rerope": Method("rerope", {"window": int, "log_scale_length": int}, _rerope, ("window",), "window c/2"),
    "leaky_rerope": Method(
        "leaky_rerope",
        {"window": int, "leaky_factor": float, "log_scale_length": int},
        _leaky_rerope,
        ("window",),
        "window c/2, leaky_factor the smallest whole k with w + (E - w)/k <= c",
        {"leaky_factor": 1.0},
    ),
    "string_shift": Method(
        "string_shift",
        {"shift": int, "window": int, "log_scale_length": int},
        _string_shift,
        ("shift",),
        "window min(128, c/8), shift max(0.33 E, E - c + window)",
    ),
    "dpe": Method(
        "dpe",
        {"window": int, "factors": _factor_list},
        _dpe,
        ("window",),
        "window c/8, factors from YaRN's ramp over each group's slowest pair (1 to Self-Extend's G)",
        reads_wavelengths=True,
    ),
    "dca": Method(
        "dca",
        {"chunk_size": int, "local_size": int},
        _dca,
        ("chunk_size",),
        "chunk_size 3c/4, local_size c/8",
    ),
}


def parse_method(item: str) -> tuple[str, dict[str, Any]]:
    """``"self_extend:group_size=4,neighbor_window=512"`` -> ``("self_extend", {...})``: the options
    given, typed; ``ValueError`` naming ``--eval-variants``, the item and the option at fault."""
    name, sep, rest = item.partition(":")
    method = METHODS[name]
    given: dict[str, Any] = {}
    for part in (p.strip() for p in rest.split(",")) if sep else []:
        key, eq, text = part.partition("=")
        kinds = {**method.options, **_SCALING_OPTIONS}
        if not eq or key not in kinds:
            raise ValueError(
                f"--eval-variants {item!r}: {part!r} is no option of {name}; write OPTION=VALUE with "
                f"OPTION one of {', '.join(kinds)}"
            )
        if key in given:
            raise ValueError(f"--eval-variants {item!r}: {key} is given twice")
        given[key] = _typed(item, key, text.strip(), kinds[key])
    return name, given


def _typed(item: str, key: str, text: str, kind: type) -> Any:
    """``text`` as ``kind``: an int (``512``), a finite float or a name; ``ValueError`` naming ``key``."""
    try:
        value = kind(text)
    except ValueError as err:
        what = {int: "a whole number", float: "a number", _factor_list: "whole numbers joined by /"}.get(
            kind, "a name"
        )
        raise ValueError(f"--eval-variants {item!r}: {key} must be {what}, got {text!r}") from err
    if kind is float and not math.isfinite(value):
        raise ValueError(f"--eval-variants {item!r}: {key} must be finite, got {text!r}")
    return value


def default_options(
    name: str, context: int, eval_len: int, given: dict[str, Any], wavelengths: Sequence[float] = ()
) -> dict[str, Any]:
    """The method's options (scaling options left out): those ``given``, the rest derived from the
    model's ``context`` and ``eval_len`` and, for ``dpe``, the ``wavelengths`` ``2π / θ_i`` of the
    method's RoPE pairs, fastest first (:data:`METHODS`' ``derive``)."""
    own = {k: v for k, v in given.items() if k not in _SCALING_OPTIONS}
    return {**METHODS[name].derive(context, eval_len, own, wavelengths), **own}


def method_parameters(item: str, config: Any, context: int, eval_len: int) -> dict[str, Any]:
    """The settings entry of method ``item`` on the model of HF ``config``: ``{"method", "encoding",
    "options", "rope_parameters"}``, checked (the encoding is built once, without weights); every
    refusal a ``ValueError`` naming ``--eval-variants``, the item and the option."""
    name, given = parse_method(item)
    original = dict(getattr(config, "rope_parameters", None) or {})
    scaled = scaled_layer_types(config, f"--eval-variants {item!r}")
    per_type = original
    if scaled is not None:  # a hybrid model: the method on its full-attention layers, over their RoPE
        original = dict(per_type[scaled[0]])
    if not original:
        raise ValueError(
            f"--eval-variants {item!r}: {type(config).__name__} has no RoPE (rope_parameters) for {name} to "
            "replace; the piecewise-RoPE methods apply to RoPE models only"
        )
    _check_below(item, name, given, eval_len)  # the given options first: the derivation reads them
    rope = _method_rope(item, name, given, original, config, context, eval_len)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    try:
        wavelengths = _wavelengths(head_dim, rope) if METHODS[name].reads_wavelengths else ()
        options = default_options(name, context, eval_len, given, wavelengths)
    except ValueError as err:
        raise ValueError(f"--eval-variants {item!r}: {err}") from None
    _check_below(item, name, options, eval_len)
    _check_not_plain(item, name, options, given)
    try:
        build(METHODS[name].encoding, head_dim=head_dim, rope_parameters=dict(rope), **options)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--eval-variants {item!r}: {err}") from None
    entry = {"method": name, "encoding": METHODS[name].encoding, "options": options, "rope_parameters": rope}
    if scaled is not None:
        # The window layers keep their own RoPE (a window never reaches past the trained context).
        entry["layer_types"] = list(config.layer_types)
        entry["kept_rope"] = {
            t: p for t, p in per_type.items() if t not in scaled and t in config.layer_types
        }
    return entry


def _wavelengths(head_dim: int, rope: dict[str, Any]) -> list[float]:
    """``2π / θ_i`` of each rotary pair of the method's RoPE (``rope_parameters`` on ``head_dim``)."""
    inv_freq, _ = rope_inv_freq(head_dim, float(rope.get("rope_theta", 10000.0)), scaling=dict(rope))
    return [2 * math.pi / float(f) for f in inv_freq]


def _check_below(item: str, name: str, options: dict[str, Any], eval_len: int) -> None:
    """Refuse a window or chunk at or beyond ``--eval-len`` (the method would be plain RoPE)."""
    for key in METHODS[name].below_eval_len:
        if key in options and options[key] >= eval_len:
            raise ValueError(
                f"--eval-variants {item!r}: {key}={options[key]} is not below --eval-len {eval_len}, so {name} "
                f"is plain RoPE over every window; give a {key} below {eval_len}"
            )


def _check_not_plain(item: str, name: str, options: dict[str, Any], given: dict[str, Any]) -> None:
    """Refuse a setting at which the method moves no position (``group_size=1``, ``leaky_factor=1``):
    its row would be the model's own under the method's name."""
    for key, plain in METHODS[name].plain_at.items():
        if key in options and options[key] == plain:  # below it: the encoding's own range check names it
            how = (
                ""
                if key in given
                else " (derived: --eval-len is within the model's context; give a longer one)"
            )
            raise ValueError(
                f"--eval-variants {item!r}: {key}={options[key]:g} moves no position, so {name} is plain RoPE"
                f"{how}; give a {key} above {plain:g}"
            )


def _method_rope(
    item: str,
    name: str,
    given: dict[str, Any],
    original: dict[str, Any],
    config: Any,
    context: int,
    eval_len: int,
) -> dict[str, Any]:
    """The ``rope_parameters`` the method's RoPE takes: the model's own, or its base with the item's
    ``scaling`` (and ``factor``); a length-dependent one refused, naming where it comes from."""
    scaling = given.get("scaling")
    if scaling is None:
        if "factor" in given:
            raise ValueError(f"--eval-variants {item!r}: factor needs scaling=linear|ntk|yarn")
        own = original.get("rope_type", original.get("type", "default"))
        if own in LENGTH_DEPENDENT:
            raise ValueError(
                f"--eval-variants {item!r}: the model's own rope_type {own!r} changes its frequencies with "
                f"the sequence length, which {name} cannot follow; give a fixed scaling ({name}:scaling=yarn)"
            )
        return original
    if scaling in LENGTH_DEPENDENT or scaling not in SCALINGS or scaling == "none":
        fixed = [s for s in SCALINGS if s not in LENGTH_DEPENDENT and s != "none"]
        raise ValueError(
            f"--eval-variants {item!r}: scaling={scaling} cannot compose with {name} (it re-rotates keys at "
            f"its own positions; a length-dependent scaling does not follow them); choose scaling from "
            f"{', '.join(fixed)}"
        )
    text = scaling if "factor" not in given else f"{scaling}:{given['factor']}"
    try:
        parameters = rope_parameters_for(text, context, eval_len)
    except ValueError as err:
        raise ValueError(f"--eval-variants {item!r}: scaling: {err}") from None
    assert parameters is not None
    if parameters["rope_type"] == "ntk":
        parameters = ntk_parameters(config, original, parameters["factor"])
    return {**kept_model_keys(original), **parameters}


def variant_parameters(item: str, config: Any, context: int, eval_len: int) -> dict[str, Any] | None:
    """The settings entry of one ``--eval-variants`` item: a method's (:func:`method_parameters`) or a
    scaling's HF ``rope_parameters`` (None for ``none``)."""
    name = item.partition(":")[0]
    if name in METHODS:
        return method_parameters(item, config, context, eval_len)
    return rope_parameters_for(item, context, eval_len)


def parse_variants(text: str | None) -> list[str]:
    """``"none,yarn:4,self_extend:group_size=4,neighbor_window=512"`` -> its items: a comma-separated
    ``OPTION=VALUE`` continues the method item before it; a grid item (``|`` between values,
    :func:`.sweep.expand_grid`) stays one item, each of its settings checked. Scalings are checked as
    :func:`.hf_scaling.parse_variants` checks them, methods' options by :func:`parse_method`."""
    items: list[str] = []
    for token in (t.strip() for t in (text or "none").split(",")):
        name = token.partition(":")[0]
        if token and "=" in token and name not in METHODS and name not in SCALINGS:
            if not items or items[-1].partition(":")[0] not in METHODS:
                raise ValueError(
                    f"--eval-variants {token!r}: OPTION=VALUE belongs to a method item "
                    f"({', '.join(METHODS)}), e.g. self_extend:group_size=4,neighbor_window=512"
                )
            items[-1] += ("," if ":" in items[-1] else ":") + token
        elif token:
            items.append(token)
    for setting in (s for item in items for s in expand_grid(item)):  # a grid's every setting
        name = setting.partition(":")[0]
        if name not in METHODS and name not in SCALINGS:
            raise ValueError(
                f"--eval-variants {setting!r}: choose from the scalings {', '.join(SCALINGS)} (NAME:FACTOR) and the "
                f"methods {', '.join(METHODS)} (NAME:OPTION=VALUE,...)"
            )
        if name in METHODS:
            parse_method(setting)
        else:
            parse_scalings(setting)
    return items or ["none"]


# ---------------------------------------------------------------------------- the model


def _decoder(model: nn.Module) -> nn.Module:
    return model.model if hasattr(getattr(model, "model", None), "rotary_emb") else model


def apply_method(model: nn.Module, entry: dict[str, Any]) -> None:
    """Swap method ``entry`` (:func:`method_parameters`) into ``model`` with
    :func:`posenc.hf.swap_encoding`, one encoding per layer (on a hybrid model, the method on the
    full-attention layers and each window layer's own RoPE on the others); the model's own rotary
    embedding and attention implementation are kept, so :func:`restore_rotary` undoes it."""
    from ...hf import swap_encoding

    decoder = _decoder(model)
    if "_posenc_study_rotary" not in model.__dict__:
        model.__dict__["_posenc_study_rotary"] = (decoder.rotary_emb, model.config._attn_implementation)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kept, types = entry.get("kept_rope") or {}, entry.get("layer_types") or [None] * len(decoder.layers)
    encodings = [
        _kept_encoding(kept[layer_type], head_dim)
        if layer_type in kept
        else build(
            entry["encoding"],
            head_dim=head_dim,
            rope_parameters=dict(entry["rope_parameters"]),
            **entry["options"],
        )
        for layer_type in types
    ]
    swap_encoding(model, encodings)  # type: ignore[arg-type]


def _kept_encoding(rope_parameters: dict[str, Any] | None, head_dim: int) -> Any:
    """A window layer's own position encoding on a hybrid model: its RoPE as HF defines it (NoPE
    where its type has none)."""
    if rope_parameters is None:
        return build("nope")
    return build("rope", head_dim=head_dim, rope_parameters=dict(rope_parameters))


def restore_rotary(model: nn.Module) -> None:
    """Undo :func:`apply_method`: the model's rotary embedding and attention implementation back, the
    layers' posenc encodings dropped (a model never swapped is left alone)."""
    saved = model.__dict__.pop("_posenc_study_rotary", None)
    if saved is None:
        return
    decoder = _decoder(model)
    decoder.rotary_emb, implementation = saved
    for layer in decoder.layers:
        layer.self_attn._modules.pop("posenc_encoding", None)
    model.set_attn_implementation(implementation)


def apply_variant(model: nn.Module, entry: dict[str, Any] | None, original: dict[str, Any]) -> None:
    """Put ``model`` under one variant's settings entry: a method swapped in, else the model's own
    rotary embedding back and the scaling ``entry`` set (:func:`.hf_scaling.apply_scaling`)."""
    if entry is not None and "method" in entry:
        restore_rotary(model)
        apply_method(model, entry)
        return
    restore_rotary(model)
    apply_scaling(model, entry, original)
