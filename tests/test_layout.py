"""The repository's layout, guarded: no import cycle inside ``src/posenc`` (imports inside functions
counted, ``if TYPE_CHECKING:`` blocks not: they never run), no source file over :data:`MAX_FILE_LINES`
lines, no folder but ``encodings/`` (one family per file) holding more than :data:`MAX_MODULES`
modules, and no path in ``docs/``, the README or CONTRIBUTING that does not exist.

Each checker is a function of a tree, tested on a small tree written here, so a guard that stopped
seeing what it guards would fail too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import posenc

MAX_FILE_LINES = 600
MAX_MODULES = 15
#: Folders that may hold more modules: one encoding family per file is the house rule there.
MANY_MODULES = ("encodings",)

SOURCE = Path(posenc.__file__).resolve().parent
ROOT = SOURCE.parent.parent


# ---------------------------------------------------------------------------- import cycles
def _module_names(package: Path) -> dict[str, Path]:
    """Dotted module names (the package's own name first) of every ``.py`` file under ``package``."""
    names = {}
    for path in package.rglob("*.py"):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, in functions too, but not those under ``if TYPE_CHECKING:``."""
    found, skipped = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
            found.append(node)
    return found


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, names: dict) -> list[str]:
    """The modules an import statement loads: ``from . import a, b`` of submodules loads those (not
    the package's ``__init__`` as an edge of its own), ``from .x import name`` loads ``x``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[: len(base) - node.level + 1]
        target = ".".join([*base, *([node.module] if node.module else [])])
    else:
        target = node.module or ""
    submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in names]
    return submodules if len(submodules) == len(node.names) else [target, *submodules]


def import_graph(package: Path) -> dict[str, set[str]]:
    """``module -> the package's modules it imports``, read from the source (nothing imported)."""
    names = _module_names(package)
    graph = {}
    for module, path in names.items():
        edges = set()
        for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            for target in _targets(module, path.name == "__init__.py", node, names):
                while target and target not in names:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycle_in_src():
    cycles = import_cycles(import_graph(SOURCE))
    assert cycles == [], f"import cycles (imports in functions counted): {cycles}"


def mutual_rooms(graph: dict[str, set[str]], package: str) -> list[tuple[str, str]]:
    """The pairs of rooms directly inside ``package`` (a sub-package, or a module at its top) that
    import each other, in either direction through any of their modules."""
    prefix = package + "."

    def room(module: str) -> str | None:
        return module[len(prefix) :].split(".")[0] if module.startswith(prefix) else None

    edges = {(room(a), room(b)) for a, targets in graph.items() for b in targets}
    edges = {(a, b) for a, b in edges if a and b and a != b}
    return sorted({tuple(sorted((a, b))) for a, b in edges if (b, a) in edges})


def test_the_rooms_of_experiments_import_one_way():
    """Inside experiments/ the folders follow a call: no two rooms (runtime, results, study, cluster,
    grid, plan, ...) import each other."""
    assert mutual_rooms(import_graph(SOURCE), "posenc.experiments") == []


def test_the_room_checker_finds_two_rooms_that_import_each_other(tmp_path):
    package = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "a/__init__.py": "",
            "a/one.py": "from ..b import two\n",
            "b/__init__.py": "",
            "b/two.py": "def f():\n    from ..a import one\n",
            "c.py": "from .a import one\n",
        },
    )
    graph = {k.replace(package.name, "pkg", 1): v for k, v in import_graph(package).items()}
    assert mutual_rooms(graph, "pkg") == [("a", "b")]


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_cycle_checker_counts_imports_in_functions_and_not_type_checking(tmp_path):
    package = _tree(
        tmp_path,
        {
            "__init__.py": "from . import a, b\n",
            "a.py": "from .b import thing\n",
            "b.py": "def f():\n    from .a import other\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import x\n",
            "d.py": "from .c import y\n",
            "sub/__init__.py": "def f():\n    from .page import render\n",
            "sub/page.py": "def g():\n    from . import FAMILIES\n",
        },
    )
    graph = import_graph(package)
    assert graph["pkg"] == {"pkg.a", "pkg.b"}  # from . import a, b: the submodules only
    assert import_cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.sub", "pkg.sub.page"]]


# ---------------------------------------------------------------------------- sizes
def long_files(package: Path, limit: int = MAX_FILE_LINES) -> list[str]:
    """``path: lines`` of every ``.py`` file under ``package`` longer than ``limit`` lines."""
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(package.parent)}: {lines}")
    return found


def crowded_folders(package: Path, limit: int = MAX_MODULES, allowed: tuple = MANY_MODULES) -> list[str]:
    """``folder: modules`` of every folder under ``package`` (but ``allowed``) holding more than
    ``limit`` modules (``__init__.py`` not counted)."""
    found = []
    for folder in sorted({p.parent for p in package.rglob("*.py")}):
        if folder.name in allowed:
            continue
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > limit:
            found.append(f"{folder.relative_to(package.parent)}: {len(modules)}")
    return found


def test_no_source_file_is_over_the_limit():
    assert long_files(SOURCE) == [], f"split these files (over {MAX_FILE_LINES} lines)"


def test_no_folder_holds_more_modules_than_the_limit():
    assert crowded_folders(SOURCE) == [], f"split these folders (over {MAX_MODULES} modules)"


def test_the_size_checkers_name_what_is_over(tmp_path):
    files = {"__init__.py": "", "big.py": "x = 1\n" * 7, "small.py": "x = 1\n"}
    files |= {f"many/m{i}.py": "" for i in range(4)} | {"many/__init__.py": "", "encodings/e0.py": ""}
    files |= {f"encodings/e{i}.py": "" for i in range(4)}
    package = _tree(tmp_path, files)
    assert long_files(package, limit=6) == ["pkg/big.py: 7"]
    assert crowded_folders(package, limit=3) == ["pkg/many: 4"]


# ---------------------------------------------------------------------------- paths in the docs
#: The first folders of a path the docs may name (the repository's, and the package's own).
_FIRST = (
    r"(?:src/posenc|tests|docs|benchmarks|scripts|examples|\.ci|"
    + "|".join(sorted(p.name for p in SOURCE.iterdir() if p.is_dir() and not p.name.startswith("_")))
    + ")"
)
_PATH = re.compile(rf"(?<![\w./-])({_FIRST}/[\w./<>-]*[\w>])")


def missing_paths(text: str, roots: list[Path]) -> list[str]:
    """The repository paths ``text`` names that exist under none of ``roots``; a path with a
    placeholder (``tests/encodings/test_<family>.py``) must have its folder."""
    missing = []
    for match in _PATH.finditer(text):
        path = re.split(r"[:#]", match.group(1))[0].rstrip(".")
        if "<" in path:
            path = path[: path.index("<")].rpartition("/")[0]
        if not any((root / path).exists() or (root / f"{path}.py").exists() for root in roots):
            missing.append(match.group(1))
    return missing


def _documents() -> list[Path]:
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]


@pytest.mark.parametrize("document", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_names_exists(document):
    roots = [document.parent, ROOT, ROOT / "src", SOURCE]
    assert missing_paths(document.read_text(encoding="utf-8"), roots) == []


def test_the_path_checker_finds_a_moved_file(tmp_path):
    (tmp_path / "backends" / "parts").mkdir(parents=True)
    (tmp_path / "backends" / "parts" / "exact.py").write_text("")
    text = (
        "See `backends/parts/exact.py`, `backends/_exact.py` and `tests/test_<family>.py`; src/sbatch/opt.c."
    )
    assert missing_paths(text, [tmp_path]) == ["backends/_exact.py", "tests/test_<family>.py"]
