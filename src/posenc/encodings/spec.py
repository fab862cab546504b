"""Spec strings (``"rope:base=500000,scaling=yarn"``) and the parsed :class:`Spec`.

The grammar, in one place (every entry point reads a spec string through these functions):

- one encoding (or layer preset): ``name:key=value,key=value``; list values joined by ``|``
  (``mrope_section=16|24|24``): :func:`parse_spec`, :func:`format_spec`;
- a hybrid, one spec per layer joined by ``/`` (``t5/sinusoidal``): :func:`split_layers`;
- a comma-separated list of specs, options included (``nope,rope:base=500000,pairing=half``):
  an item ``key=value`` continues the previous spec's options: :func:`split_specs`.

A spec string is parsed once: :func:`posenc.encodings.registry.resolve` turns it into a :class:`Spec`, the
encoding's class plus its options checked and coerced against the class's typed ``__init__``.
Everything downstream (the attention layer, the model, the plots) reads the :class:`Spec`, never
the string again.

This module imports nothing from the rest of posenc, so the base class and the registry can
both use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["LAYER_SEPARATOR", "Spec", "format_spec", "parse_spec", "split_layers", "split_specs"]

#: Separates the per-layer specs of a hybrid: ``"t5/sinusoidal"``.
LAYER_SEPARATOR = "/"


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"name:key=value,key=value"`` into the name and the raw (string) options.

    List values use ``|`` as separator (``mrope_section=16|24|24``).

    Raises:
        ValueError: an empty spec, an item without ``=``, or an option given twice.
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


def split_layers(text: str) -> list[str]:
    """``"t5/sinusoidal"`` -> ``["t5", "sinusoidal"]``: the per-layer specs of a hybrid (one item
    for a single spec)."""
    return [layer.strip() for layer in text.split(LAYER_SEPARATOR)]


def split_specs(text: str) -> list[str]:
    """Split ``"nope,rope:base=500000,pairing=half,alibi"`` into specs.

    An item of the form ``key=value`` (no ``:``) continues the previous spec's options.
    """
    specs: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item.split("=")[0] and specs:
            specs[-1] += ("," if ":" in specs[-1] else ":") + item
        else:
            specs.append(item)
    return specs


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


@dataclass(frozen=True)
class Spec:
    """A parsed spec: the registered class and its options, already coerced to their types.

    Build one with :func:`posenc.encodings.registry.resolve`; ``str(spec)`` gives the spec string back.
    ``cls`` is a registered :class:`~posenc.encodings.base.PositionalEncoding` subclass, typed ``type``
    here: the base class formats its spec through this module, which therefore imports nothing of it.
    """

    cls: type
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))  # read-only, like the rest

    @property
    def name(self) -> str:
        """The registered name of :attr:`cls`."""
        return self.cls.name

    def __str__(self) -> str:
        return format_spec(self.name, self.options)
