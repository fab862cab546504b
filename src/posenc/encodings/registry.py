"""The encoding registry and spec strings.

``@register("name")`` adds a :class:`~posenc.encodings.base.PositionalEncoding` subclass;
``build("rope:base=500000,scaling=yarn")`` parses a spec string, checks every option against the
class's typed ``__init__`` signature and builds the module. Unknown names and unknown or badly
typed options raise ``ValueError`` naming the option and suggesting the closest valid names.

A spec string is parsed once into a :class:`~posenc.encodings.spec.Spec` (the class and its coerced
options, :func:`resolve`). An attention layer or model builds its encoding with
:func:`build_for_layer` and a :class:`~posenc.encodings.base.LayerContext`; the class declares which of its
options the layer supplies (``layer_sizes``, ``layer_defaults``), so nothing is filled in by name.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import types
import typing
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

import torch

from .base import KIND_BASES, LayerContext, PositionalEncoding
from .spec import Spec, format_spec, parse_spec

__all__ = [
    "OptionGroup",
    "Range",
    "at_least",
    "available",
    "build",
    "build_for_layer",
    "format_spec",
    "get_class",
    "greater_than",
    "options",
    "parse_spec",
    "register",
    "resolve",
]

_REGISTRY: dict[str, type[PositionalEncoding]] = {}


@dataclass(frozen=True)
class Range:
    """The documented range of a numeric option, declared next to the option in the encoding's
    ``option_ranges`` and checked by the registry before ``__init__`` runs.

    ``None`` bounds are open-ended; a list value is checked item by item; ``None`` values (an
    option that is off) and non-numbers (left to the option's type check) are not range-checked.
    """

    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies in the range."""
        above_low = self.low is None or (value >= self.low if self.low_inclusive else value > self.low)
        below_high = self.high is None or (value <= self.high if self.high_inclusive else value < self.high)
        return above_low and below_high

    def __str__(self) -> str:
        low = None if self.low is None else f"{'>=' if self.low_inclusive else '>'} {self.low:g}"
        high = None if self.high is None else f"{'<=' if self.high_inclusive else '<'} {self.high:g}"
        if low and high:
            return (
                f"in {'[' if self.low_inclusive else '('}{self.low:g}, {self.high:g}"
                f"{']' if self.high_inclusive else ')'}"
            )
        return low or high or "any number"


@dataclass(frozen=True)
class OptionGroup:
    """Options a spec string names one by one and ``__init__`` takes as one value.

    An encoding declares ``option_groups = {"scaling": group}``: its ``__init__`` has the one
    argument (RoPE's ``scaling``), and the registry lists the group's flat ``options`` beside it
    (:func:`options`), coerces them in spec strings, gathers them into the argument before
    ``__init__`` runs (also for a direct call: ``RoPE(scaling="yarn", factor=4)``) and records them
    flat again in :meth:`~posenc.encodings.base.PositionalEncoding.config`. So
    ``rope:scaling=yarn,factor=4`` and ``RoPE(scaling=RopeScaling("yarn", factor=4))`` are one
    encoding with one config and one spec string.
    """

    #: The flat option names and their types, in spec order.
    options: Mapping[str, Any]
    #: ``(argument as given, flat options given) -> the argument __init__ receives``.
    gather: Callable[[Any, dict[str, Any]], Any]
    #: ``argument -> (its own spec value, its flat options)``; refuses what it cannot flatten.
    flatten: Callable[[Any], tuple[Any, dict[str, Any]]]


def at_least(low: float) -> Range:
    """``value >= low`` (sizes: ``at_least(1)``)."""
    return Range(low=low)


def greater_than(low: float) -> Range:
    """``value > low`` (epsilons, scales: ``greater_than(0)``)."""
    return Range(low=low, low_inclusive=False)


def check_option_ranges(cls: type[PositionalEncoding], options_: dict[str, Any]) -> None:
    """``ValueError`` naming the first option of ``options_`` outside its declared :class:`Range`."""
    for option, allowed in cls.option_ranges.items():
        value = options_.get(option)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                continue
            if not allowed.contains(item):
                raise ValueError(f"{cls.name}: option {option!r} must be {allowed}, got {option}={value!r}")


def register(name: str):
    """Class decorator: register an encoding under ``name`` (lower-case, no ``:`` or ``,``).

    The class must derive from one of the four kind bases (:class:`~posenc.encodings.base.AbsoluteEncoding`,
    ``RotaryEncoding``, ``BiasEncoding``, ``ContentEncoding``) and implement that kind's hook;
    ``TypeError`` otherwise.
    """
    if not name or any(c in name for c in ":,= ") or name != name.lower():
        raise ValueError(f"invalid encoding name {name!r}: use lower-case letters, digits, '_' or '-'")

    def decorator(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(
                f"encoding name {name!r} is already registered by {_REGISTRY[name].__qualname__}"
            )
        if not issubclass(cls, PositionalEncoding):
            raise TypeError(f"@register({name!r}) needs a PositionalEncoding subclass, got {cls!r}")
        _check_contract(name, cls)
        cls.name = name
        if not cls.description:
            cls.description = (inspect.getdoc(cls) or "").split("\n")[0]
        _REGISTRY[name] = cls
        _wrap_init(cls)
        return cls

    return decorator


def _check_contract(name: str, cls: type[PositionalEncoding]) -> None:
    """The class derives from exactly one kind base, keeps its kind and implements its hook."""
    where = f"@register({name!r}): {cls.__qualname__}"
    bases = [base for base in KIND_BASES.values() if issubclass(cls, base)]
    if len(bases) != 1:
        choices = ", ".join(base.__name__ for base in KIND_BASES.values())
        got = "none of them" if not bases else " and ".join(base.__name__ for base in bases)
        raise TypeError(
            f"{where} must derive from exactly one of {choices} (posenc.encodings.base), got {got}"
        )
    base = bases[0]
    if cls.kind is not base.kind:
        raise TypeError(f"{where} derives from {base.__name__} but sets kind={cls.kind!r}")
    if getattr(cls, base.hook) is getattr(base, base.hook):
        raise TypeError(f"{where} is a {base.__name__} but does not implement {base.hook}()")
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    params = inspect.signature(init).parameters
    for option in cls.layer_sizes:
        if option not in LayerContext.SIZES or option not in params:
            raise TypeError(
                f"{where}: layer_sizes entry {option!r} must be one of {LayerContext.SIZES} and an __init__ option"
            )
    flat = {option for group in cls.option_groups.values() for option in group.options}
    if not set(cls.option_groups) <= set(params) or flat & set(params):
        raise TypeError(f"{where}: option_groups must name __init__ options and add flat options it lacks")
    unknown = sorted(set(cls.option_ranges) - set(params) - flat)
    if unknown:
        raise TypeError(f"{where}: option_ranges names {unknown}, which are not __init__ options")
    if cls.derived_buffers and cls.reset_buffers is PositionalEncoding.reset_buffers:
        raise TypeError(
            f"{where} declares derived_buffers {cls.derived_buffers} but does not implement reset_buffers()"
        )


def _wrap_init(cls: type[PositionalEncoding]) -> None:
    """Gather the flat options of each :class:`OptionGroup` into its argument, check the declared
    option ranges, then record the options an instance was built with (flat), so ``config()`` and
    ``spec()`` can rebuild it."""
    original = cls.__init__
    if getattr(original, "_posenc_records_config", False):
        return
    signature = inspect.signature(original)
    groups = cls.option_groups

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        flat = {
            key: {k: kwargs.pop(k) for k in group.options if k in kwargs} for key, group in groups.items()
        }
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        given: dict[str, Any] = {}
        for key, value in bound.arguments.items():
            if key in ("self", "kwargs"):
                continue
            if key not in groups:
                given[key] = value
                continue
            group = groups[key]
            bound.arguments[key] = value = group.gather(
                value, {k: v for k, v in flat[key].items() if v is not None}
            )
            given[key], options_ = group.flatten(value)
            given.update({option: options_.get(option) for option in group.options})
        # Declared ranges are checked before the encoding builds any table from the options.
        check_option_ranges(cls, given)
        original(*bound.args, **bound.kwargs)
        if type(self) is cls:
            self._config = given

    __init__._posenc_records_config = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    __init__.__doc__ = original.__doc__
    cls.__init__ = __init__  # type: ignore[method-assign]


def _load_builtin() -> None:
    from .. import encodings  # noqa: F401  (importing registers every family)


def available() -> list[str]:
    """Sorted names of every registered encoding."""
    _load_builtin()
    return sorted(_REGISTRY)


def get_class(name: str) -> type[PositionalEncoding]:
    """The class registered under ``name``; ``ValueError`` with suggestions otherwise."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown encoding {name!r}{_suggest(name, _REGISTRY)}; available: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


def _suggest(word: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.5)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def options(name: str) -> dict[str, inspect.Parameter]:
    """The typed options of encoding ``name``: its ``__init__`` parameters, each
    :class:`OptionGroup`'s flat options (default None) right after the argument they gather into."""
    cls = get_class(name)
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    found: dict[str, inspect.Parameter] = {}
    for k, p in inspect.signature(init).parameters.items():
        if k == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        found[k] = p
        for option, annotation in getattr(cls.option_groups.get(k), "options", {}).items():
            found[option] = inspect.Parameter(option, p.KEYWORD_ONLY, default=None, annotation=annotation)
    return found


def _type_hints(cls: type) -> dict[str, Any]:
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    module = inspect.getmodule(init)
    return typing.get_type_hints(init, globalns=vars(module) if module else None)


class NonFiniteOptionError(ValueError):
    """A float option is nan or infinite."""


def _coerce(name: str, option: str, value: Any, annotation: Any) -> Any:
    """Convert ``value`` (a string from a spec, or a Python value) to ``annotation``; ValueError if impossible."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return value
    origin = get_origin(annotation)
    # The structured forms first, in this order; then the plain scalar types, looked up by type.
    if origin in (Union, types.UnionType):
        return _coerce_union(name, option, value, annotation)
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return _coerce_dataclass(name, option, value, annotation)
    if origin is Literal:
        return _coerce_literal(name, option, value, annotation)
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        return _coerce_list(name, option, value, annotation)
    if origin is dict or annotation is dict:
        return _coerce_dict(name, option, value)
    scalar = _SCALAR_COERCERS.get(annotation) if isinstance(annotation, type) else None
    return scalar(name, option, value) if scalar is not None else value


def _coerce_union(name: str, option: str, value: Any, annotation: Any) -> Any:
    args = get_args(annotation)
    is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
    if is_none and type(None) in args:
        return None
    # Try the non-None members in order, strings last so "1" becomes an int where allowed.
    ordered = sorted((a for a in args if a is not type(None)), key=lambda a: a is str)
    for arg in ordered:
        try:
            return _coerce(name, option, value, arg)
        except NonFiniteOptionError:
            raise
        except ValueError:
            continue
    raise ValueError(f"{name}: option {option!r} got {value!r}, expected {_type_name(annotation)}")


def _coerce_dataclass(name: str, option: str, value: Any, annotation: type) -> Any:
    if isinstance(value, annotation):
        return value
    raise ValueError(f"{name}: option {option!r} must be a {annotation.__name__}, got {value!r}")


def _coerce_literal(name: str, option: str, value: Any, annotation: Any) -> Any:
    choices = get_args(annotation)
    if value in choices:
        return value
    raise ValueError(
        f"{name}: option {option!r} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}"
        f"{_suggest(str(value), [str(c) for c in choices])}"
    )


def _coerce_list(name: str, option: str, value: Any, annotation: Any) -> list[Any]:
    item_type = (get_args(annotation) or (Any,))[0]
    if isinstance(value, str):
        items = [v for v in value.split("|") if v != ""]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"{name}: option {option!r} must be a list, got {value!r}")
    return [_coerce(name, option, v, item_type) for v in items]


def _coerce_dict(name: str, option: str, value: Any) -> dict[Any, Any]:
    if isinstance(value, dict):
        return dict(value)
    raise ValueError(f"{name}: option {option!r} must be a dict, got {value!r}")


def _coerce_bool(name: str, option: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError(f"{name}: option {option!r} must be a bool, got {value!r}")


def _coerce_int(name: str, option: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name}: option {option!r} must be an int, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ValueError(f"{name}: option {option!r} must be an int, got {value!r}")


def _coerce_float(name: str, option: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name}: option {option!r} must be a float, got {value!r}")
    number: float | None = None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ValueError(f"{name}: option {option!r} must be a float, got {value!r}")
    if not math.isfinite(number):
        # nan or inf would flow into tables and logits and come out as silently wrong numbers.
        raise NonFiniteOptionError(f"{name}: option {option!r} must be a finite number, got {value!r}")
    return number


def _coerce_str(name: str, option: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError(f"{name}: option {option!r} must be a str, got {value!r}")


# The scalar annotations an option may carry, each with its converter (``_coerce`` looks the type up here).
_SCALAR_COERCERS: dict[type, Callable[[str, str, Any], Any]] = {
    bool: _coerce_bool,
    int: _coerce_int,
    float: _coerce_float,
    str: _coerce_str,
}


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _resolve(name: str, given: dict[str, Any]) -> Spec:
    """Check ``given`` against encoding ``name``'s signature and coerce every value to its type."""
    cls = get_class(name)
    params = options(name)
    hints = _type_hints(cls)
    resolved: dict[str, Any] = {}
    for option, value in given.items():
        if option not in params:
            valid = sorted(params)
            raise ValueError(
                f"{name}: unknown option {option!r}{_suggest(option, valid)}; valid options: {', '.join(valid) or 'none'}"
            )
        resolved[option] = _coerce(name, option, value, hints.get(option, params[option].annotation))
    return Spec(cls, resolved)


def _check_required(spec: Spec, options_: dict[str, Any]) -> None:
    """``ValueError`` naming every required option missing from ``options_``."""
    params = options(spec.name)
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in options_]
    if missing:
        from_layer = [m for m in missing if m in spec.cls.layer_sizes]
        hint = (
            f" ({', '.join(from_layer)} is filled in by an attention layer; give it to build the encoding on its own)"
            if from_layer
            else ""
        )
        raise ValueError(
            f"{spec.name}: missing required option(s) {', '.join(repr(m) for m in missing)}{hint}"
        )


def resolve(spec: str | Spec, /, **options_: Any) -> Spec:
    """Parse a spec string once and check and coerce its options (plus keyword ``options_``).

    Required options may be missing here (a layer may supply them); :func:`build` checks them.

    Raises:
        ValueError: unknown name or option, a badly typed value, an option both in the spec
            string and in ``options_``.
    """
    name, given = _split(spec)
    overlap = set(given) & set(options_)
    if overlap:
        raise ValueError(f"{name}: option(s) {sorted(overlap)} given both in the spec string and as keywords")
    return _resolve(name, {**given, **options_})


def _split(spec: str | Spec) -> tuple[str, dict[str, Any]]:
    """The name and the options of a spec string (raw strings) or a :class:`Spec` (coerced values)."""
    if isinstance(spec, Spec):
        return spec.name, dict(spec.options)
    return parse_spec(spec)


def build(spec: str | Spec | PositionalEncoding, /, **options_: Any) -> PositionalEncoding:
    """Build an encoding from a name or spec string plus keyword options.

    A :class:`PositionalEncoding` instance is returned as it is (options must then be empty).
    Raises ``ValueError`` for unknown names, unknown options, and values of the wrong type.

    Examples:
        >>> enc = build("t5", num_heads=8, num_buckets=32, max_distance=128, bidirectional=True)
        >>> enc = build("rope:base=500000")  # head_dim is set by the first layer that takes it
    """
    if isinstance(spec, PositionalEncoding):
        if options_:
            raise ValueError(f"options {sorted(options_)} given with an already built encoding {spec.name!r}")
        return spec
    parsed = resolve(spec, **options_)
    _check_required(parsed, parsed.options)
    return parsed.cls(**parsed.options)


def build_for_layer(
    spec: str | Spec | PositionalEncoding | None,
    context: LayerContext | None = None,
    *,
    num_heads: int | None = None,
    head_dim: int | None = None,
    dim: int | None = None,
    **extra: Any,
) -> PositionalEncoding:
    """Build an encoding for the attention layer described by ``context``.

    The class takes the options it declares from the layer (``layer_sizes``: the layer's own
    sizes, which a spec may only repeat; ``layer_defaults``: suggestions such as a table size,
    which a spec overrides), then the encoding is moved to ``context.device``/``context.dtype``.
    ``extra`` options override those of the spec. ``None`` means ``"nope"``. A built encoding is
    checked against the layer and returned (moved as well).

    ``num_heads``/``head_dim``/``dim`` build the context when none is given (the older form).

    Raises:
        ValueError: a layer size given in the spec or encoding differs from the layer's, or any
            error of :func:`resolve`.
    """
    if context is None:
        if num_heads is None or head_dim is None or dim is None:
            raise ValueError("build_for_layer needs a LayerContext (or num_heads, head_dim and dim)")
        context = LayerContext(num_heads=num_heads, head_dim=head_dim, dim=dim)
    if spec is None:
        spec = "nope"
    if isinstance(spec, PositionalEncoding):
        spec.check_layer(context)
        encoding = spec
    else:
        name, given = _split(spec)
        parsed = _resolve(name, {**given, **extra})  # extra options override the spec's
        filled = parsed.cls.options_for_layer(context, parsed.options)
        _check_required(parsed, filled)
        with torch.device(context.device) if context.device is not None else nullcontext():
            encoding = parsed.cls(**filled)
    if context.device is not None or context.dtype is not None:
        move = {k: v for k, v in (("device", context.device), ("dtype", context.dtype)) if v is not None}
        encoding.to(**move)
    return encoding
