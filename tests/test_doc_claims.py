"""Claims of the documents that the code can contradict later: CI's stages and the benchmark modules
named in CONTRIBUTING, a signature quoted in docs/architecture.md, the windowed cache of
docs/conventions.md §1.4, the benchmark figures the site quotes from benchmarks/RESULTS.md, and what
the README, a front page, keeps: the quick start, few dated figures, at most 300 lines."""

from __future__ import annotations

import inspect
import re
import shlex
from pathlib import Path

import torch

import posenc
from posenc.layers.positions import default_positions

ROOT = Path(__file__).resolve().parents[1]


def _read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def test_contributing_names_every_stage_of_ci_and_every_benchmark():
    stages = re.findall(r'^\s*stage "([^",:]+)', _read(".ci/run"), re.MULTILINE)
    stages = [s for s in stages if s != "CI passed"]
    assert len(stages) >= 6, stages
    contributing = _read("CONTRIBUTING.md")
    assert [s for s in stages if f"`{s}`" not in contributing] == []
    modules = sorted(p.name for p in (ROOT / "src/posenc/benchmarks").glob("bench_*.py"))
    assert len(modules) >= 8, modules
    assert [m for m in modules if f"`{m}`" not in contributing] == []


def test_architecture_quotes_default_positions_with_all_its_parameters():
    quoted = re.search(
        r"`posenc\.layers\.positions\.default_positions\(([^)]*)\)`", _read("docs/architecture.md")
    )
    assert quoted is not None
    names = [p.split("=")[0].strip() for p in quoted.group(1).replace("\n", " ").split(",")]
    assert names == list(inspect.signature(default_positions).parameters)


def test_a_windowed_cache_evicts_padded_keys_and_positions_count_only_the_real_ones():
    """docs/conventions.md §1.4: 11 real tokens through a window of 4 leave 3 keys; the next token is
    at position 11 whether or not 3 pads came first and whether or not the step passes a mask."""
    layer = posenc.MultiheadAttention(32, 4, "rope", causal=True, window=4).eval()
    for pads in (0, 3):
        mask = torch.zeros(1, 11 + pads, dtype=torch.bool)
        mask[:, :pads] = True
        cache = posenc.KVCache()
        with torch.no_grad():
            layer(torch.randn(1, 11 + pads, 32), key_padding_mask=mask if pads else None, cache=cache)
        assert cache.get(0).k.shape[2] == 3  # window - 1 keys, padded or not
        step_mask = torch.cat([mask, torch.zeros(1, 1, dtype=torch.bool)], dim=1)
        assert layer.default_positions(1, 1, step_mask, cache).tolist() == [[11]]
        assert layer.default_positions(1, 1, None, cache).tolist() == [[11]]


#: The site's pages that quote benchmark tables (their figures, with dates, come from RESULTS.md).
BENCHMARK_PAGES = ("docs/benchmarks.md", "docs/attention.md")
DATE = re.compile(r"\b20\d{2}-\d{2}-\d{2}\b")


def _tables_with_numbers(page: str) -> list[list[str]]:
    """A page's benchmark tables: the rows of each table whose header has a ``measured`` column
    or names the attention patterns' speed-ups."""
    rows, table = [], None
    for line in _read(page).splitlines():
        if not line.startswith("|"):
            table = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if table is None:
            table = (
                "numbers"
                if ("measured" in cells or "layer: forward / forward+backward" in cells)
                else "other"
            )
            continue
        if table == "numbers" and not set(line) <= set("|- "):
            rows.append(cells)
    return rows


NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+|\d+(?=%| MiB| s\b))")


def test_the_site_quotes_benchmark_numbers_as_results_gives_them_with_torch_and_date():
    """One number per measurement: every number of the site's benchmark tables is one that
    benchmarks/RESULTS.md states, and each row says the torch release and the day."""
    results = _read("benchmarks/RESULTS.md").replace("×", "x")
    stated = set(NUMBER.findall(results))
    rows = [row for page in BENCHMARK_PAGES for row in _tables_with_numbers(page)]
    assert len(rows) >= 10, rows
    missing = [(row[0], n) for row in rows for n in NUMBER.findall(" | ".join(row[2:])) if n not in stated]
    assert missing == [], missing
    for row in [r for r in rows if len(r) == 5]:  # the table with a "measured" column
        when = re.fullmatch(r"torch (\d+\.\d+\.\d+), (\d{4}-\d{2}-\d{2})", row[4])
        assert when and when.group(1) in results and when.group(2) in results, row
    prose = " ".join(_read("docs/encodings/rope.md").split())  # the kernel's figures, on RoPE's page
    assert (
        "at 145% of copy bandwidth" in prose
        and "reached 34% (2 CPU threads, torch 2.14.1, 2026-11-23" in prose
    )
    assert (
        "96-159% of copy bandwidth over four runs against 24-34% for the passes" in prose
    )  # the compiled loop
    assert "of the time of copying" not in prose


