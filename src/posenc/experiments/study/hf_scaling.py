"""The RoPE variants a pretrained model is evaluated under (``--eval-variants``), its row label and
its results folder's check: what :mod:`.hf_eval`, the context-extension study (:mod:`.hf_study`)
and its plan (:mod:`.study_plan`) share. Imports no sibling module but :mod:`.results`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...encodings.rope_scaling import HF_CARRIED_KEYS, MODEL_KEYS, ntk_base
from ...pretrained.loading import MODELS
from ..results.records import experiment_settings, load_config

__all__ = [
    "GLOBAL_LAYER_TYPES",
    "HF_TASKS",
    "VARIANTS",
    "added_variants",
    "apply_scaling",
    "check_hf_folder",
    "check_positions",
    "kept_model_keys",
    "model_label",
    "ntk_parameters",
    "parse_variants",
    "rope_parameters_for",
    "scaled_layer_types",
]

#: Tasks ``--hf-model`` scores a pretrained model on as the trained experiments score theirs (the
#: context-extension study's tasks are :data:`.study_plan.STUDY_TASKS`).
HF_TASKS = ("lm", "passkey")

#: RoPE scalings ``--eval-variants`` accepts, as HF ``rope_type`` names: ``none`` (as trained),
#: ``linear`` (position interpolation), ``ntk`` (static NTK-aware: HF has no such ``rope_type``, so
#: it is set as ``default`` with the base ``theta * factor ** (d / (d - 2))``, ``d`` the rotary
#: dimension), ``dynamic`` (dynamic NTK), ``yarn``.
VARIANTS = ("none", "linear", "ntk", "dynamic", "yarn")


def model_label(model: str | Path) -> str:
    """The records' name of ``--hf-model``: a fetched model's name as it is, else the file's or
    folder's own name (``.gguf`` dropped)."""
    return str(model) if str(model) in MODELS else Path(model).resolve().name.removesuffix(".gguf")


def rope_parameters_for(variant: str, train_len: int, eval_len: int) -> dict[str, Any] | None:
    """HF ``rope_parameters`` of ``variant`` (``"yarn"`` or ``"yarn:4"``); None for ``"none"`` (as trained).

    The factor is the one given, else ``eval_len / train_len``; either must be a finite number
    ``>= 1``. A default factor that would not stretch the context (``eval_len <= train_len``) is a
    ``ValueError`` naming ``--eval-len`` and the context, never quietly raised to 1."""
    name, _, factor_text = variant.partition(":")
    _check_name(variant, name)
    if name == "none":
        return None
    if isinstance(train_len, bool) or not isinstance(train_len, int) or train_len < 1:
        raise ValueError(
            f"--eval-variants {variant!r}: the model's context (max_position_embeddings) must be a positive "
            f"int to scale from, got {train_len!r}"
        )
    if factor_text:
        factor = _given_factor(variant, factor_text)
    elif eval_len > train_len:
        factor = eval_len / train_len
    else:
        raise ValueError(
            f"--eval-variants {variant!r}: the default factor is --eval-len / context = {eval_len}/{train_len}, "
            f"which does not stretch the model's context {train_len}: give an --eval-len above {train_len}, "
            f"or the factor ({name}:2)"
        )
    parameters: dict[str, Any] = {"rope_type": name, "factor": factor}
    if name == "yarn":
        parameters["original_max_position_embeddings"] = train_len
    return parameters


def _check_name(variant: str, name: str) -> None:
    if name not in VARIANTS:
        raise ValueError(
            f"--eval-variants {variant!r}: choose from {', '.join(VARIANTS)} (optionally NAME:FACTOR)"
        )


def _given_factor(variant: str, text: str) -> float:
    """The factor written in ``variant``: a finite number ``>= 1`` (``inf``, ``1e309``, ``nan`` refused)."""
    try:
        factor = float(text)
    except ValueError as err:
        raise ValueError(f"--eval-variants {variant!r}: the factor must be a number") from err
    if not (math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"--eval-variants {variant!r}: the factor must be >= 1 and finite")
    return factor


