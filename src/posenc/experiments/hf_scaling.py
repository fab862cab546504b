"""The RoPE variants a pretrained model is evaluated under (``--eval-variants``), its row label and
its results folder's check: what :mod:`.hf_eval`, the context-extension study (:mod:`.hf_study`)
and its plan (:mod:`.study_plan`) share. Imports no sibling module but :mod:`.results`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from ..encodings.rope_scaling import ntk_base
from ..pretrained import MODELS
from .results import experiment_settings, load_config

__all__ = [
    "VARIANTS",
    "apply_scaling",
    "check_hf_folder",
    "model_label",
    "ntk_parameters",
    "parse_variants",
    "rope_parameters_for",
]

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
    """HF ``rope_parameters`` of ``variant`` (``"yarn"`` or ``"yarn:4"``); None for ``"none"`` (as trained)."""
    name, _, factor_text = variant.partition(":")
    if name not in VARIANTS:
        raise ValueError(
            f"--eval-variants {variant!r}: choose from {', '.join(VARIANTS)} (optionally NAME:FACTOR)"
        )
    if name == "none":
        return None
    try:
        factor = float(factor_text) if factor_text else max(1.0, eval_len / train_len)
    except ValueError as err:
        raise ValueError(f"--eval-variants {variant!r}: the factor must be a number") from err
    if not factor >= 1.0:
        raise ValueError(f"--eval-variants {variant!r}: the factor must be >= 1")
    parameters: dict[str, Any] = {"rope_type": name, "factor": factor}
    if name == "yarn":
        parameters["original_max_position_embeddings"] = train_len
    return parameters


def parse_variants(text: str | None) -> list[str]:
    """``"none,yarn:4"`` -> ``["none", "yarn:4"]`` (default: ``["none"]``, the model as trained)."""
    variants = [item.strip() for item in (text or "none").split(",") if item.strip()]
    return variants or ["none"]


def check_hf_folder(out: Path, settings: dict[str, Any]) -> None:
    """Refuse a folder that holds another experiment (a trained one, or another model or setting)."""
    saved = experiment_settings(load_config(out)) if (out / "config.json").exists() else None
    if saved is not None and saved != json.loads(json.dumps(settings)):
        raise ValueError(f"{out} holds another experiment (config.json differs); use another --out folder")


def apply_scaling(model: nn.Module, parameters: dict[str, Any] | None, original: dict[str, Any]) -> None:
    """Set the variant's RoPE scaling (the model's own parameters back for ``none``)."""
    from ..hf import set_rope_scaling

    if parameters is None:
        if original and getattr(model.config, "rope_parameters", None) != original:
            set_rope_scaling(model, dict(original))
        return
    if parameters.get("rope_type") == "ntk":
        parameters = ntk_parameters(model.config, original, parameters["factor"])
    set_rope_scaling(model, {**{k: v for k, v in original.items() if k != "rope_type"}, **parameters})


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
