"""The encoding registry and spec strings.

``@register("name")`` adds a :class:`~posenc.base.PositionalEncoding` subclass;
``build("rope:base=500000,scaling=yarn")`` parses a spec string, checks every option against the
class's typed ``__init__`` signature and builds the module. Unknown names and unknown or badly
typed options raise ``ValueError`` naming the option and suggesting the closest valid names.

Layer-supplied options: ``num_heads``, ``head_dim`` and ``dim`` are filled in by the attention
layer or model (:func:`build_for_layer`) when the class takes them and the user did not give them.
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from .base import PositionalEncoding

__all__ = [
    "available",
    "build",
    "build_for_layer",
    "format_spec",
    "get_class",
    "options",
    "parse_spec",
    "register",
]

_REGISTRY: dict[str, type[PositionalEncoding]] = {}

#: Options that the attention layer or model supplies when building an encoding.
LAYER_OPTIONS = ("num_heads", "head_dim", "dim")


def register(name: str):
    """Class decorator: register an encoding under ``name`` (lower-case, no ``:`` or ``,``)."""
    if not name or any(c in name for c in ":,= ") or name != name.lower():
        raise ValueError(f"invalid encoding name {name!r}: use lower-case letters, digits, '_' or '-'")

    def decorator(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(
                f"encoding name {name!r} is already registered by {_REGISTRY[name].__qualname__}"
            )
        if not issubclass(cls, PositionalEncoding):
            raise TypeError(f"@register({name!r}) needs a PositionalEncoding subclass, got {cls!r}")
        cls.name = name
        if not cls.description:
            cls.description = (inspect.getdoc(cls) or "").split("\n")[0]
        _REGISTRY[name] = cls
        _wrap_init(cls)
        return cls

    return decorator


def _wrap_init(cls: type[PositionalEncoding]) -> None:
    """Record the options an instance was built with, so ``config()``/``spec()`` can rebuild it."""
    original = cls.__init__
    if getattr(original, "_posenc_records_config", False):
        return
    signature = inspect.signature(original)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if type(self) is cls:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            self._config = {k: v for k, v in bound.arguments.items() if k != "self" and k != "kwargs"}

    __init__._posenc_records_config = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    __init__.__doc__ = original.__doc__
    cls.__init__ = __init__  # type: ignore[method-assign]


def _load_builtin() -> None:
    from . import encodings  # noqa: F401  (importing registers every family)


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
    """The typed options of encoding ``name`` (its ``__init__`` parameters)."""
    cls = get_class(name)
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    params = inspect.signature(init).parameters
    return {
        k: p for k, p in params.items() if k != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def _type_hints(cls: type) -> dict[str, Any]:
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    module = inspect.getmodule(init)
    return typing.get_type_hints(init, globalns=vars(module) if module else None)


# ---------------------------------------------------------------------------- spec strings


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"name:key=value,key=value"`` into the name and the raw (string) options.

    List values use ``|`` as separator (``mrope_section=16|24|24``).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"encoding spec must be a non-empty string, got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    raw: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad option {item!r} in spec {spec!r}: expected key=value")
        key = key.strip()
        if key in raw:
            raise ValueError(f"option {key!r} given twice in spec {spec!r}")
        raw[key] = value.strip()
    return name.strip(), raw


def format_spec(name: str, config: dict[str, Any]) -> str:
    """Inverse of :func:`parse_spec` for options with scalar, list or None values."""
    parts = []
    for key, value in config.items():
        if isinstance(value, dict):
            continue  # dict options (rope_parameters) have no spec-string form
        if isinstance(value, (list, tuple)):
            value = "|".join(str(v) for v in value)
        parts.append(f"{key}={value}")
    return name + (":" + ",".join(parts) if parts else "")


def _coerce(name: str, option: str, value: Any, annotation: Any) -> Any:
    """Convert ``value`` (a string from a spec, or a Python value) to ``annotation``; ValueError if impossible."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return value
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = get_args(annotation)
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        # Try the non-None members in order, strings last so "1" becomes an int where allowed.
        ordered = sorted((a for a in args if a is not type(None)), key=lambda a: a is str)
        for arg in ordered:
            try:
                return _coerce(name, option, value, arg)
            except ValueError:
                continue
        raise ValueError(f"{name}: option {option!r} got {value!r}, expected {_type_name(annotation)}")
    if origin is Literal:
        choices = get_args(annotation)
        if value in choices:
            return value
        raise ValueError(
            f"{name}: option {option!r} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}"
            f"{_suggest(str(value), [str(c) for c in choices])}"
        )
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        item_type = (get_args(annotation) or (Any,))[0]
        if isinstance(value, str):
            items = [v for v in value.split("|") if v != ""]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise ValueError(f"{name}: option {option!r} must be a list, got {value!r}")
        return [_coerce(name, option, v, item_type) for v in items]
    if origin is dict or annotation is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ValueError(f"{name}: option {option!r} must be a dict, got {value!r}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{name}: option {option!r} must be a bool, got {value!r}")
    if annotation is int:
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
    if annotation is float:
        if isinstance(value, bool):
            raise ValueError(f"{name}: option {option!r} must be a float, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{name}: option {option!r} must be a float, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{name}: option {option!r} must be a str, got {value!r}")
    return value


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def resolve_options(name: str, given: dict[str, Any], *, layer_fills: bool = False) -> dict[str, Any]:
    """Check ``given`` against encoding ``name``'s signature and coerce every value to its type.

    ``layer_fills``: the caller (an attention layer) supplies ``num_heads``/``head_dim``/``dim``,
    so they may be missing here.
    """
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
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in resolved]
    if layer_fills:
        missing = [k for k in missing if k not in LAYER_OPTIONS]
    if missing:
        from_layer = [m for m in missing if m in LAYER_OPTIONS]
        hint = (
            f" ({', '.join(from_layer)} is filled in by an attention layer; give it to build the encoding on its own)"
            if from_layer
            else ""
        )
        raise ValueError(f"{name}: missing required option(s) {', '.join(repr(m) for m in missing)}{hint}")
    return resolved