def parse_variants(text: str | None) -> list[str]:
    """``"none,yarn:4"`` -> ``["none", "yarn:4"]`` (default: ``["none"]``, the model as trained).

    Each item's name and written factor(s) are checked here, when the command starts (a sweep
    ``yarn:2/4`` has each of its factors checked): ``ValueError`` naming ``--eval-variants``."""
    variants = [item.strip() for item in (text or "none").split(",") if item.strip()]
    for variant in variants:
        name, sep, factors = variant.partition(":")
        _check_name(variant, name)
        if sep and name == "none":
            raise ValueError(f"--eval-variants {variant!r}: none takes no factor; write none")
        for factor in factors.split("/") if sep else []:
            _given_factor(f"{name}:{factor.strip()}", factor.strip())
    return variants or ["none"]


#: The settings a study's variants fill: a later command may add variants to them, nothing else.
_VARIANT_KEYS = ("encodings", "variants", "variant_names", "sweeps")


def check_hf_folder(out: Path, settings: dict[str, Any]) -> list[str]:
    """Refuse a folder that holds another experiment (a trained one, or another model or setting).

    A study's folder also takes the same study with variants added (every setting equal, every saved
    variant kept with its parameters, new ones after them): its windows, prompts and seed are the
    same, so the new rows pair with the finished ones. Returns the added variants' labels (empty
    when the settings are equal)."""
    saved = experiment_settings(load_config(out)) if (out / "config.json").exists() else None
    wanted = json.loads(json.dumps(settings))
    if saved is None or saved == wanted:
        return []
    added = added_variants(saved, wanted)
    if added is None:
        raise ValueError(
            f"{out} holds another experiment (config.json differs); use another --out folder (a study's "
            "folder takes the same command with variants added after its own, nothing else changed)"
        )
    return added


def added_variants(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str] | None:
    """The labels ``wanted`` adds to the study ``saved``, or None when it changes anything else: a
    setting outside the variants, a saved variant's parameters or name, or the saved order."""
    if not saved.get("study") or any(
        saved.get(k) != wanted.get(k) for k in set(saved) | set(wanted) if k not in _VARIANT_KEYS
    ):
        return None
    old, new = list(saved.get("encodings") or []), list(wanted.get("encodings") or [])
    if new[: len(old)] != old or len(new) == len(old):
        return None
    for key in ("variants", "variant_names", "sweeps"):
        before, after = saved.get(key) or {}, wanted.get(key) or {}
        if any(k not in after or after[k] != v for k, v in before.items()):
            return None
    return new[len(old) :]


def apply_scaling(model: nn.Module, parameters: dict[str, Any] | None, original: dict[str, Any]) -> None:
    """Set the variant's RoPE scaling (the model's own parameters back for ``none``).

    A variant replaces the model's own scaling: of ``original`` it keeps only what is no scaling
    option (:func:`kept_model_keys`: the base, the rotary width, M-RoPE's bands), so a ``linear``
    variant of Llama 3.1 scales its raw frequencies, not with llama3's band options attached (which
    ``linear`` does not read and RoPE scaling refuses).
    """
    from ...hf import rope_layer_types, set_rope_scaling

    if rope_layer_types(model.config) is not None:
        _apply_per_layer_type(model, parameters, original)
        return
    if parameters is None:
        if original and getattr(model.config, "rope_parameters", None) != original:
            set_rope_scaling(model, dict(original))
        return
    if parameters.get("rope_type") == "ntk":
        parameters = ntk_parameters(model.config, original, parameters["factor"])
    set_rope_scaling(model, {**kept_model_keys(original), **parameters})


#: The layer types a scaling rescales on a model with RoPE per layer type: its full-attention (global)
#: layers, as Gemma 3 (linear x8) and Olmo 3 (YaRN) extend theirs. A sliding-window layer keeps its
#: RoPE: it never sees a distance past its window, which lies inside the trained context.
GLOBAL_LAYER_TYPES = ("full_attention",)


