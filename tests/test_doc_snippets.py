"""Every Python block of README.md and of the documentation site runs as written, top to bottom.

The site's pages are every ``docs/**/*.md`` and the files a page includes whole (a line
``--8<-- "CONTRIBUTING.md"``, read from the repository root as ``mkdocs.yml``'s snippets do).
A reader copies the blocks of one page into one interpreter, in order: so does this test, one
namespace per file. A block that needs what a test machine cannot have (a model folder, downloaded
weights) carries an HTML comment on the line right before its fence saying why::

    <!-- no-run: needs a model folder (path/to/model is a placeholder) -->
    ```python

and is skipped, as every later block of its file that reads a name only it defines would fail;
such a block is marked the same way, with its own reason.

Examples in the prose count too: an inline code span outside the fences that calls posenc's API
with nothing but literals (`` `posenc.build("rope:base=500000")` ``) is evaluated on its own, in a
namespace holding only ``posenc`` and ``torch``. A span that names anything else (``model``,
``request``, ``N``) is a signature with placeholders, not an example, and is not run. A
self-contained span that cannot run here carries the marker right after it::

    `posenc.something(1)`<!-- no-run: why it cannot run in a test -->
"""

from __future__ import annotations

import ast
import importlib
import re
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import posenc

ROOT = Path(__file__).resolve().parents[1]
DOCS_PAGES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
# A page made of another file: `--8<-- "path"` alone on a line (pymdownx.snippets, paths from the root).
INCLUDE = re.compile(r'^--8<--\s+"(?P<path>[^"]+)"\s*$', re.MULTILINE)


def included_files(pages: list[str]) -> list[str]:
    """The files the pages include whole, each once, in the order first included."""
    found = [m.group("path") for page in pages for m in INCLUDE.finditer((ROOT / page).read_text("utf-8"))]
    return list(dict.fromkeys(found))


PAGES = ["README.md", *DOCS_PAGES, *[f for f in included_files(DOCS_PAGES) if f not in DOCS_PAGES]]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)[^\n`]*$")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(?P<reason>.*?)\s*-->\s*$")
# An inline code span (CommonMark: a run of backticks closed by a run of the same length).
# It may wrap onto the next line but never crosses a blank line (the end of a paragraph).
INLINE = re.compile(
    r"(?<!`)(?P<ticks>`+)(?!`)(?P<code>(?:(?!\n[ \t]*\n).)+?)(?<!`)(?P=ticks)(?!`)", re.DOTALL
)
NO_RUN_INLINE = re.compile(r"<!--\s*no-run:\s*(?P<reason>.*?)\s*-->")
# The only names a prose example may use: what `import torch, posenc` binds.
PROSE_NAMES = {"posenc", "torch"}


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    code: str
    no_run: str | None  # the reason given in a no-run marker, "" when the marker gives none


def code_blocks(markdown: str) -> list[Block]:
    """The fenced code blocks of ``markdown`` (indented ones inside list items too), dedented."""
    lines = markdown.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, start = match.group("fence"), i
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence)}\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        marker = NO_RUN.match(lines[start - 1]) if start > 0 else None
        blocks.append(
            Block(
                lang=match.group("lang").lower(),
                line=start + 1,
                code=textwrap.dedent("\n".join(body)),
                no_run=marker.group("reason") if marker else None,
            )
        )
    return blocks


@dataclass
class ProseCall:
    line: int  # 1-based line where the span starts
    code: str
    no_run: str | None  # the reason given in a no-run marker right after the span


def prose(markdown: str) -> str:
    """``markdown`` with every fenced block (fences included) blanked, line numbers kept."""
    out, fence = [], None
    for line in markdown.splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group("fence")
            out.append("")
        elif fence is not None:
            if re.match(rf"^[ \t]*{re.escape(fence)}\s*$", line):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def is_posenc_example(code: str) -> bool:
    """A call rooted at ``posenc`` (``posenc.a.b(...)``) whose every name is ``posenc`` or ``torch``."""
    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError:
        return False
    if not isinstance(tree.body, ast.Call):
        return False
    root = tree.body.func
    while isinstance(root, (ast.Attribute, ast.Call)):
        root = root.value if isinstance(root, ast.Attribute) else root.func
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    return isinstance(root, ast.Name) and root.id == "posenc" and names <= PROSE_NAMES


