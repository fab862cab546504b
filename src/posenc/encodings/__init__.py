"""Encoding families, one file each. Importing this package registers every family.

Each module lists the pure functions it exports to :mod:`posenc.functional` in ``__functional__``.
"""

from __future__ import annotations

import importlib
import pkgutil

FAMILY_MODULES = [
    importlib.import_module(f"{__name__}.{info.name}")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
    if not info.name.startswith("_")
]