def _section(markdown: str, heading: str) -> str:
    start = markdown.index(heading)
    following = markdown.find("\n## ", start + len(heading))
    return markdown[start : following if following >= 0 else None]


def test_the_quick_start_shows_list_show_and_plot_and_they_run(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from posenc.cli.app import app, load_command_modules

    quick = _section(_read("README.md"), "## Quick start")
    commands = [
        shlex.split(line.split("#")[0])
        for line in quick.splitlines()
        if re.match(r"posenc (list|show|plot)\b", line)
    ]
    assert [c[1] for c in commands] == ["list", "show", "plot"]
    load_command_modules()
    monkeypatch.chdir(tmp_path)
    for command in commands:
        result = CliRunner().invoke(app, command[1:])
        assert result.exit_code == 0, (command, result.output)
    assert (tmp_path / "rope.png").stat().st_size > 10_000


def _site_pages() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))


def test_the_readme_says_what_a_newcomer_needs_where_it_is_needed():
    readme = _read("README.md")
    quick = _section(readme, "## Quick start")
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in quick
    # command 2's count and time: printed by .ci/run at every stage, never written here to go stale
    # (issue 62: "5,889 tests, 2 min 41 s" against 6,520 a week later)
    assert "`.ci/run` prints its count and wall time" in " ".join(quick.split())
    for page in ("README.md", "docs/getting-started.md"):
        assert not re.search(r"suite \(\d+ tests\)", _read(page)), page
    # "the seeds" (the notes the project started from) collided with --seeds
    for page in ["README.md", *_site_pages()]:
        for old in ("the seeds' code", "the seeds' mixed", "the seed's figures", "| seed |"):
            assert old not in _read(page), (page, old)
    assert 'notes the project started from (its "seed" notes' in " ".join(_read("docs/benchmarks.md").split())
    # the supported transformers range belongs to the HF page, not inside a conventions bullet
    assert "Supported transformers" in _read("docs/hf.md")
    conventions = _section(_read("docs/getting-started.md"), "## Conventions worth knowing")
    assert "Supported transformers" not in conventions
    assert "`causal=False` is its" in conventions
    assert "`causal=True`" in _section(readme, "## A short tour")  # the front page says it too


def test_the_readme_is_a_front_page():
    """Issue 47: the README keeps what a newcomer needs first (at most 300 lines, at most 3 dated
    figures, no benchmark table) and links into the site; the rest lives in docs/."""
    readme = _read("README.md")
    assert len(readme.splitlines()) <= 300
    assert len([line for line in readme.splitlines() if DATE.search(line)]) <= 3
    tour = _section(readme, "## A short tour")
    for shown in (
        "posenc.MultiheadAttention(",
        "posenc.hf.register()",
        "posenc extrapolate",
        "posenc compare",
    ):
        assert shown in tour, shown
    assert not any("measured" in row for row in re.findall(r"^\|.*\|$", readme, re.MULTILINE))
    linked = set(re.findall(r"\]\((docs/[\w/.-]+\.md)(?:#[\w-]+)?\)", readme))
    for page in (
        "docs/getting-started.md",
        "docs/encodings/index.md",
        "docs/attention.md",
        "docs/hf.md",
        "docs/studies.md",
        "docs/cluster.md",
        "docs/benchmarks.md",
    ):
        assert page in linked, page
    assert [page for page in linked if not (ROOT / page).is_file()] == []


def _main_job_mean_beyond_l(readme: str) -> dict[str, str]:
    """The main job's printed table (docs/studies.md): each encoding's ``mean 17..48`` cell."""
    header = re.search(r"^┃.*$", readme, re.MULTILINE)
    assert header is not None, "the main job's printed table is gone"
    column = [c.strip() for c in header.group(0).strip("┃").split("┃")].index("mean 17..48")
    rows = re.findall(r"^│(.*)│\s*$", readme[header.end() :], re.MULTILINE)
    cells = [[c.strip() for c in row.split("│")] for row in rows]
    return {row[0]: row[column] for row in cells if len(row) > column}


def test_the_main_jobs_table_says_it_comes_from_one_cpu_and_what_another_gave():
    """Issue 49 item 15: the same seeds on another x86 CPU gave shaw 81.2% and rope 14.8%; the note
    right after the table says so and quotes the table's own figures for the two (docs/studies.md,
    where the main job's output lives)."""
    readme = _read("docs/studies.md")
    means = _main_job_mean_beyond_l(readme)
    assert set(means) >= {"shaw", "rope", "alibi", "t5"}, means
    table_end = readme.index("```", readme.index("one seed: no interval"))
    note = readme[table_end + 3 :].strip().split("\n\n")[0]  # the paragraph right after the table
    note = " ".join(note.split())
    assert "from one CPU" in note and "another x86 CPU" in note, note
    assert "shaw 81.2% and rope 14.8%" in note, note
    assert f"against {means['shaw']} and {means['rope']} here" in note, (means, note)
    assert "order among close rows" in note and "can change" in note, note