def prose_calls(markdown: str) -> list[ProseCall]:
    """The inline code spans outside fenced blocks that are self-contained calls of posenc's API."""
    text = prose(markdown)
    calls = []
    for match in INLINE.finditer(text):
        code = " ".join(match.group("code").split())  # a span that wraps reads as one line
        if not is_posenc_example(code):
            continue
        marker = NO_RUN_INLINE.match(text, match.end())
        calls.append(
            ProseCall(
                line=text.count("\n", 0, match.start()) + 1,
                code=code,
                no_run=marker.group("reason") if marker else None,
            )
        )
    return calls


def import_submodules(code: str) -> None:
    """Import what a reader imports before ``code``: ``posenc.hf.register()`` needs ``import posenc.hf``."""
    path = re.match(r"[\w.]+", code).group(0).split(".")
    for end in range(2, len(path)):
        try:
            importlib.import_module(".".join(path[:end]))
        except ModuleNotFoundError:
            return  # posenc.build is a function, not a module: nothing deeper to import


def failing_prose_calls(page: str) -> list[str]:
    """Each unmarked prose example of ``page`` that raises, as ``page:line: `code` raises ...``."""
    failures = []
    for call in prose_calls((ROOT / page).read_text(encoding="utf-8")):
        if call.no_run is not None:
            continue
        namespace = {"posenc": posenc, "torch": torch}
        try:
            import_submodules(call.code)
            with posenc.use_backend("auto"):  # a span that forces a backend forces it only here
                eval(compile(call.code, f"{page}:{call.line}", "eval"), namespace)
        except Exception as error:
            failures.append(f"{page}:{call.line}: `{call.code}` raises {type(error).__name__}: {error}")
    return failures


def python_blocks(page: str) -> list[Block]:
    return [b for b in code_blocks((ROOT / page).read_text(encoding="utf-8")) if b.lang in ("python", "py")]


def run_page(page: str) -> None:
    """Run the page's Python blocks in one namespace, in order, skipping those marked no-run."""
    namespace: dict = {"__name__": "__main__"}
    for block in python_blocks(page):
        if block.no_run is not None:
            continue
        try:
            exec(compile(block.code, f"{page}:{block.line}", "exec"), namespace)
        except Exception:
            pytest.fail(
                f"{page}: the Python block at line {block.line} fails as written "
                f"(mark it <!-- no-run: why --> only if it needs what a test cannot have):\n"
                + traceback.format_exc(limit=-3)
            )


