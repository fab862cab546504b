"""Every Python block of README.md and docs/*.md runs as written, top to bottom.

A reader copies the blocks of one page into one interpreter, in order: so does this test, one
namespace per file. A block that needs what a test machine cannot have (a model folder, downloaded
weights) carries an HTML comment on the line right before its fence saying why::

    <!-- no-run: needs a model folder (path/to/model is a placeholder) -->
    ```python

and is skipped, as every later block of its file that reads a name only it defines would fail;
such a block is marked the same way, with its own reason.
"""

from __future__ import annotations

import re
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)[^\n`]*$")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(?P<reason>.*?)\s*-->\s*$")


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


def test_the_pages_hold_python_blocks_and_every_no_run_marker_says_why():
    counts = {page: len(python_blocks(page)) for page in PAGES}
    assert counts["README.md"] >= 5 and counts["docs/decoding.md"] >= 2, counts
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


def test_a_failing_block_is_reported_with_its_page_and_line(tmp_path, monkeypatch):
    (tmp_path / "page.md").write_text("```python\nx = 1\n```\n\n```python\nraise ValueError(x)\n```\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"page\.md: the Python block at line 5 fails"):
        run_page("page.md")
