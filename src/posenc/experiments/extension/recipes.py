"""Extension recipes: how a trained run is changed before it continues training at a longer length.

A recipe is a spec, ``NAME`` or ``NAME:OPTION=VALUE,...`` (``posenc extend --recipes``):

===================  ======================================================================  ==========
recipe               what it does before continuing (``L``: the run's length, ``L2``: the    trains at
                     target; ``s = L2 / L`` in tokens)
===================  ======================================================================  ==========
``continue``         nothing (the control)                                                    ``L2``
``full``             a fresh run trained at ``L2`` from the start, as long as the base run    ``L2``
                     (the ceiling; no base weights)
``abf:base=B``       RoPE's base raised to ``B`` (Xiong et al. 2023, "ABF")                   ``L2``
``pi``               RoPE position interpolation, ``θ / s`` (Chen et al. 2023)                ``L2``
``ntk``              RoPE static NTK-aware base                                               ``L2``
``yarn``             RoPE YaRN with its attention factor (Peng et al. 2023)                   ``L2``
``pose``             PoSE position ids (:mod:`.positions`), ``chunks=2``; ``scaling=pi``,     ``L``
                     ``ntk`` or ``yarn`` composes a RoPE scaling (``none`` by default)
``cream``            CREAM position ids (:mod:`.positions`), ``sigma=3``; ``scaling`` as      ``L``
                     for ``pose``
``interpolate_table``  learned absolute rows ``0..L-1`` resampled to ``0..L2-1``             ``L2``
                     (``F.interpolate(mode="linear", align_corners=False)``, timm's
                     ``resample_abs_pos_embed`` in one dimension)
===================  ======================================================================  ==========

The RoPE recipes (and ``pose``/``cream`` with a scaling) take ``layers=all`` (default) or
``layers=long``: only the layers that attend over the whole sequence (no window, no chunk) change,
as Gemma 3 scales its global layers only; with an encoding whose layers are all global the two are
the same. ``factor=F`` overrides ``s`` for ``pi``, ``ntk``, ``yarn`` and the scalings. A recipe
that applies to none of an encoding's layers (PI on ALiBi, table interpolation on RoPE) is refused,
naming both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from ...encodings.learned import Learned
from ...encodings.registry import options as registry_options
from ...encodings.spec import LAYER_SEPARATOR, format_spec, parse_spec, split_layers, split_specs
from ...layers.patterns import LayerSpec, is_layer_preset, layer_pattern
from ..variant_specs import VARIANTS, VariantContext
from .positions import sample_cream_positions, sample_pose_positions

__all__ = [
    "RECIPES",
    "Recipe",
    "RecipeContext",
    "parse_recipes",
    "recipe_layers",
    "resample_table_rows",
]

#: Joins an encoding and a recipe into the row label of the recipe's records: ``"rope > yarn"``.
LABEL_SEPARATOR = " > "

PositionSampler = Callable[[int, int, torch.Generator], torch.Tensor]


@dataclass(frozen=True)
class RecipeContext:
    """What a recipe's settings derive from: the run's longest training sequence and the target, in
    tokens, and the per-head size."""

    train_tokens: int
    target_tokens: int
    head_dim: int

    @property
    def factor(self) -> float:
        return self.target_tokens / self.train_tokens


def _positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError("must be positive and finite")
    return value


def _factor(text: str) -> float:
    value = _positive_float(text)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _chunks(text: str) -> int:
    value = int(text)
    if value < 2:
        raise ValueError("must be at least 2")
    return value


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be {' or '.join(choices)}")
        return text

    return parse


_LAYERS = {"layers": (_choice("all", "long"), "all")}
_SCALINGS = {"pi": "linear", "ntk": "ntk", "yarn": "yarn"}


@dataclass(frozen=True)
class RecipeKind:
    """One kind of recipe: its options (``name: (parse, default)``; a default of None: required),
    whether it trains at the run's length with manipulated positions, and what it changes."""

    summary: str
    options: dict[str, tuple[Callable[[str], Any], Any]] = field(default_factory=dict)
    trains_short: bool = False
    fresh: bool = False
    resamples_tables: bool = False