def build(spec: str | PositionalEncoding, /, **options_: Any) -> PositionalEncoding:
    """Build an encoding from a name or spec string plus keyword options.

    >>> enc = build("t5", num_heads=8, num_buckets=32, max_distance=128, bidirectional=True)
    >>> enc = build("rope:base=500000")  # head_dim is set by the first layer that takes it

    A :class:`PositionalEncoding` instance is returned as it is (options must then be empty).
    Raises ``ValueError`` for unknown names, unknown options, and values of the wrong type.
    """
    if isinstance(spec, PositionalEncoding):
        if options_:
            raise ValueError(f"options {sorted(options_)} given with an already built encoding {spec.name!r}")
        return spec
    name, raw = parse_spec(spec)
    overlap = set(raw) & set(options_)
    if overlap:
        raise ValueError(f"{name}: option(s) {sorted(overlap)} given both in the spec string and as keywords")
    resolved = resolve_options(name, {**raw, **options_})
    return get_class(name)(**resolved)


def build_for_layer(
    spec: str | PositionalEncoding | None, *, num_heads: int, head_dim: int, dim: int, **extra: Any
) -> PositionalEncoding:
    """Build an encoding for an attention layer, filling in ``num_heads``/``head_dim``/``dim``.

    A layer option given in the spec must agree with the layer (``ValueError`` naming it otherwise).
    ``None`` means ``"nope"``.
    """
    if spec is None:
        spec = "nope"
    supplied = {"num_heads": num_heads, "head_dim": head_dim, "dim": dim}
    if isinstance(spec, PositionalEncoding):
        for key, value in supplied.items():
            have = spec.config().get(key)
            if have is not None and have != value:
                raise ValueError(
                    f"{spec.name}: encoding was built with {key}={have} but the layer has {key}={value}"
                )
        return spec
    name, raw = parse_spec(spec)
    params = options(name)
    resolved = resolve_options(name, {**raw, **extra}, layer_fills=True)
    for key, value in supplied.items():
        if key not in params:
            continue
        if key in resolved and resolved[key] != value:
            raise ValueError(f"{name}: spec sets {key}={resolved[key]} but the layer has {key}={value}")
        resolved[key] = value
    return get_class(name)(**resolved)
