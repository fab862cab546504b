"""RoPE's and M-RoPE's ``scaling`` option: one value, flat options in spec strings.

As HF keeps one ``rope_parameters`` dict, :class:`~posenc.encodings.rope.RoPE` and
:class:`~posenc.encodings.mrope.MRoPE` take one ``scaling`` value: a type name (``"yarn"``), a
:class:`~posenc.encodings.rope_scaling.RopeScaling`, or a dict of its fields (``{"type": "yarn",
"factor": 4.0, ...}``; HF's ``rope_type`` is read as ``type``). Spec strings name the type and its
options flat (``rope:scaling=yarn,factor=4,original_max_position_embeddings=4096``): the
registry's :class:`~posenc.encodings.registry.OptionGroup` of :func:`scaling_group` gathers them into a dict
before ``__init__`` runs and records every form flat in ``config()``, so all forms build one
encoding with one spec string. The options and their types are those of
:mod:`~posenc.encodings.rope_scaling` (``RopeScaling.OPTIONS``), the one place they are spelled.
"""

from __future__ import annotations

from typing import Any, get_type_hints

from .registry import OptionGroup
from .rope_scaling import RopeScaling


def _scaling_parts(value: Any, allowed: tuple[str, ...]) -> tuple[str | None, dict[str, Any]]:
    """The type (None: not given) and the options of a ``scaling`` value: a type name, a
    :class:`RopeScaling`, or a dict of its fields (``type``, or HF's ``rope_type``, and options)."""
    if value is None or isinstance(value, str):
        return value, {}
    if isinstance(value, RopeScaling):
        rope_type, options = value.type, value.options()
    elif isinstance(value, dict):
        options = {k: v for k, v in value.items() if v is not None}
        types = {options.pop(k) for k in ("type", "rope_type") if k in options}
        if len(types) > 1:
            raise ValueError(f"RoPE scaling: 'type' and 'rope_type' disagree in {value!r}")
        rope_type = types.pop() if types else None
    else:
        raise ValueError(
            f"RoPE scaling must be a type name, a RopeScaling or a dict of its fields, got {value!r}"
        )
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"RoPE scaling: unknown option(s) {', '.join(unknown)}; the options are {', '.join(allowed)}"
        )
    return rope_type, options


def scaling_group(allowed: tuple[str, ...]) -> OptionGroup:
    """``scaling`` as one :class:`~posenc.encodings.registry.OptionGroup`: spec strings give the type and the
    options ``allowed`` flat (``rope:scaling=yarn,factor=4``); the registry gathers them into a dict
    of :class:`RopeScaling` fields and records any ``scaling`` value flat again."""
    hints = get_type_hints(RopeScaling)

    def gather(value: Any, flat: dict[str, Any]) -> Any:
        if flat and not (value is None or isinstance(value, str)):
            raise ValueError(
                f"RoPE scaling: give {', '.join(sorted(flat))} inside scaling={value!r} or beside a type name, "
                "not both"
            )
        return {"type": value, **flat} if flat else value

    return OptionGroup({k: hints[k] for k in allowed}, gather, lambda value: _scaling_parts(value, allowed))


def resolve_scaling(
    base: float, scaling: Any, rope_parameters: dict | None
) -> tuple[RopeScaling, float, float | None]:
    """``(RopeScaling, base, partial_rotary_factor)`` from RoPE's (or M-RoPE's) ``scaling`` or an HF dict.

    ``scaling``: a type name, a :class:`RopeScaling` or a dict of its fields (:func:`scaling_group`).
    """
    rope_type, given = _scaling_parts(scaling, RopeScaling.OPTIONS)
    if rope_parameters is None:
        return RopeScaling.from_options(rope_type, **given), float(base), None
    # HF keeps max_position_embeddings on the model config, outside rope_parameters.
    model_level = {k: given.pop(k) for k in ("max_position_embeddings",) if k in given}
    if rope_type is not None or given:
        raise ValueError(
            f"rope: give either rope_parameters or scaling options, not both (got rope_parameters and "
            f"{', '.join(['scaling'] * (rope_type is not None) + sorted(given))})"
        )
    config = {"rope_theta": base, **model_level, **rope_parameters}
    theta = config.get("rope_theta")
    return (
        RopeScaling.from_config(config),
        float(10000.0 if theta is None else theta),
        config.get("partial_rotary_factor"),
    )
