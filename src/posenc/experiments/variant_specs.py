"""What ``--eval-variants`` names, without a model: each variant's kind, its parsed form
(:class:`Variant`, :func:`parse_eval_variants`) and the row labels of an experiment
(:func:`row_labels`). :mod:`posenc.experiments.variants` applies them to trained checkpoints; the
results read the labels from here, so they need neither torch models nor the training code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..encodings.rope_scaling import RopeScaling, ScalingType

__all__ = [
    "LABEL_SEPARATOR",
    "VARIANTS",
    "Variant",
    "VariantContext",
    "VariantKind",
    "parse_eval_variants",
    "row_labels",
]


#: Joins an encoding and a variant into the row label of the variant's records.
LABEL_SEPARATOR = " + "


@dataclass(frozen=True)
class VariantContext:
    """What a variant's settings are derived from: the trained and evaluated sequence lengths in
    tokens, and the per-head size."""

    train_tokens: int
    eval_tokens: int
    head_dim: int

    @property
    def default_factor(self) -> float:
        return max(1.0, self.eval_tokens / self.train_tokens)


#: The RoPE options a scaling variant replaces in the trained spec (whatever scaling it was trained with).
_SCALING_KEYS = ("scaling", *RopeScaling.OPTIONS)


@dataclass(frozen=True)
class VariantKind:
    """One kind of variant: the spec options it sets (None: it sets none), what its value means and
    its default, and whether it sets a query temperature."""

    summary: str
    options: Callable[[VariantContext, float], dict[str, Any]] | None = None
    value_name: str | None = None
    default: Callable[[VariantContext], float] | None = None
    replaces: tuple[str, ...] = ()
    temperature: bool = False
    check_value: Callable[[float], bool] = lambda value: value >= 1.0
    value_range: str = ">= 1"


def _scaling(
    rope_type: ScalingType, original: bool = True
) -> Callable[[VariantContext, float], dict[str, Any]]:
    def options(ctx: VariantContext, factor: float) -> dict[str, Any]:
        chosen: dict[str, Any] = {"scaling": rope_type, "factor": factor}
        if original:
            chosen["original_max_position_embeddings"] = ctx.train_tokens
        return chosen

    return options


def _longrope(ctx: VariantContext, factor: float) -> dict[str, Any]:
    pairs = ctx.head_dim // 2
    return {
        **_scaling("longrope")(ctx, factor),
        "short_factor": [1.0] * pairs,
        "long_factor": [factor] * pairs,
    }


def _prope(ctx: VariantContext, proportion: float) -> dict[str, Any]:
    return {"scaling": "proportional", "rotary_dim": 2 * int(proportion * ctx.head_dim // 2)}


def _factor(ctx: VariantContext) -> float:
    return ctx.default_factor


_SCALING = dict(value_name="factor", default=_factor, replaces=_SCALING_KEYS)

#: Every variant ``--eval-variants`` accepts, by name.
VARIANTS: dict[str, VariantKind] = {
    "none": VariantKind("as trained"),
    "linear": VariantKind("RoPE position interpolation", _scaling("linear", original=False), **_SCALING),
    "ntk": VariantKind("RoPE static NTK", _scaling("ntk", original=False), **_SCALING),
    "dynamic": VariantKind("RoPE dynamic NTK", _scaling("dynamic"), **_SCALING),
    "yarn": VariantKind("RoPE YaRN", _scaling("yarn"), **_SCALING),
    "longrope": VariantKind("RoPE LongRoPE, uniform factors", _longrope, **_SCALING),
    "prope": VariantKind(
        "p-RoPE: the fastest fraction of pairs rotates",
        _prope,
        value_name="rotating fraction",
        default=lambda ctx: 0.75,
        replaces=(*_SCALING_KEYS, "rotary_dim"),
        check_value=lambda value: 0.0 < value <= 1.0,
        value_range="in (0, 1]",
    ),
    "drop_rotation": VariantKind("no rotation", lambda ctx, value: {"drop_rotation": "always"}),
    "temperature": VariantKind(
        "log-length query temperature",
        value_name="beta",
        default=lambda ctx: 0.1,
        temperature=True,
        check_value=lambda value: value >= 0.0,
        value_range=">= 0",
    ),
}


@dataclass(frozen=True)
class Variant:
    """One parsed ``--eval-variants`` item: ``text`` as given (``"yarn:4"``), its ``name`` and its
    ``value`` (None: derived from the lengths or the kind's default)."""

    text: str
    name: str
    value: float | None = None

    @property
    def kind(self) -> VariantKind:
        return VARIANTS[self.name]

    @property
    def is_identity(self) -> bool:
        """``none``: the trained run itself."""
        return self.name == "none"

    def label(self, encoding: str) -> str:
        """The row label of this variant's records: ``"rope + yarn"``."""
        return f"{encoding}{LABEL_SEPARATOR}{self.text}"

    def resolved_value(self, ctx: VariantContext) -> float:
        """The value it runs with: the one given, else the kind's default (the factor ``E / T``)."""
        if self.value is not None:
            return self.value
        return self.kind.default(ctx) if self.kind.default is not None else math.nan


def parse_eval_variants(items: list[str]) -> list[Variant]:
    """``["none", "yarn:4", "temperature"]`` -> variants; ``ValueError`` naming ``--eval-variants``
    and the item for an unknown name, a bad value, a value where none is taken, or a duplicate."""
    variants: list[Variant] = []
    for item in items:
        text = item.strip()
        name, sep, value_text = text.partition(":")
        if name not in VARIANTS:
            raise ValueError(
                f"--eval-variants {text!r}: unknown variant; choose from {', '.join(VARIANTS)} "
                "(optionally NAME:VALUE, e.g. yarn:4)"
            )
        kind = VARIANTS[name]
        value = None
        if sep:
            if kind.value_name is None:
                raise ValueError(f"--eval-variants {text!r}: {name} takes no value; write {name}")
            try:
                value = float(value_text)
            except ValueError as err:
                raise ValueError(f"--eval-variants {text!r}: the {kind.value_name} must be a number") from err
            if not (math.isfinite(value) and kind.check_value(value)):
                raise ValueError(
                    f"--eval-variants {text!r}: the {kind.value_name} must be {kind.value_range}"
                )
        variants.append(Variant(text, name, value))
    texts = [variant.text for variant in variants]
    duplicates = sorted({text for text in texts if texts.count(text) > 1})
    if duplicates:
        raise ValueError(f"--eval-variants lists {', '.join(duplicates)} twice")
    return variants


def row_labels(config: Any) -> list[str]:
    """The rows of an experiment: each encoding, then its variants (``"rope + yarn"``); ``none`` is
    the trained row itself and adds none."""
    variants = [
        variant for variant in parse_eval_variants(list(config.eval_variants)) if not variant.is_identity
    ]
    return [
        label for encoding in config.encodings for label in [encoding] + [v.label(encoding) for v in variants]
    ]
