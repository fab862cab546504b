"""Inference-time variants: evaluate a trained checkpoint again under other settings, no retraining.

``posenc extrapolate --eval-variants yarn,temperature`` evaluates every trained run once more per
variant, on the same examples, and writes the records under their own row label
``"<encoding> + <variant>"`` (with ``variant`` and ``trained_encoding`` fields), so the table, the
plot and the report show each variant as its own row. A variant is ``NAME`` or ``NAME:VALUE``:

=================  ==========================================================  =================
name               what changes at evaluation                                   VALUE (default)
=================  ==========================================================  =================
``none``           nothing: the trained row itself (no extra row)               -
``linear``         RoPE position interpolation, ``θ / s``                       ``s`` (E / T)
``ntk``            RoPE static NTK-aware base                                   ``s`` (E / T)
``dynamic``        RoPE dynamic NTK (unchanged up to ``T`` positions)           ``s`` (E / T)
``yarn``           RoPE YaRN (NTK-by-parts and attention scale)                 ``s`` (E / T)
``longrope``       RoPE LongRoPE with uniform factors (short 1, long ``s``)     ``s`` (E / T)
``prope``          p-RoPE: only the fastest fraction ``p`` of pairs rotates     ``p`` (0.75)
``drop_rotation``  no rotation at all (RoPE weights evaluated as NoPE)          -
``temperature``    log-length query temperature on every layer:                 ``β`` (0.1)
                   ``q · (1 + β · ln(1 + floor(i / T)))`` at position ``i``
=================  ==========================================================  =================

``T`` is the longest training sequence in tokens (``task.sequence_length(train_len)``) and ``E`` the
longest evaluated one, so the default factor stretches the trained positions over the evaluated
ones. The RoPE variants set the scaling options of every layer whose encoding takes them (the
registry's typed options decide, so M-RoPE takes them too) and replace any scaling it was trained
with; the temperature is posenc's :class:`~posenc.layers.temperature.QueryTemperature` (Llama 4's form, with
``floor_scale = T``), so it leaves every position below ``T`` unchanged and applies to any encoding.
A variant that applies to none of an encoding's layers is refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..encodings.registry import options as registry_options
from ..encodings.spec import LAYER_SEPARATOR, format_spec, parse_spec, split_layers
from ..layers.attention import MultiheadAttention
from ..layers.patterns import QueryTemperature, is_layer_preset
from .results.records import iid_record
from .tasks.catalog import Task
from .train import RunSpec, build_model, evaluate, load_checkpoint, run_id_for
from .variant_specs import (  # the specs and row labels, re-exported: the public names of variants
    VARIANTS,
    Variant,
    VariantContext,
    parse_eval_variants,
    row_labels,
)

__all__ = [
    "VARIANTS",
    "Variant",
    "build_variant_model",
    "check_variants",
    "evaluate_variant",
    "parse_eval_variants",
    "row_labels",
    "variant_encoding",
    "variant_run_id",
    "variant_runs",
]


def variant_context(config: Any, task: Task) -> VariantContext:
    return VariantContext(
        train_tokens=task.sequence_length(config.train_len),
        eval_tokens=task.sequence_length(config.eval_len),
        head_dim=config.d_model // config.num_heads,
    )


def _layer_specs(encoding: str) -> list[str] | None:
    """The per-layer specs of an experiment encoding, or None for a layer preset (``gemma3``)."""
    if is_layer_preset(encoding):
        return None
    return split_layers(encoding)


def _takes(layer: str, options: dict[str, Any]) -> bool:
    """Whether the encoding of spec ``layer`` has every option in ``options`` (its typed ``__init__``)."""
    name, _ = parse_spec(layer)
    return set(options) <= set(registry_options(name))


def variant_encoding(encoding: str, variant: Variant, ctx: VariantContext) -> str:
    """The encoding string of ``encoding`` under ``variant``'s spec options: every layer that takes
    them gets them (replacing the options the variant replaces); ``ValueError`` naming the encoding
    and the variant when no layer does."""
    kind = variant.kind
    if kind.options is None:
        return encoding
    wanted = kind.options(ctx, variant.resolved_value(ctx))
    layers = _layer_specs(encoding)
    if layers is None or not any(_takes(layer, wanted) for layer in layers):
        what = "a layer preset" if layers is None else "none of its layers takes " + ", ".join(sorted(wanted))
        raise ValueError(
            f"--eval-variants {variant.text!r} does not apply to --encodings {encoding!r} ({what}); "
            f"{variant.name} is a setting of RoPE-like encodings: give it with those encodings only"
        )
    changed = []
    for layer in layers:
        if not _takes(layer, wanted):
            changed.append(layer)
            continue
        name, raw = parse_spec(layer)
        kept = {k: v for k, v in raw.items() if k not in kind.replaces}
        changed.append(format_spec(name, {**kept, **wanted}))
    return LAYER_SEPARATOR.join(changed)


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, MultiheadAttention)]


def build_variant_model(config: Any, task: Task, encoding: str, variant: Variant) -> nn.Module:
    """The experiment's model for ``encoding`` under ``variant`` (untrained: load the trained
    weights into it; a variant changes no parameter, only derived tables and settings)."""
    ctx = variant_context(config, task)
    model = build_model(config, task, variant_encoding(encoding, variant, ctx))
    if variant.kind.temperature:
        layers = _attention_layers(model)
        scaled = [index for index, layer in enumerate(layers) if layer.query_temperature is not None]
        if scaled:
            raise ValueError(
                f"--eval-variants {variant.text!r} does not apply to --encodings {encoding!r}: its attention "
                f"layer(s) {scaled} already scale their queries by a temperature"
            )
        temperature = QueryTemperature(
            floor_scale=float(ctx.train_tokens), attn_scale=variant.resolved_value(ctx), position_offset=0.0
        )
        for layer in layers:
            layer.query_temperature = temperature
    return model


def check_variants(config: Any, task: Task) -> list[Variant]:
    """The parsed ``config.eval_variants``, each checked against every encoding on the meta device
    (no memory): a variant that does not apply is a ``ValueError`` naming encoding and variant,
    raised before anything is written."""
    variants = parse_eval_variants(list(config.eval_variants))
    for variant in variants:
        for encoding in config.encodings:
            try:
                with torch.device("meta"):
                    build_variant_model(config, task, encoding, variant)
            except (ValueError, TypeError) as err:
                if "--eval-variants" in str(err):
                    raise
                raise ValueError(
                    f"--eval-variants {variant.text!r} does not apply to --encodings {encoding!r}: {err}"
                ) from err
    return variants


def variant_runs(runs: list[Any], variants: list[Variant]) -> list[tuple[Any, Variant]]:
    """``(trained run, variant)`` pairs to evaluate (``none`` is the trained run: none for it)."""
    return [(run, variant) for run in runs for variant in variants if not variant.is_identity]


def variant_run_id(config: Any, run: Any, variant: Variant) -> str:
    """``rope__copy__seed0__yarnx4``: the trained run's id and the variant, file-name safe."""
    slug = "".join(c if c.isalnum() or c == "_" else "x" for c in variant.text)
    return f"{run_id_for(config, run)}__{slug}"


