"""The tables of the README and the site that list encodings or backends are complete.

Each table is compared with the registries it describes: ``posenc.available()`` with each class's
``kind`` (the kind tables, the table of references of docs/encodings/index.md, the API reference of
docs/reference/encodings.md), and the registered backends with the order ``auto`` tries them
(``posenc.backends.available_backends``, the priority lists of ``posenc.backends.dispatch``). A new
encoding or backend without a row fails here, naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import posenc
from posenc.backends import available_backends
from posenc.backends.dispatch import PRIORITY

ROOT = Path(__file__).resolve().parents[1]
KIND_PAGES = ("README.md", "docs/architecture.md", "docs/encodings/index.md")
BACKEND_PAGES = ("docs/attention.md", "docs/architecture.md")
REFERENCES = "docs/encodings/index.md"  # the table of what each encoding is checked against
API_REFERENCE = "docs/reference/encodings.md"
SPAN = re.compile(r"`([^`]+)`")


def tables(markdown: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every pipe table of ``markdown`` as ``(header cells, body rows)``; ``\\|`` stays in its cell."""
    found, header, rows = [], None, []
    for line in [*markdown.splitlines(), ""]:
        if not line.startswith("|"):
            if header is not None:
                found.append((header, rows))
            header, rows = None, []
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if header is None:
            header = [c.lower() for c in cells]
        elif not set(line) <= set("|-: "):
            rows.append(cells)
    return found


def tables_with(page: str, first: str, column: str) -> list[list[dict[str, str]]]:
    """The tables of ``page`` whose first column is ``first`` and that have a ``column``, as dicts."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return [
        [dict(zip(header, row)) for row in rows]
        for header, rows in tables(text)
        if header[0] == first and column in header
    ]


def registered_by_kind() -> dict[str, set[str]]:
    kinds: dict[str, set[str]] = {kind.value: set() for kind in posenc.Kind}
    for name in posenc.available():
        kinds[posenc.get_class(name).kind.value].add(name)
    return kinds


def encodings_named(cell: str) -> set[str]:
    """The registered names a cell spells in backticks (``rope:base=1`` names ``rope``)."""
    return {span.split(":")[0] for span in SPAN.findall(cell)} & set(posenc.available())


def kind_table_problems(rows: list[dict[str, str]]) -> list[str]:
    """How a kind table's ``families`` differ from the registry: missing, or under the wrong kind."""
    expected = registered_by_kind()
    listed = {row["kind"].lower(): encodings_named(row["families"]) for row in rows}
    problems = [f"no row for kind {kind}" for kind in expected if kind not in listed]
    for kind, names in expected.items():
        problems += [f"{name} ({kind}) is missing" for name in sorted(names - listed.get(kind, set()))]
        problems += [f"{name} is listed as {kind}" for name in sorted(listed.get(kind, set()) - names)]
    return problems


@pytest.mark.parametrize("page", KIND_PAGES)
def test_the_kind_table_lists_every_registered_encoding_under_its_kind(page):
    [rows] = tables_with(page, "kind", "families")
    assert kind_table_problems(rows) == []


def test_the_site_says_what_every_registered_encoding_is_checked_against():
    [rows] = tables_with(REFERENCES, "name", "reference it equals")
    kinds = {name: posenc.get_class(name).kind.value for name in posenc.available()}
    first_named = [(SPAN.search(row["name"]), row["kind"]) for row in rows]
    named = {m.group(1).split(":")[0]: kind for m, kind in first_named if m}
    assert sorted(set(kinds) - set(named)) == []
    wrong = [(n, kind) for n, kind in named.items() if n in kinds and kind.split(",")[0] != kinds[n]]
    assert wrong == []


@pytest.mark.parametrize("page", BACKEND_PAGES)
def test_the_backend_table_has_one_row_per_registered_backend(page):
    [rows] = tables_with(page, "backend", "serves")
    listed = [SPAN.fullmatch(row["backend"]).group(1) for row in rows]
    registered = available_backends("cpu")
    assert sorted(set(registered) - set(listed)) == [], f"{page}: registered backends without a row"
    assert sorted(set(listed) - set(registered)) == [], f"{page}: rows for backends not registered"
    assert len(listed) == len(set(listed)), f"{page}: a backend with two rows"


def test_the_priority_table_gives_the_order_auto_tries_on_each_device():
    [rows] = tables_with("docs/architecture.md", "device", "order `auto` tries")
    assert rows, "the priority table is gone"
    for row in rows:
        order = SPAN.findall(row["order `auto` tries"])
        for device in re.findall(r"\b(cpu|cuda|xpu)\b", row["device"]):
            assert order == list(PRIORITY[device]), f"{device}: the table says {order}"
    devices = {d for row in rows for d in re.findall(r"\b(cpu|cuda|xpu)\b", row["device"])}
    assert devices == set(PRIORITY)


#: An entry of the API reference: a heading that names the encoding, then the class mkdocstrings renders.
API_ENTRY = re.compile(r"^### `(?P<name>[\w-]+)`\n\n::: (?P<path>[\w.]+)$", re.MULTILINE)


def api_reference_problems(markdown: str) -> list[str]:
    """How the API reference's entries differ from the registry: missing, unknown, or the wrong class."""
    entries = {m.group("name"): m.group("path") for m in API_ENTRY.finditer(markdown)}
    problems = [f"{name} has no entry" for name in posenc.available() if name not in entries]
    for name, path in entries.items():
        if name not in posenc.available():
            problems.append(f"{name} is not registered")
            continue
        cls = posenc.get_class(name)
        if path != f"{cls.__module__}.{cls.__qualname__}":
            problems.append(
                f"{name}: the entry renders {path}, the registry builds {cls.__module__}.{cls.__qualname__}"
            )
    return problems


def test_the_api_reference_renders_every_registered_encoding_class():
    assert api_reference_problems((ROOT / API_REFERENCE).read_text(encoding="utf-8")) == []


def test_an_api_reference_without_an_encoding_or_with_the_wrong_class_fails():
    markdown = "### `rope`\n\n::: posenc.encodings.t5.T5Bias\n\n### `nothing`\n\n::: posenc.x.Y\n"
    problems = api_reference_problems(markdown)
    assert "alibi has no entry" in problems and "nothing is not registered" in problems
    assert (
        "rope: the entry renders posenc.encodings.t5.T5Bias, the registry builds posenc.encodings.rope.RoPE"
        in problems
    )


def test_a_kind_table_without_an_encoding_or_with_one_under_the_wrong_kind_fails():
    markdown = "\n".join(
        [
            "| kind | families |",
            "|---|---|",
            "| absolute | `sinusoidal`, `learned`, `nope`, `sinusoidal2d`, `rope` |",
            "| rotary | `xpos` |",
            "| bias | `t5:bidirectional=false` |",
        ]
    )
    [(header, body)] = tables(markdown)
    problems = kind_table_problems([dict(zip(header, row)) for row in body])
    assert "no row for kind content" in problems
    assert "rope (rotary) is missing" in problems and "rope is listed as absolute" in problems
    assert "alibi (bias) is missing" in problems and "t5 (bias) is missing" not in problems