RECIPES: dict[str, RecipeKind] = {
    "continue": RecipeKind("continue at L2, nothing changed"),
    "full": RecipeKind("a fresh run trained at L2 from the start", fresh=True),
    "abf": RecipeKind("RoPE base raised (ABF)", {"base": (_positive_float, None), **_LAYERS}),
    "pi": RecipeKind("RoPE position interpolation", {"factor": (_factor, "auto"), **_LAYERS}),
    "ntk": RecipeKind("RoPE static NTK", {"factor": (_factor, "auto"), **_LAYERS}),
    "yarn": RecipeKind("RoPE YaRN", {"factor": (_factor, "auto"), **_LAYERS}),
    "pose": RecipeKind(
        "PoSE position ids at L",
        {
            "chunks": (_chunks, 2),
            "scaling": (_choice("none", *_SCALINGS), "none"),
            "factor": (_factor, "auto"),
            **_LAYERS,
        },
        trains_short=True,
    ),
    "cream": RecipeKind(
        "CREAM position ids at L",
        {
            "sigma": (_positive_float, 3.0),
            "scaling": (_choice("none", *_SCALINGS), "none"),
            "factor": (_factor, "auto"),
            **_LAYERS,
        },
        trains_short=True,
    ),
    "interpolate_table": RecipeKind("learned table rows resampled to L2", resamples_tables=True),
}


@dataclass(frozen=True)
class Recipe:
    """One parsed recipe: ``text`` as given, its ``name`` and its typed ``options`` (defaults filled)."""

    text: str
    name: str
    options: dict[str, Any]

    @property
    def kind(self) -> RecipeKind:
        return RECIPES[self.name]

    def label(self, encoding: str) -> str:
        """The row label of this recipe's records: ``"rope > yarn"``."""
        return f"{encoding}{LABEL_SEPARATOR}{self.text}"

    def factor(self, ctx: RecipeContext) -> float:
        given = self.options.get("factor", "auto")
        return ctx.factor if given == "auto" else float(given)

    def rope_options(self, ctx: RecipeContext) -> tuple[dict[str, Any], tuple[str, ...]] | None:
        """``(options set, options replaced)`` on each RoPE-like layer it changes, or None."""
        if self.name == "abf":
            return {"base": self.options["base"]}, ("base",)
        scaling = self.name if self.name in _SCALINGS else self.options.get("scaling", "none")
        if scaling == "none":
            return None
        variant = VARIANTS[_SCALINGS[scaling]]
        vctx = VariantContext(ctx.train_tokens, ctx.target_tokens, ctx.head_dim)
        return variant.options(vctx, self.factor(ctx)), variant.replaces

    def position_sampler(self, ctx: RecipeContext) -> PositionSampler | None:
        """PoSE's or CREAM's ``(rows, width, generator) -> [rows, width]`` position ids, or None."""
        if self.name == "pose":
            chunks = self.options["chunks"]
            return lambda rows, width, gen: sample_pose_positions(rows, width, ctx.target_tokens, chunks, gen)
        if self.name == "cream":
            sigma = self.options["sigma"]
            return lambda rows, width, gen: sample_cream_positions(rows, width, ctx.target_tokens, sigma, gen)
        return None


def parse_recipes(text: str | list[str]) -> list[Recipe]:
    """``"continue,pose:chunks=2,scaling=yarn,abf:base=1e6"`` -> recipes; ``ValueError`` naming
    ``--recipes`` and the item for an unknown name or option, a bad value, a missing required
    option, or a duplicate."""
    items = split_specs(text) if isinstance(text, str) else list(text)
    recipes = []
    for item in items:
        name, raw = parse_spec(item.strip())
        if name not in RECIPES:
            raise ValueError(f"--recipes {item!r}: unknown recipe; choose from {', '.join(RECIPES)}")
        kind = RECIPES[name]
        unknown = sorted(set(raw) - set(kind.options))
        if unknown:
            takes = ", ".join(kind.options) or "no options"
            raise ValueError(
                f"--recipes {item!r}: {name} has no option {', '.join(unknown)} (it takes {takes})"
            )
        values: dict[str, Any] = {}
        for option, (parse, default) in kind.options.items():
            if option not in raw:
                if default is None:
                    raise ValueError(
                        f"--recipes {item!r}: {name} needs {option}=VALUE (e.g. abf:base=1000000)"
                    )
                values[option] = default
                continue
            try:
                values[option] = parse(raw[option])
            except ValueError as err:
                raise ValueError(f"--recipes {item!r}: {option}={raw[option]!r} {err}") from err
        if name in ("pose", "cream") and values["scaling"] == "none" and "factor" in raw:
            raise ValueError(
                f"--recipes {item!r}: factor sets a RoPE scaling; give scaling=pi, ntk or yarn too"
            )
        recipes.append(Recipe(item.strip(), name, values))
    texts = [recipe.text for recipe in recipes]
    duplicates = sorted({t for t in texts if texts.count(t) > 1})
    if duplicates:
        raise ValueError(f"--recipes lists {', '.join(duplicates)} twice")
    if not recipes:
        raise ValueError("--recipes: give at least one recipe")
    return recipes


