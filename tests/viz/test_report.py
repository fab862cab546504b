"""``posenc report DIR``: a self-contained HTML page read as a reader reads it, in headless Chromium.

The experiment directory is the default main job's (``posenc extrapolate``: the seven default
encodings on copy, L = 16, evaluated to 48) with three seeds, written in the runner's format
(``results.jsonl`` records ``{run, encoding, task, seed, length, metric, value, train_len, steps,
examples}``, ``config.json`` and ``checkpoints/``) so that no training is needed: the values follow
known curves and the checkpoints hold the models as the runner initialises them.

Chromium (Debian package ``chromium``) loads the page from disk in a 1300 x 900 window with every
host name unresolvable. A probe script, run once the page has loaded, opens every ``<details>``
section afterwards and writes its measurements into the page as JSON, which ``--dump-dom`` returns:

- where the verdict table and the headline figure sit (they must be inside the first 900 px);
- how many lines the text of every table cell holding a digit takes (a number must not wrap);
- each image's decoded width (every image must load).

The page size is checked against :data:`PAGE_LIMIT`.
"""

from __future__ import annotations

import html as html_lib
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _chromium import VIEWPORT, run_probe
from _report import (
    ENCODINGS,
    LENGTHS,
    SEEDS,
    TRAIN_LEN,
    accuracy,
    write_experiment,
)
from posenc.cli.app import app, load_command_modules
from posenc.experiments.results.compare import rank_rows

load_command_modules()

#: The largest page this job may give (bytes); the viewport is _chromium's.
PAGE_LIMIT = 1_500_000

# ---------------------------------------------------------------------------- Chromium

#: Run on ``load`` (every image decoded): measure, open every <details>, measure the cells again,
#: and write the measurements as JSON into <pre id="probe">.
PROBE = """<script>
window.addEventListener("load", () => {
  const box = (el) => { if (!el) return null; const r = el.getBoundingClientRect();
    return {top: r.top, bottom: r.bottom, left: r.left, right: r.right}; };
  const firstScreen = {width: window.innerWidth, height: window.innerHeight,
    verdict: box(document.getElementById("summary")),
    figure: box(document.querySelector("#headline-figure img"))};
  const closed = Array.from(document.querySelectorAll("details")).filter((d) => !d.open).map((d) => d.id);
  document.querySelectorAll("details").forEach((d) => { d.open = true; });
  const cells = [];
  for (const cell of document.querySelectorAll("td, th")) {
    const text = cell.textContent.trim();
    if (!/[0-9]/.test(text)) continue;
    const range = document.createRange(); range.selectNodeContents(cell);
    // Lines: runs of boxes that overlap vertically (a <code> box sits a pixel off the text's).
    const rects = Array.from(range.getClientRects()).filter((r) => r.width > 0).sort((a, b) => a.top - b.top);
    let lines = 0, bottom = -Infinity;
    for (const r of rects) { if (r.top >= bottom - 1) { lines += 1; bottom = r.bottom; } else { bottom = Math.max(bottom, r.bottom); } }
    const table = cell.closest("table");
    cells.push({text: text, lines: lines, height: cell.getBoundingClientRect().height,
                table: table ? (table.id || table.className) : ""});
  }
  const images = Array.from(document.images).map((i) => ({alt: i.alt, width: i.naturalWidth, complete: i.complete}));
  const out = document.createElement("pre"); out.id = "probe";
  out.textContent = JSON.stringify({firstScreen, closed, cells, images});
  document.body.appendChild(out);
});
</script>"""


def chromium_probe(page: Path, tmp_path: Path, extra_head: str = "") -> dict:
    """Load ``page`` (with ``extra_head`` added to its head) in headless Chromium and return the probe's JSON."""
    return run_probe(page, tmp_path, PROBE, extra_head)


def wrapped(measured: dict) -> list[dict]:
    """The cells holding a digit whose text takes more than one line."""
    return [cell for cell in measured["cells"] if cell["lines"] > 1]


