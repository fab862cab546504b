"""Print ``name==floor`` for every ranged requirement of a pyproject extra (CI's oldest environment).

Usage: python .ci/floors.py EXTRA [PACKAGE ...]   (only those packages when given)
       python .ci/floors.py --range PACKAGE       (a core dependency's range: ``>=2.12,<2.16``)
       python .ci/floors.py --floor PACKAGE       (its floor: ``2.12``)
The floor is the ``>=`` bound the extra declares; a requirement without one is an error, since CI
could not test the oldest release it admits.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)


def _floor(requirement: str, where: str) -> str:
    floor = re.search(r">=\s*([0-9][0-9.]*)", requirement)
    if floor is None:
        sys.exit(f"floors.py: {where} requirement {requirement!r} declares no >= floor")
    return floor.group(1)


if sys.argv[1] in ("--range", "--floor"):
    package = sys.argv[2]
    (requirement,) = [r for r in pyproject["project"]["dependencies"] if _name(r) == package]
    floor = _floor(requirement, "core")
    print(requirement[len(package) :].strip() if sys.argv[1] == "--range" else floor)
    sys.exit(0)

extra, wanted = sys.argv[1], set(sys.argv[2:])
pins = []
for requirement in pyproject["project"]["optional-dependencies"][extra]:
    name = _name(requirement)
    if wanted and name not in wanted:
        continue
    pins.append(f"{name}=={_floor(requirement, extra)}")
print(" ".join(pins))