def _rope_like(spec: str) -> bool:
    """Whether the layer spec's encoding takes RoPE's scaling options (the registry's typed options)."""
    return "scaling" in registry_options(parse_spec(spec)[0])


def _changed(spec: str, wanted: dict[str, Any], replaces: tuple[str, ...]) -> str:
    name, raw = parse_spec(spec)
    kept = {k: v for k, v in raw.items() if k not in replaces}
    return format_spec(name, {**kept, **wanted})


def recipe_layers(
    encoding: str, num_layers: int, recipe: Recipe, ctx: RecipeContext
) -> tuple[str, list[LayerSpec] | None]:
    """``(encoding, pattern)`` of the model ``recipe`` continues: the encoding string with the RoPE-like
    layers' options changed, or for a layer preset (``gemma3:window=8``) its expanded per-layer
    pattern with them changed. ``ValueError`` naming the recipe and the encoding when it changes none."""
    change = recipe.rope_options(ctx)
    if change is None:
        return encoding, None
    wanted, replaces = change
    only_long = recipe.options.get("layers") == "long"
    if is_layer_preset(encoding):
        layers = layer_pattern(encoding, num_layers)
        chosen = [
            _rope_like(layer.encoding) and not (only_long and (layer.window or layer.chunk))
            for layer in layers
        ]
        _refuse_if_none(chosen, recipe, encoding, only_long)
        changed = [
            replace(layer, encoding=_changed(layer.encoding, wanted, replaces)) if pick else layer
            for layer, pick in zip(layers, chosen, strict=True)
        ]
        return encoding, changed
    specs = split_layers(encoding)
    chosen = [_rope_like(spec) for spec in specs]
    _refuse_if_none(chosen, recipe, encoding, only_long)
    changed_specs = [
        _changed(spec, wanted, replaces) if pick else spec for spec, pick in zip(specs, chosen, strict=True)
    ]
    return LAYER_SEPARATOR.join(changed_specs), None


def _refuse_if_none(chosen: list[bool], recipe: Recipe, encoding: str, only_long: bool) -> None:
    if not any(chosen):
        which = "none of its global layers" if only_long else "none of its layers"
        raise ValueError(
            f"--recipes {recipe.text!r} does not apply to {encoding!r}: {which} is RoPE-like "
            f"({recipe.name} changes RoPE's frequencies); give it with RoPE encodings only"
        )


def resample_table_rows(trained: torch.Tensor, new_rows: int) -> torch.Tensor:
    """``trained [n, D]`` resampled to ``[new_rows, D]``: ``F.interpolate(mode="linear",
    align_corners=False)`` over positions, in float64, returned in the table's dtype."""
    channels_first = trained.detach().to(torch.float64).T[None]
    resampled = F.interpolate(channels_first, size=new_rows, mode="linear", align_corners=False)
    return resampled[0].T.to(trained.dtype).contiguous()


def learned_tables(model: torch.nn.Module, encoding: str) -> list[Learned]:
    """The learned absolute tables of ``model`` (what ``interpolate_table`` resamples); ``ValueError``
    naming ``encoding`` when it has none."""
    tables = [module for module in model.modules() if isinstance(module, Learned)]
    if not tables:
        raise ValueError(
            f"--recipes 'interpolate_table' does not apply to {encoding!r}: it has no learned absolute "
            "table (give it with learned encodings only)"
        )
    return tables


@torch.no_grad()
def interpolate_tables(model: torch.nn.Module, encoding: str, ctx: RecipeContext) -> None:
    """Rows ``0..train_tokens-1`` of every learned table resampled onto rows ``0..target_tokens-1``;
    ``ValueError`` when the model has none."""
    for table in learned_tables(model, encoding):
        weight = table.table.weight
        if weight.shape[0] < ctx.target_tokens:
            raise ValueError(
                f"interpolate_table: the table has {weight.shape[0]} rows, fewer than the target's "
                f"{ctx.target_tokens} positions"
            )
        weight[: ctx.target_tokens] = resample_table_rows(weight[: ctx.train_tokens], ctx.target_tokens)