@pytest.fixture(scope="module")
def report_page(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("extrapolate")
    write_experiment(directory)
    result = CliRunner().invoke(app, ["report", str(directory)])
    assert result.exit_code == 0, result.output
    page = directory / "report.html"
    assert page.is_file()
    return page


@pytest.fixture(scope="module")
def measured(report_page: Path, tmp_path_factory) -> dict:
    return chromium_probe(report_page, tmp_path_factory.mktemp("chromium"))


def test_report_is_self_contained_and_small(report_page: Path) -> None:
    text = report_page.read_text()
    # No external resources: every src/href is a data: URI or an in-page anchor.
    for url in re.findall(r'(?:src|href)\s*=\s*["\']([^"\']*)', text):
        assert url.startswith("data:") or url.startswith("#"), url
    assert "<link" not in text and "@import" not in text and "url(" not in text
    assert "<script" not in text
    size = report_page.stat().st_size
    assert size < PAGE_LIMIT, f"report.html is {size} bytes, over the {PAGE_LIMIT} the default job may take"


def test_first_screen_holds_the_verdict_table_and_the_figure(measured: dict) -> None:
    screen = measured["firstScreen"]
    # The layout depends on the width only (no height units): headless Chromium's window keeps some
    # of its height for itself, so the first screen's 900 px are measured from the top of the page.
    assert screen["width"] == VIEWPORT[0]
    for name in ("verdict", "figure"):
        box = screen[name]
        assert box is not None, f"no {name} on the page"
        assert box["top"] >= 0 and box["bottom"] <= VIEWPORT[1], (
            f"the {name} is not on the first screen: {box}"
        )
        assert box["right"] <= VIEWPORT[0], f"the {name} is wider than the window: {box}"


def test_no_numeric_cell_wraps(measured: dict) -> None:
    tables = {cell["table"] for cell in measured["cells"]}
    # The verdict table, both heat maps, the per-seed table (opened by the probe) and the settings.
    assert {"summary", "heat", "results", "config"} <= tables, tables
    assert len([c for c in measured["cells"] if c["table"] == "results"]) >= len(ENCODINGS) * len(
        SEEDS
    ) * len(LENGTHS)
    assert not wrapped(measured), wrapped(measured)[:5]
    # The per-seed table and the settings start closed.
    assert {"per-seed", "configuration"} <= set(measured["closed"])


def test_the_wrap_check_catches_a_wrapped_cell(report_page: Path, tmp_path: Path) -> None:
    # The same page with the verdict table's cells squeezed: "100.0%, 3/3" must take several lines.
    squeeze = "<style>#summary td { white-space: normal !important; max-width: 2.5em; }</style>"
    caught = wrapped(chromium_probe(report_page, tmp_path, squeeze))
    assert caught and {cell["table"] for cell in caught} == {"summary"}
    assert any(cell["text"].endswith("3/3") for cell in caught)


def test_every_image_loads(measured: dict) -> None:
    images = measured["images"]
    # The curves (exact match, token accuracy), one attention figure per model, the entropy
    # figure and learned's table; no gallery of untrained encodings.
    assert len(images) == 2 + len(ENCODINGS) + 1 + 1, [i["alt"] for i in images]
    for image in images:
        assert image["complete"] and image["width"] > 100, image


def test_report_reads_verdict_first(report_page: Path) -> None:
    text = report_page.read_text()
    order = [text.index(f'<section id="{sid}"') for sid in ("verdict", "per-length", "diagnostics", "config")]
    assert order == sorted(order)
    assert '<section id="encodings"' not in text  # the untrained gallery is behind --gallery
    verdict = text[order[0] : order[1]]
    assert "task <b>copy</b>" in verdict and "L = 16" in verdict and "<b>3 seeds</b>" in verdict
    # The ranking beyond L: shaw, alibi, t5, rope, sinusoidal, learned; nope did not fit.
    rows = re.findall(
        r'<tr class="(fit|unfit)"><td class="num">([-\d]+)</td><td><code>([^<]+)</code>', verdict
    )
    assert [(c, r, e) for c, r, e in rows] == [
        ("fit", "1", "shaw"),
        ("fit", "2", "alibi"),
        ("fit", "3", "t5"),
        ("fit", "4", "rope"),
        ("fit", "5", "sinusoidal"),
        ("fit", "6", "learned"),
        ("unfit", "-", "nope"),
    ]
    # posenc compare's verdict for each neighbour pair, naming the interval method.
    ranking = rank_rows(report_page.parent)
    sentences = [html_lib.escape(c.sentence()) for c in ranking.neighbours]
    assert len(sentences) == 5 and all(s in verdict for s in sentences)
    assert "shaw beats alibi" in verdict and "alibi vs t5: cannot tell" in verdict
    assert "95% Student&#x27;s t interval of the mean difference beyond L" in verdict
    # The figure follows the table inside the verdict.
    assert verdict.index('id="summary"') < verdict.index('id="headline-figure"')


def test_heat_map_gives_every_length_and_marks_l(report_page: Path) -> None:
    text = report_page.read_text()
    heat = text[text.index('<table class="heat" data-metric="exact_match"') :]
    heat = heat[: heat.index("</table>")]
    assert heat.count("<tr>") == 1 + len(ENCODINGS)
    header = re.findall(r"<th class=\"num( l)?\"[^>]*>(\d+)</th>", heat)
    assert [int(n) for _, n in header] == LENGTHS
    assert [int(n) for mark, n in header if mark] == [TRAIN_LEN + 1]
    shaw = heat[heat.index("<code>shaw</code>") :].split("</tr>")[0]
    cells = re.findall(r'title="([^"]*)">([^<]*)</td>', shaw)
    mean = sum(round(accuracy("shaw", 20, s), 2) for s in SEEDS) / 3
    assert cells[19][1] == f"{100 * mean:.0f}" and "(mean of 3 seeds)" in cells[19][0]


def test_configuration_gives_the_command_that_reproduces_the_folder(report_page: Path) -> None:
    text = report_page.read_text()
    command = html_lib.unescape(re.search(r'<pre id="command"><code>(.*?)</code>', text, re.S).group(1))
    assert command == f"posenc extrapolate --seeds 0,1,2 --out {report_page.parent}"
    assert "as recorded in config.json" in text
