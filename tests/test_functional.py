"""``posenc.functional`` re-exports exactly the functions each family module lists in ``__functional__``."""

from __future__ import annotations

import posenc.functional as F
from posenc.encodings import FAMILY_MODULES


def test_functional_exports_exactly_every_family_functional_list():
    listed = {name: module for module in FAMILY_MODULES for name in getattr(module, "__functional__", ())}
    declared = sum(len(getattr(module, "__functional__", ())) for module in FAMILY_MODULES)
    assert len(listed) == declared, "a function name is listed by two family modules"
    missing = sorted(set(listed) - set(F.__all__))
    assert not missing, f"posenc.functional does not import {missing}: add them to src/posenc/functional.py"
    extra = sorted(set(F.__all__) - set(listed))
    assert not extra, f"posenc.functional exports {extra}, which no family lists in __functional__"
    assert len(F.__all__) == len(set(F.__all__))
    for name, module in listed.items():
        assert getattr(F, name) is getattr(module, name), f"F.{name} is not {module.__name__}.{name}"