def scaled_layer_types(config: Any, where: str) -> list[str] | None:
    """The layer types a scaling variant rescales on the model of HF ``config``: None for a model with
    one RoPE for every layer (all of it), else its :data:`GLOBAL_LAYER_TYPES` that have RoPE;
    ``ValueError`` naming ``where`` and the family when it has none."""
    from ...hf import rope_layer_types

    types = rope_layer_types(config)
    if types is None:
        return None
    scaled = [t for t in types if t in GLOBAL_LAYER_TYPES and config.rope_parameters[t] is not None]
    if not scaled:
        raise ValueError(
            f"{where}: {type(config).__name__} has RoPE per layer type ({', '.join(types)}) but no full-attention "
            "layers with RoPE to scale; a scaling cannot be applied to it"
        )
    return scaled


def _apply_per_layer_type(
    model: nn.Module, parameters: dict[str, Any] | None, original: dict[str, Any]
) -> None:
    """:func:`apply_scaling` on a model with RoPE per layer type: the scaling on its full-attention
    layers only (:func:`scaled_layer_types`), each over its own base; every type's own back for ``none``."""
    from ...hf import set_rope_scaling

    if parameters is None:
        if model.config.rope_parameters != original:
            set_rope_scaling(model, {t: dict(p) for t, p in original.items() if p is not None})
        return
    entry = {}
    for layer_type in scaled_layer_types(model.config, "--eval-variants") or []:
        own = original[layer_type]
        given = parameters
        if parameters.get("rope_type") == "ntk":
            given = ntk_parameters(model.config, own, parameters["factor"])
        entry[layer_type] = {**kept_model_keys(own), **given}
    set_rope_scaling(model, entry)


def kept_model_keys(original: dict[str, Any]) -> dict[str, Any]:
    """The entries of a model's ``rope_parameters`` that are not its scaling: ``rope_theta``,
    ``partial_rotary_factor``, ``head_dim``, ... (``MODEL_KEYS`` but the type's name) and the keys HF
    carries for other parts of the model (``HF_CARRIED_KEYS``: ``mrope_section``, ...)."""
    kept = (set(MODEL_KEYS) - {"rope_type", "type"}) | HF_CARRIED_KEYS
    return {k: v for k, v in original.items() if k in kept}


def ntk_parameters(config: Any, original: dict[str, Any], factor: float) -> dict[str, Any]:
    """Static NTK-aware scaling as HF ``rope_parameters``: ``default`` with the base
    ``theta * factor ** (d / (d - 2))``, ``d`` the rotary dimension (posenc's ``ntk`` scaling)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = original.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    scaling = {"rope_theta": original["rope_theta"], "factor": float(factor), "head_dim": head_dim}
    try:
        theta = ntk_base({**scaling, "partial_rotary_factor": partial})
    except ValueError as err:
        raise ValueError(f"--eval-variants ntk: {err}") from err
    return {"rope_type": "default", "rope_theta": theta}


def check_positions(model: nn.Module, eval_len: int, where: str | Path) -> None:
    """Refuse a model that cannot take position ``eval_len`` (1-based), before any unit runs.

    One token at position ``eval_len - 1``, run where the model is (on the CPU it loaded on: an
    out-of-range index on a GPU would be a device-side assert): a model whose learned position table
    (GPT-2's ``wpe``) ends before ``eval_len`` fails here in a moment instead of at the first long unit.
    """
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    try:
        with torch.no_grad():
            model(
                input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                position_ids=torch.tensor([[eval_len - 1]], device=device),
            )
    except (IndexError, RuntimeError) as err:
        context = getattr(model.config, "max_position_embeddings", None)
        raise ValueError(
            f"--hf-model {where}: {type(model).__name__} cannot take position {eval_len} of --eval-len "
            f"{eval_len} ({type(err).__name__}: {err}); its learned positions end at max_position_embeddings "
            f"{context}: give --eval-len {context} or less"
        ) from err