@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_of_the_page_runs_top_to_bottom(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a block that writes a file writes it here
    monkeypatch.setenv("POSENC_MODELS", str(tmp_path / "models"))
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng():
            run_page(page)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("page", PAGES)
def test_every_posenc_call_in_the_prose_of_the_page_runs(page, tmp_path, monkeypatch):
    """`posenc.MultiheadAttention(512, 8, encoding="alibi")` in the README's prose raised (ALiBi's
    default is causal only); a prose example is run as a block is, or marked no-run with a reason."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng():
            failures = failing_prose_calls(page)
    finally:
        torch.set_num_threads(threads)
    assert failures == [], (
        "an inline example fails as written (fix it, or mark it <!-- no-run: why --> right after "
        "the span):\n" + "\n".join(failures)
    )


def test_the_prose_holds_posenc_calls_and_every_no_run_marker_says_why():
    calls = {page: prose_calls((ROOT / page).read_text(encoding="utf-8")) for page in PAGES}
    assert len(calls["README.md"]) >= 4, calls["README.md"]
    assert len(calls["docs/encodings/index.md"]) >= 3, calls["docs/encodings/index.md"]
    for page, page_calls in calls.items():
        for call in page_calls:
            if call.no_run is not None:
                assert len(call.no_run.split()) >= 3, (
                    f"{page}:{call.line}: a no-run marker must say why `{call.code}` cannot run here"
                )


def test_the_prose_extractor_reads_spans_outside_fences_only():
    page = textwrap.dedent(
        """\
        Build it with `posenc.build("rope")`, a layer with
        `posenc.MultiheadAttention(512, 8,
        encoding="alibi")`; `posenc.build(spec)` is a signature, `posenc.available` no call,
        ``posenc.build("t5")`` two ticks, `posenc.hf.register()`<!-- no-run: changes HF globally -->.
        ```python
        posenc.build("nope")  # a block, not prose
        ```
        `torch.zeros(1)` and `F.t5_bucket(1)` are not posenc's; `posenc.build("a"` does not parse.
        """
    )
    assert [(c.line, c.code, c.no_run) for c in prose_calls(page)] == [
        (1, 'posenc.build("rope")', None),
        (2, 'posenc.MultiheadAttention(512, 8, encoding="alibi")', None),
        (4, 'posenc.build("t5")', None),
        (4, "posenc.hf.register()", "changes HF globally"),
    ]


def test_a_failing_prose_call_is_reported_with_its_page_and_line(tmp_path, monkeypatch):
    (tmp_path / "page.md").write_text('Fine: `posenc.build("nope")`.\n\nNot: `posenc.build("no-such")`.\n')
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    [failure] = failing_prose_calls("page.md")
    assert failure.startswith('page.md:3: `posenc.build("no-such")` raises ')


def test_the_pages_hold_python_blocks_and_every_no_run_marker_says_why():
    counts = {page: len(python_blocks(page)) for page in PAGES}
    # the README's tour (a layer, an HF model) and the pages its longer examples moved to
    assert counts["README.md"] >= 2 and counts["docs/decoding.md"] >= 2, counts
    assert counts["docs/getting-started.md"] >= 1 and counts["docs/attention.md"] >= 2, counts
    assert counts["docs/encodings/index.md"] >= 1 and counts["docs/encodings/rope.md"] >= 1, counts
    assert counts["docs/hf.md"] >= 4, counts
    for page in PAGES:
        for block in python_blocks(page):
            if block.no_run is not None:
                assert len(block.no_run.split()) >= 3, (
                    f"{page}:{block.line}: a no-run marker must say why the block cannot run here"
                )
    marked = [b for page in PAGES for b in python_blocks(page) if b.no_run is not None]
    ran = sum(counts.values()) - len(marked)
    assert ran > len(marked), f"only {ran} of {sum(counts.values())} Python blocks run"


def test_the_extractor_reads_fences_markers_and_indented_blocks():
    page = textwrap.dedent(
        """\
        text
        ```python
        a = 1
        ```
        * item

          <!-- no-run: needs a GPU here -->
          ```python
          b = a + 1
          ```
        ```bash
        echo hi
        ```
        ````python
        c = "```"
        ````
        """
    )
    blocks = code_blocks(page)
    assert [(b.lang, b.line, b.code, b.no_run) for b in blocks] == [
        ("python", 2, "a = 1", None),
        ("python", 8, "b = a + 1", "needs a GPU here"),
        ("bash", 11, "echo hi", None),
        ("python", 14, 'c = "```"', None),
    ]


def test_the_pages_are_every_page_of_the_site_and_the_files_they_include():
    assert "docs/encodings/rope.md" in PAGES and "docs/reference/encodings.md" in PAGES  # subfolders
    assert {"CONTRIBUTING.md", "benchmarks/RESULTS.md"} <= set(PAGES)  # included by contributing, results
    assert [f for f in included_files(DOCS_PAGES) if not (ROOT / f).is_file()] == []


def test_a_failing_block_is_reported_with_its_page_and_line(tmp_path, monkeypatch):
    (tmp_path / "page.md").write_text("```python\nx = 1\n```\n\n```python\nraise ValueError(x)\n```\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"page\.md: the Python block at line 5 fails"):
        run_page("page.md")


def _free_names(code: str) -> set[str]:
    """The names ``code`` reads that it neither binds nor imports (nor Python builds in)."""
    import builtins

    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return read - bound


def _needs(code: str) -> set[str]:
    """The names a block's first line declares it takes from elsewhere: ``# needs: a, b from ...``."""
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    match = re.match(r"#\s*needs:\s*(.*)", first)
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", match.group(1))) if match else set()


def test_every_block_runs_alone_or_says_what_it_needs():
    """Issue 62 item 10: docs/decoding.md's StaticDecodeStep block raised NameError run alone. A block
    a reader copies by itself either binds every name it reads or names what it takes in a first
    line ``# needs: ...``."""
    silent = []
    for page in PAGES:
        for block in python_blocks(page):
            if block.no_run is not None:
                continue
            missing = _free_names(block.code) - _needs(block.code)
            if missing:
                silent.append(f"{page}:{block.line} reads {sorted(missing)}")
    assert silent == []


def test_the_free_name_reader_sees_what_a_block_takes_from_elsewhere():
    assert _free_names("import torch\ny = torch.ones(2) + x\nfor i in range(3):\n    z = i") == {"x"}
    assert _needs("# needs: model, ids from the first example\nmodel(ids)") >= {"model", "ids"}
