"""The source's shape: no function in ``src/posenc`` longer than :data:`MAX_FUNCTION_LINES` lines.

A function's length is its ``def`` line (decorators aside) through its last line, signature and
docstring included. Cyclomatic complexity has its own gate: ruff's C90 rule with
``max-complexity = 25`` (pyproject.toml), run by ``ruff check src tests``.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import posenc

#: The longest a function in src/posenc may be, in lines.
MAX_FUNCTION_LINES = 80

SOURCE = Path(posenc.__file__).resolve().parent


def long_functions(text: str, where: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``"where:qualified.name (N lines)"`` for every function and method of the Python source
    ``text`` longer than ``limit`` lines, nested ones included."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1
                    if lines > limit:
                        found.append(f"{where}:{name} ({lines} lines)")
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(text), "")
    return found


def test_no_function_in_src_is_over_the_limit():
    files = sorted(SOURCE.rglob("*.py"))
    assert len(files) > 100  # the package itself, not an installed stub
    found = [
        hit
        for path in files
        for hit in long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(SOURCE)))
    ]
    assert not found, (
        f"functions over {MAX_FUNCTION_LINES} lines (split each into named steps): " + "; ".join(found)
    )


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}():\n{body}"


def test_the_checker_names_each_long_function_with_its_length():
    # A function of 1 + 80 lines, a method of 1 + 81, a nested one of 1 + 85 inside a short-bodied
    # outer one (whose own length then exceeds the limit too), and a function of exactly 80 lines.
    source = (
        _function("too_long", 80)
        + "class Holder:\n"
        + _function("method", 81, indent="    ")
        + "def outer():\n"
        + _function("inner", 85, indent="    ")
        + _function("just_fits", 79)
    )
    assert long_functions(source, "m.py") == [
        "m.py:too_long (81 lines)",
        "m.py:Holder.method (82 lines)",
        "m.py:outer (87 lines)",
        "m.py:outer.inner (86 lines)",
    ]


def test_the_checker_counts_signature_and_docstring_not_decorators():
    source = textwrap.dedent(
        '''
        @decorator
        @other
        def command(
            a=1,
            b=2,
        ):
            """Doc
            string."""
            return a + b
        '''
    )
    assert long_functions(source, "c.py", limit=6) == ["c.py:command (7 lines)"]
    assert long_functions(source, "c.py", limit=7) == []
