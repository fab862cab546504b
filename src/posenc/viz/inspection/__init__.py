"""``posenc inspect MODEL``: what positions a trained model uses and what it learned, as a terminal
summary and one self-contained HTML page with figures.

:func:`inspect_model` reads the model once (:func:`~.model.read_model`: a fetched model's name, an
HF folder or a GGUF file) and asks each family section of :data:`FAMILIES` what it finds there;
each decides from what the config and the weights hold, so no model is named anywhere:

1. **Absolute position tables** (:mod:`.tables`): a learned table's cosine-similarity matrix (its
   band) and norm by position; a table equal to a fixed sinusoid (Whisper's encoder) is said to be one.
2. **Bucketed relative bias** (:mod:`.buckets`): T5's and MPNet's trained bias per head against the
   relative distance, bucket edges marked.
3. **RoPE** (:mod:`.rotary`): the mean norm of each rotated pair of the queries and keys on real
   text, a layer x pair heatmap, and each pair's wavelength against the context.

Above them the page lays out the encoding of every stack and layer type (family, options, window,
head sizes; :mod:`.layers`) and every check of the config against the weights, disagreements
first. The math is :mod:`posenc.pretrained.measures`' (pure functions); :mod:`.page` writes the
folder (``index.html``, ``inspect.json`` with every number the page shows, ``figures/*.png``) into a
temporary folder renamed into place, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from . import buckets, rotary, tables
from .layers import Check, Finding, LayerRow, head_checks, layer_rows, stacks
from .model import InspectError, ModelView, read_model

__all__ = ["FAMILIES", "InspectError", "Inspection", "inspect_model", "write_inspection"]

#: The family sections, in the order of the page: each has ``ID``, ``HEADING``, ``INTRO``,
#: ``find(view, tokens=...) -> [Finding]`` (empty where the model holds none) and
#: ``figures(finding, label) -> [(stem, Figure, caption)]``.
FAMILIES: tuple[ModuleType, ...] = (tables, buckets, rotary)

#: Tokens of the reference text the RoPE section reads by default.
DEFAULT_TOKENS = 512


@dataclass(frozen=True)
class Inspection:
    """What :func:`inspect_model` found.

    Attributes:
        view: the model as read.
        findings: ``{family section ID: [Finding]}``, sections that found nothing left out.
        rows: the encoding of every stack and layer type.
        checks: every config-against-weights check (the attention sizes and each section's own).
        command: the command line that makes the page again.
    """

    view: ModelView
    findings: dict[str, list[Finding]]
    rows: list[LayerRow]
    checks: list[Check]
    command: str = ""

    @property
    def disagreements(self) -> list[Check]:
        return [c for c in self.checks if not c.agrees]

    def numbers(self) -> dict[str, Any]:
        """Every number the page shows, as JSON values (``inspect.json``)."""
        return {
            "model": self.view.label,
            "command": self.command,
            "path": str(self.view.path),
            "source": self.view.source,
            "model_type": self.view.config.model_type,
            "architectures": list(getattr(self.view.config, "architectures", None) or []),
            "layers": [_row_numbers(row) for row in self.rows],
            "checks": [vars(check) for check in self.checks],
            **{key: [f.numbers() for f in found] for key, found in self.findings.items()},
        }


def _row_numbers(row: LayerRow) -> dict[str, Any]:
    return {
        "stack": row.stack,
        "layer_type": row.layer_type,
        "layers": list(row.layers),
        "encodings": [{"family": e.family, "where": e.where, "options": e.options} for e in row.encodings],
        "window": row.window,
        "heads": row.heads,
        "kv_heads": row.kv_heads,
        "head_dim": row.head_dim,
    }


def inspect_model(
    model: str | Path, *, tokens: int = DEFAULT_TOKENS, log: Callable[[str], None] | None = None
) -> Inspection:
    """Read ``model`` and measure its positional encodings (see the module docstring).

    Args:
        model: a fetched model's name, an HF folder or a GGUF file.
        tokens: tokens of the reference text a RoPE model is run on (at least 2).
        log: called with progress lines (a fetched model's first conversion), or None.

    Raises :class:`InspectError` for input that is no model posenc can read, or a model that holds
    none of the encodings the sections read.
    """
    if tokens < 2:
        raise InspectError(f"--tokens must be at least 2, got {tokens}")
    view = read_model(model, log=log)
    findings = {family.ID: family.find(view, tokens=tokens) for family in FAMILIES}
    findings = {key: found for key, found in findings.items() if found}
    if not findings:
        raise InspectError(
            f"{view.path}: its config (model_type {view.config.model_type!r}) and weights hold none of the "
            "position encodings posenc inspect reads (an absolute table named position_embeddings, "
            "embed_positions or wpe; a relative_attention_bias with relative_attention_num_buckets; "
            "RoPE parameters with q_proj/k_proj attention)"
        )
    all_stacks = stacks(view.config)
    encodings = [e for found in findings.values() for f in found for e in f.encodings]
    checks = head_checks(view, all_stacks) + [
        c for found in findings.values() for f in found for c in f.checks
    ]
    command = f"posenc inspect {shlex.quote(str(model))}" + (
        "" if tokens == DEFAULT_TOKENS else f" --tokens {tokens}"
    )
    return Inspection(view, findings, layer_rows(all_stacks, encodings), checks, command)


def write_inspection(inspection: Inspection, out: str | Path) -> Path:
    """Write the page of ``inspection`` into the folder ``out`` (see :mod:`.page`); returns the page."""
    from .page import write_folder

    return write_folder(inspection, Path(out), FAMILIES)
