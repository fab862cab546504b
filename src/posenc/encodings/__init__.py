"""Encoding families, one file each, and what every family is built from: the base classes
(:mod:`.base`), what an encoding offers the backends (:mod:`.offers`), spec strings (:mod:`.spec`) and the
registry that builds a family from one (:mod:`.registry`). Importing this package registers every family.

Each family module lists the pure functions it exports to :mod:`posenc.functional` in ``__functional__``.
"""

from __future__ import annotations

import importlib
import pkgutil

#: The modules every family is built from: no family of their own.
FOUNDATIONS = ("base", "offers", "registry", "spec")

FAMILY_MODULES = [
    importlib.import_module(f"{__name__}.{info.name}")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
    if not info.name.startswith("_") and info.name not in FOUNDATIONS
]