def evaluate_variant(
    config: Any,
    task: Task,
    run: Any,
    variant: Variant,
    checkpoint: Path,
    report: Callable[[str, str, int, int, str], None],
    device: torch.device | str = "cpu",
) -> list[dict[str, Any]]:
    """The records of ``run``'s trained checkpoint evaluated under ``variant`` (the same examples
    as the trained run's), labelled with the variant, plus its ``iid`` record."""
    if not checkpoint.is_file():
        raise ValueError(
            f"--eval-variants {variant.text!r}: {run.label} has no checkpoint {checkpoint} to evaluate; "
            "delete its records from results.jsonl to retrain it"
        )
    state = load_checkpoint(checkpoint, run, device)
    model = build_variant_model(config, task, run.encoding, variant).to(device)
    model.load_state_dict(state["model"])
    label = variant.label(run.encoding)
    records = evaluate(model, config, task, RunSpec(label, run.seed), report)
    tags = {
        "run": variant_run_id(config, run, variant),
        "variant": variant.text,
        "trained_encoding": run.encoding,
    }
    records = [{**record, **tags} for record in records]
    fit_steps: dict[str, Any] = {"steps_trained": int(state["step"])}
    if config.until_fit:
        fit_steps["steps_to_fit"] = state.get("fitted_at")
    return [*records, iid_record(records, task.metric, config.train_len, config.fit_threshold, **fit_steps)]
