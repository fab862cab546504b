"""Print ``name==floor`` for every ranged requirement of a pyproject extra (CI's oldest environment).

Usage: python .ci/floors.py EXTRA [PACKAGE ...]   (only those packages when given)
The floor is the ``>=`` bound the extra declares; a requirement without one is an error, since CI
could not test the oldest release it admits.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
extra, wanted = sys.argv[1], set(sys.argv[2:])
pins = []
for requirement in pyproject["project"]["optional-dependencies"][extra]:
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
    if wanted and name not in wanted:
        continue
    floor = re.search(r">=\s*([0-9][0-9.]*)", requirement)
    if floor is None:
        sys.exit(f"floors.py: {extra} requirement {requirement!r} declares no >= floor")
    pins.append(f"{name}=={floor.group(1)}")
print(" ".join(pins))
