"""The repository explains itself: code and tests point into docs/, and every pointer resolves.

A pointer is ``docs/<file>.md §N`` (in code and tests) or ``<file>.md §N`` (between the documents,
``../<file>.md §N`` from a subfolder of docs/), optionally followed by more sections
(``docs/conventions.md §4.2 and §4.3``). It must name a file that exists and a numbered heading
(``## 4.``, ``### 4.2``) that exists in it. Notes that live outside the repository must not be named
at all. docs/ is a MkDocs site: every page is in ``mkdocs.yml``'s nav, and the nav names no page
that is missing (``mkdocs build --strict`` checks the same in CI, where the docs extra is installed).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/architecture.md", "docs/conventions.md", "CONTRIBUTING.md")
# Spelled in two pieces so that this file does not name them itself.
OUTSIDE_NOTES = re.compile(r"\b(?:REFERENCE|DESIGN)\.md\b", re.IGNORECASE)
SECTION = r"§\d+(?:\.\d+)*"
POINTER = re.compile(rf"((?:docs/|(?:\.\./)+)?[\w-]+\.md)\s+({SECTION}(?:(?:,\s*|\s+and\s+){SECTION})*)")
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)
SKIP_DIRS = {"__pycache__", ".pytest_cache"}


def _text_files(folder: str) -> list[Path]:
    files = []
    for path in sorted((ROOT / folder).rglob("*")):
        parts = set(path.relative_to(ROOT).parts)
        if path.is_file() and not parts & SKIP_DIRS and not any(p.endswith(".egg-info") for p in parts):
            files.append(path)
    return files


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="ignore")


def sections_of(markdown: str) -> set[str]:
    """The numbers of the numbered headings of a markdown text (``## 4.`` gives ``"4"``)."""
    return set(HEADING.findall(markdown))


def broken_pointers(text: str, source: Path) -> list[str]:
    """Every pointer in ``text`` whose file or section does not exist, as readable messages.

    ``docs/x.md`` is relative to the repository root; a bare ``x.md`` to the folder of ``source``.
    """
    problems = []
    for match in POINTER.finditer(text):
        name, sections = match.group(1), re.findall(r"§(\d+(?:\.\d+)*)", match.group(2))
        target = ROOT / name if name.startswith("docs/") else source.parent / name
        if not target.is_file():
            problems.append(f"{source.relative_to(ROOT)}: {name} does not exist")
            continue
        known = sections_of(_read(target))
        problems += [
            f"{source.relative_to(ROOT)}: {name} has no section §{s}" for s in sections if s not in known
        ]
    return problems


def test_the_documents_exist_and_the_readme_links_them():
    readme = _read(ROOT / "README.md")
    for doc in DOCS:
        assert (ROOT / doc).is_file(), f"{doc} is missing"
        assert f"({doc})" in readme, f"README.md does not link {doc}"


@pytest.mark.parametrize("folder", ["src", "tests"])
def test_no_file_names_notes_outside_the_repository(folder):
    offenders = [
        f"{path.relative_to(ROOT)}:{line_no}"
        for path in _text_files(folder)
        for line_no, line in enumerate(_read(path).splitlines(), start=1)
        if OUTSIDE_NOTES.search(line)
    ]
    assert not offenders, "point at docs/ instead: " + ", ".join(offenders)


@pytest.mark.parametrize("folder", ["src", "tests"])
def test_every_docs_pointer_in_code_and_tests_resolves(folder):
    found, problems = 0, []
    for path in _text_files(folder):
        text = _read(path)
        found += len(POINTER.findall(text))
        problems += broken_pointers(text, path)
    assert found > 0, f"no docs/<file>.md §N pointer found under {folder}/: is the pattern still right?"
    assert not problems, "\n".join(problems)


def _site_pages() -> list[str]:
    return sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))


def test_pointers_between_the_documents_resolve():
    problems = []
    documents = {*DOCS, "README.md", *(f"docs/{page}" for page in _site_pages())}
    for doc in sorted(documents):
        problems += broken_pointers(_read(ROOT / doc), ROOT / doc)
    assert not problems, "\n".join(problems)


def nav_pages(mkdocs_yml: str) -> list[str]:
    """The pages ``mkdocs.yml``'s nav names (``- Title: page.md`` or ``- page.md``), in order."""
    nav = mkdocs_yml[mkdocs_yml.index("\nnav:") :]
    return re.findall(r"^\s+-\s+(?:[^:\n]+:\s+)?([\w/.-]+\.md)\s*$", nav, re.MULTILINE)


def test_every_page_of_the_site_is_in_the_nav_and_the_nav_names_no_missing_page():
    listed = nav_pages(_read(ROOT / "mkdocs.yml"))
    pages = _site_pages()
    assert {"index.md", "encodings/index.md", "reference/layers.md"} <= set(pages)
    assert sorted(set(pages) - set(listed)) == [], "pages left out of mkdocs.yml's nav"
    assert sorted(set(listed) - set(pages)) == [], "the nav names pages that do not exist"
    assert len(listed) == len(set(listed)), "a page listed twice"


def test_the_nav_reader_reads_titled_and_bare_entries():
    yml = (
        "site_name: x\nnav:\n  - Home: index.md\n  - Part:\n      - part/index.md\n      - A b: part/a-b.md\n"
    )
    assert nav_pages(yml) == ["index.md", "part/index.md", "part/a-b.md"]


def test_the_checker_reports_a_missing_section_and_a_missing_file():
    source = ROOT / "tests" / "example.py"
    s = "\N{SECTION SIGN}"  # spelled out so that the pointers below are not this file's own
    text = f"see docs/conventions.md {s}4.2 and {s}99.1; docs/nowhere.md {s}1; docs/conventions.md {s}4.3."
    assert broken_pointers(text, source) == [
        "tests/example.py: docs/conventions.md has no section §99.1",
        "tests/example.py: docs/nowhere.md does not exist",
    ]
    page = ROOT / "docs" / "encodings" / "example.md"  # a page in a subfolder points up
    assert broken_pointers(f"../conventions.md {s}4.2; conventions.md {s}4.2", page) == [
        "docs/encodings/example.md: conventions.md does not exist"
    ]
    assert {"1", "4", "4.2", "7.5.3"} <= sections_of(_read(ROOT / "docs" / "conventions.md"))
    assert OUTSIDE_NOTES.search("see " + "REFERENCE" + ".md §4") and not OUTSIDE_NOTES.search("the reference")


def test_the_docs_extra_installs_a_formatter_for_the_api_signatures():
    """Issue 62 item 10: without black or ruff, mkdocstrings prints every signature of the API
    reference as one unwrapped line (``separate_signature`` formats with whichever is installed)."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    docs = pyproject["project"]["optional-dependencies"]["docs"]
    assert any(requirement.startswith(("ruff", "black")) for requirement in docs), docs
    assert "separate_signature: true" in (ROOT / "mkdocs.yml").read_text()


def test_every_doctest_example_sits_in_an_examples_section():
    """Issue 62 item 10: a ``>>>`` line outside an ``Examples:`` section renders as a run-together
    Markdown quote in the API reference; inside one, mkdocstrings shows it as code."""
    import ast

    misplaced = []
    for path in sorted((ROOT / "src" / "posenc").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node, clean=True)
            if not doc or ">>>" not in doc:
                continue
            section = None
            for line in doc.splitlines():
                if line and not line.startswith(" "):
                    section = line.rstrip(":") if line.endswith(":") else None
                if line.lstrip().startswith(">>>") and section != "Examples":
                    misplaced.append(f"{path.relative_to(ROOT)}: {line.strip()[:40]}")
    assert misplaced == []
