"""Pure functions of every encoding family (the math, no state).

Collected from each family module's ``__functional__`` list, e.g. ``F.t5_bucket``,
``F.alibi_slopes``, ``F.sinusoidal``, ``F.rope_inv_freq``, ``F.apply_rope``,
``F.deberta_log_bucket``.
"""

from __future__ import annotations

from .encodings import FAMILY_MODULES

__all__: list[str] = []
_name = ""
for _module in FAMILY_MODULES:
    for _name in getattr(_module, "__functional__", ()):
        if _name in globals():
            raise ImportError(f"functional name {_name!r} exported twice (second by {_module.__name__})")
        globals()[_name] = getattr(_module, _name)
        __all__.append(_name)
del _module, _name
