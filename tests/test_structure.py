"""The source's shape: no function in ``src/posenc`` longer than :data:`MAX_FUNCTION_LINES` lines,
nor more complex than :data:`MAX_COMPLEXITY`.

A function's length is its ``def`` line (decorators aside) through its last line, signature and
docstring included. Its cyclomatic complexity is counted as radon counts it (``radon cc``, the
measure issue 47 set the target in; :func:`complexity`). ruff's C90 rule (``max-complexity = 25``
in pyproject.toml) counts fewer decision points (not boolean operators, comprehensions or
if-expressions), so it passes functions this test refuses.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import posenc

#: The longest a function in src/posenc may be, in lines.
MAX_FUNCTION_LINES = 80

#: The most cyclomatic complexity (radon's count) a function in src/posenc may have.
MAX_COMPLEXITY = 25

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


# ---------------------------------------------------------------------------- cyclomatic complexity


def _match_cases(node: ast.Match) -> int:
    """A ``match`` counts its cases but the catch-all one (``case _:`` or a bare capture)."""
    catch_all = any(
        isinstance(case.pattern, ast.MatchAs) and case.pattern.pattern is None for case in node.cases
    )
    return max(0, len(node.cases) - catch_all)


_TRIES = tuple(getattr(ast, name) for name in ("Try", "TryStar") if hasattr(ast, name))


def _decisions(node: ast.AST) -> int:
    """The decision points of ``node`` and the nodes inside it, as radon's ``ComplexityVisitor`` counts
    them: ``if``/``elif`` and if-expressions 1; ``for``/``while`` 1, and 1 more with an ``else``;
    ``try`` 1 per ``except`` and 1 for its ``else``; a boolean operator 1 per operand past the first;
    a comprehension's ``for`` 1 and each of its ``if``\\ s 1; ``match`` 1 per case but a catch-all
    one; ``assert`` 1 (and, as radon, nothing inside it). A nested function or class is a block of
    its own, not counted here; a lambda's body counts for the function around it. ``with``,
    ``return``, ``break``, ``continue`` and ``raise`` count nothing."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return 0
    if isinstance(node, ast.Assert):
        return 1
    if isinstance(node, (ast.If, ast.IfExp)):
        own = 1
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
        own = 1 + bool(node.orelse)
    elif isinstance(node, _TRIES):
        own = len(node.handlers) + bool(node.orelse)
    elif isinstance(node, ast.BoolOp):
        own = len(node.values) - 1
    elif isinstance(node, ast.comprehension):
        own = 1 + len(node.ifs)
    elif isinstance(node, ast.Match):
        own = _match_cases(node)
    else:
        own = 0
    return own + sum(_decisions(child) for child in ast.iter_child_nodes(node))


def complexity(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """``function``'s cyclomatic complexity: 1 + the decision points of its body (its decorators,
    defaults and annotations aside, as radon does)."""
    return 1 + sum(_decisions(statement) for statement in function.body)


def complex_functions(text: str, where: str, limit: int = MAX_COMPLEXITY) -> list[str]:
    """``"where:qualified.name (complexity N)"`` for every function and method of the Python source
    ``text`` whose :func:`complexity` exceeds ``limit``, nested ones included."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and (count := complexity(child)) > limit:
                    found.append(f"{where}:{name} (complexity {count})")
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(text), "")
    return found


def test_no_function_in_src_is_too_complex():
    files = sorted(SOURCE.rglob("*.py"))
    assert len(files) > 100
    found = [
        hit
        for path in files
        for hit in complex_functions(path.read_text(encoding="utf-8"), str(path.relative_to(SOURCE)))
    ]
    assert not found, (
        f"functions of cyclomatic complexity over {MAX_COMPLEXITY} as radon counts it (split each into "
        "named steps, or make a branchy one table-driven): " + "; ".join(found)
    )


def _complexity_of(source: str) -> int:
    (function,) = ast.parse(textwrap.dedent(source)).body
    assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
    return complexity(function)


def test_the_counter_counts_each_decision_as_radon_does():
    # Hand-counted: 1 for the function, then one line per construct.
    source = """
        @decorated(1 if a else 2)                   # decorators: not counted
        def f(x, y=(1 if b else 2)):                # defaults: not counted
            if x and y or z:                        # if 1, `and` 1, `or` 1            -> 3
                pass
            elif x:                                 # elif 1                           -> 1
                pass
            else:
                pass
            for i in range(3):                      # for 1, its else 1                -> 2
                break
            else:
                pass
            while x:                                # while 1                          -> 1
                x -= 1
            try:                                    # two excepts 2, else 1            -> 3
                pass
            except ValueError:
                pass
            except (KeyError, TypeError):
                pass
            else:
                pass
            finally:
                pass
            v = [a for a in x if a if not a]        # comprehension 1, its ifs 2       -> 3
            w = {k: j for k in x for j in k}        # two fors                         -> 2
            u = 1 if x else 2                       # if-expression                    -> 1
            g = lambda q: q or 0                    # a lambda's body counts: `or`     -> 1
            assert x and y                          # assert 1, nothing inside it      -> 1
            with open(x) as handle:                 # with: not counted
                pass
            match x:                                # three cases, one a catch-all     -> 2
                case 1:
                    pass
                case [a, *_] if a or y:             # the guard's `or`                 -> 1
                    pass
                case _:
                    pass

            def inner():                            # a block of its own: not counted
                if x:
                    pass

            class Inner:                            # likewise
                def method(self):
                    return x if y else z
            return x
    """
    source = "\n".join(line.split("#")[0].rstrip() for line in textwrap.dedent(source).splitlines())
    assert _complexity_of(source) == 1 + 3 + 1 + 2 + 1 + 3 + 3 + 2 + 1 + 1 + 1 + 2 + 1  # 22
    tree = ast.parse(source)
    nested = {n.name: complexity(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert nested == {"f": 22, "inner": 2, "method": 2}


def test_the_checker_names_each_function_over_the_limit():
    source = textwrap.dedent(
        """
        def simple(x):
            return x

        def branchy(x):
            if x:
                return 1
            elif x > 1:
                return 2
            return 3 if x else 4

        class Holder:
            def method(self, x):
                return [y for y in x if y and self]
        """
    )
    assert complex_functions(source, "m.py", limit=3) == [
        "m.py:branchy (complexity 4)",
        "m.py:Holder.method (complexity 4)",
    ]
    assert complex_functions(source, "m.py", limit=4) == []
