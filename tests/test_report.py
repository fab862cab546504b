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
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from posenc.cli.app import _load_command_modules, app
from posenc.experiments.results.compare import rank_rows
from posenc.experiments.results.folders import reproduce_command, write_config
from posenc.experiments.results.records import load_results
from posenc.experiments.tasks.catalog import mix_seed
from posenc.experiments.train import ExperimentConfig, RunSpec, build_model, run_id_for
from posenc.viz.report import render_report

_load_command_modules()

#: The default main job (``posenc extrapolate``), three seeds.
CONFIG = ExperimentConfig(seeds=[0, 1, 2])
ENCODINGS = CONFIG.encodings
TRAIN_LEN, EVAL_LEN = CONFIG.train_len, CONFIG.eval_len
LENGTHS = list(range(1, EVAL_LEN + 1))
SEEDS = CONFIG.seeds
#: The viewport the first screen is measured in, and the largest page this job may give (bytes).
VIEWPORT = (1300, 900)
PAGE_LIMIT = 1_500_000

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--hide-scrollbars",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # anything fetched from the network would fail to load
    "--virtual-time-budget=10000",
    f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}",
]

#: Per seed, how far past L each encoding's exact match lasts (0: it fails at L+1); nope does not fit.
REACH = {
    "nope": (0, 0, 0),
    "learned": (0, 0, 0),
    "sinusoidal": (2, 3, 2),
    "rope": (8, 9, 10),
    "alibi": (10, 11, 12),
    "t5": (12, 9, 10),
    "shaw": (30, 31, 32),
}


def accuracy(encoding: str, length: int, seed: int) -> float:
    """Exact match of ``encoding`` at ``length``: 1 inside L (nope: falling, so it does not fit),
    then a linear fall over ``REACH`` lengths; seeds differ by a little."""
    if encoding == "nope":
        return max(0.0, 1.0 - length / TRAIN_LEN) if length > 2 else 1.0
    inside = 1.0 - 0.002 * seed
    if length <= TRAIN_LEN:
        return inside
    reach = REACH[encoding][seed]
    return max(0.0, inside * (1 - (length - TRAIN_LEN) / (reach + 1)))


def write_experiment(directory: Path, checkpoints: bool = True) -> None:
    """Records, config and (optionally) the runs' checkpoints (initialised models) in the runner's format."""
    records = [
        {
            "run": run_id_for(CONFIG, RunSpec(enc, seed)),
            "encoding": enc,
            "task": "copy",
            "seed": seed,
            "length": length,
            "metric": metric,
            "value": value,
            "train_len": TRAIN_LEN,
            "steps": CONFIG.steps,
            "examples": 100,
        }
        for enc in ENCODINGS
        for seed in SEEDS
        for length in LENGTHS
        for metric, value in (
            ("exact_match", round(accuracy(enc, length, seed), 2)),
            ("token_accuracy", round(min(1.0, 0.3 + accuracy(enc, length, seed)), 3)),
        )
    ]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_config(directory, CONFIG, {"workers": 2, "threads": 1, "world_size": 1, "device": "cpu"}, None)
    if checkpoints:
        save_checkpoints(directory, CONFIG, ENCODINGS)


def save_checkpoints(directory: Path, config: ExperimentConfig, encodings: list[str]) -> None:
    """``checkpoints/<run id>.pt`` of seed 0 as the runner saves them (the models as initialised)."""
    task = config.make_task()
    for enc in encodings:
        torch.manual_seed(mix_seed(0, "init"))
        model = build_model(config, task, enc)
        path = directory / "checkpoints" / f"{run_id_for(config, RunSpec(enc, 0))}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"model": model.state_dict(), "step": 0, "run": {"encoding": enc, "seed": 0}}
        torch.save({**state, "config": config.to_dict()}, path)


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
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not on PATH (Debian: apt-get install -y chromium); cannot render the report")
    probe = tmp_path / "probe.html"
    text = page.read_text().replace("</head>", extra_head + "</head>").replace("</body>", PROBE + "</body>")
    probe.write_text(text)
    result = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", probe.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r'<pre id="probe">(.*?)</pre>', result.stdout, re.S)
    assert found, "the probe did not run (no <pre id=probe> in the dumped DOM)"
    return json.loads(html_lib.unescape(found.group(1)))


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


def test_recorded_command_parses_back_to_the_settings() -> None:
    import typer.main

    from posenc.cli.experiments import config_from_options

    config = ExperimentConfig(
        encodings=["rope:base=500000,pairing=half", "alibi", "t5/sinusoidal"],
        seeds=[0, 1, 2],
        steps=50,
        lr=1e-3,
        pack=True,
        distinct=False,
        randomize_positions=128,
        randomize_eval_positions=False,
        eval_examples=20,
        eval_batch=20,
        fit_threshold=0.9,
        eval_variants=["yarn", "temperature:0.2"],
    )
    command, caveats = reproduce_command(config, Path("runs/x y"))
    assert caveats == []
    args = shlex.split(command)
    assert args[:2] == ["posenc", "extrapolate"]
    click_command = typer.main.get_command(app).commands["extrapolate"]  # type: ignore[attr-defined]
    context = click_command.make_context("extrapolate", args[2:])
    assert config_from_options(context.params) == config
    assert context.params["out"] == Path("runs/x y")
    # A setting no option reaches is named, not silently dropped.
    _, caveats = reproduce_command(ExperimentConfig(weight_decay=0.1), Path("out"))
    assert caveats == ["weight_decay=0.1 (no command-line option; set from Python)"]


def test_gallery_is_a_flag(tmp_path: Path) -> None:
    write_experiment(tmp_path, checkpoints=False)
    (tmp_path / "config.json").write_text(
        json.dumps({"experiment": {**CONFIG.to_dict(), "encodings": ["alibi", "rope"]}})
    )
    text = render_report(tmp_path, gallery=True)
    assert '<section id="encodings"' in text and "No checkpoints in this directory" in text
    # A folder that does not record its command gets one derived from its settings.
    assert "derived from config.json" in text
    assert f"posenc extrapolate --encodings alibi,rope --seeds 0,1,2 --out {tmp_path}" in html_lib.unescape(
        text
    )


def test_load_results_names_the_bad_line(tmp_path: Path) -> None:
    write_experiment(tmp_path, checkpoints=False)
    lines = len((tmp_path / "results.jsonl").read_text().splitlines())
    with (tmp_path / "results.jsonl").open("a") as handle:
        handle.write('{"encoding": "alibi", "length": 8}\n')
    with pytest.raises(ValueError, match=rf"results.jsonl, line {lines + 1}: record lacks metric, value"):
        load_results(tmp_path)


def test_report_of_a_directory_without_results(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    # Rich wraps long paths at the runner's terminal width: compare without line breaks.
    assert "results.jsonlnotfound" in "".join(result.output.split())


def test_report_shows_a_missing_figure_instead_of_failing(tmp_path: Path) -> None:
    # A spec that cannot be built gets a visible note in the gallery, never a silent gap.
    record = {
        "encoding": "alibi:mode=sideways",
        "task": "copy",
        "length": 8,
        "metric": "accuracy",
        "value": 0.5,
    }
    (tmp_path / "results.jsonl").write_text(json.dumps(record) + "\n")
    text = render_report(tmp_path, gallery=True)
    assert "No figure for <code>alibi:mode=sideways</code>" in text
    assert "mode must be one of" in text or "must be one of" in text


def test_diagnostics_read_the_trained_checkpoints(tmp_path: Path) -> None:
    import math

    from posenc.experiments.runner import run_experiment
    from posenc.viz.diagnostics import entropy_by_length, learned_table_drift
    from posenc.viz.runs import find_checkpoints

    config = ExperimentConfig(
        encodings=["learned", "alibi"], train_len=4, eval_len=8, steps=4, eval_examples=4, eval_batch=4,
        d_model=16, num_heads=2, d_ff=16, num_layers=1, checkpoint_every=4,
    )  # fmt: skip
    run_experiment(config, tmp_path, workers=1)
    checkpoints = find_checkpoints(tmp_path)
    # Learned positions: the rows a training example reaches moved; every row past them is its init.
    table, drift, reached = learned_table_drift(checkpoints["learned"])
    assert reached == config.make_task().sequence_length(config.train_len)  # input tokens of size L
    assert table.shape[0] == len(drift) > reached
    assert (drift[:reached] > 0).all() and (drift[reached:] == 0).all()
    assert learned_table_drift(checkpoints["alibi"]) is None
    # Entropy per head: between 0 and that of uniform attention over the visible keys, which is the
    # mean over queries i of log(i + 1).
    entropy, uniform = entropy_by_length(checkpoints["alibi"], [2, 4, 8], examples=2)
    assert entropy.shape == (1, 2, 3)
    width = [config.make_task().sequence_length(n) for n in (2, 4, 8)]
    assert uniform == pytest.approx([sum(math.log(i + 1) for i in range(t)) / t for t in width])
    assert (entropy >= 0).all() and (entropy <= uniform + 1e-9).all()


def test_the_report_reads_one_folder_view_and_imports_experiments_at_the_top(tmp_path: Path) -> None:
    """``viz/report/`` reads the folder once (:func:`read_folder`: records as :class:`Record`, the
    summary, the ranking) and renders one module per section; no module of it imports inside a
    function, so none imports from ``posenc.experiments`` there (issue 34)."""
    import ast

    import posenc.viz.report as report
    from posenc.experiments.results.records import Record
    from posenc.viz.report.view import read_folder

    for path in sorted(Path(report.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        assert len(path.read_text().splitlines()) <= 400, path.name
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.Lambda)):
                inner = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert not inner, f"{path.name}: {getattr(node, 'name', 'lambda')} imports inside a function"
    write_experiment(tmp_path, checkpoints=False)
    view = read_folder(tmp_path)
    assert all(isinstance(r, Record) for r in view.records) and len(view.records) == len(
        load_results(tmp_path)
    )
    assert not hasattr(view, "lines")  # one record form: no dict copy of the file beside the records
    assert view.summary is not None and view.train_len == TRAIN_LEN and view.headline.name == "exact_match"
    assert view.ranking is not None and view.rows[: len(view.ranking.rows)] == view.ranking.rows
    assert set(view.rows) == set(view.encodings) == set(ENCODINGS)
    assert not view.pretrained and not view.study and view.preset is None and view.missing is None
    assert [section.ID for section in report.SECTIONS] == [
        "verdict", "per-length", "depth", "published", "diagnostics", "encodings", "config"
    ]  # fmt: skip


def test_the_view_reads_variants_depths_and_missing_runs_from_records(tmp_path: Path) -> None:
    """The summary, the missing-runs note and the depth map read :class:`Record` (a record's
    ``variant`` and ``by_depth`` are fields of it), not the file's dict lines (issue 34)."""
    from posenc.experiments.results.records import DepthCell, Record
    from posenc.viz.depth import depth_grid
    from posenc.viz.report.view import read_folder

    def line(encoding: str, seed: int, length: int, cells: list[tuple[float, int]], **extra) -> dict:
        by_depth = [
            {"bucket": b, "depth": [b / 2, b / 2], "value": v, "examples": n}
            for b, (v, n) in enumerate(cells)
        ]
        value = sum(v * n for v, n in cells) / sum(n for _, n in cells)
        return {"encoding": encoding, "task": "passkey", "seed": seed, "length": length, "metric": "exact_match",
                "value": value, "train_len": 4, "examples": 4, "by_depth": by_depth, **extra}  # fmt: skip

    lines = [line("rope", 0, n, [(1.0, 2), (0.5, 2)]) for n in (4, 8)]
    lines += [line("rope", 1, n, [(0.5, 2), (0.0, 2)]) for n in (4, 8)]
    lines += [line("rope + yarn", 0, n, [(1.0, 2), (1.0, 2)], variant="yarn") for n in (4, 8)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    config = ExperimentConfig(
        task="passkey", encodings=["rope", "nope"], train_len=4, eval_len=8, seeds=[0, 1]
    )
    write_config(tmp_path, config, {}, None)
    view = read_folder(tmp_path)
    assert view.records[0].by_depth == (DepthCell(0, 0.0, 0.0, 1.0, 2), DepthCell(1, 0.5, 0.5, 0.5, 2))
    assert view.records[0].variant is None and view.records[-1].variant == "yarn"
    assert view.variants == {"rope + yarn"}
    # rope, bucket 0 at length 8: seed 0 hits 2 of 2, seed 1 hits 1 of 2 -> 3/4; bucket 1: 1/4.
    lengths, bounds, grid = depth_grid(view.records, "rope")
    assert lengths == [4, 8] and bounds == [(0.0, 0.0), (0.5, 0.5)]
    assert grid[:, 1].tolist() == [0.75, 0.25]
    # nope has no record: both of its seeds are missing, named in the note.
    assert view.missing is not None and "2 of 4 runs" in view.missing and "nope seed 1" in view.missing
    assert view.summary is not None and [row[0] for row in view.summary.table.rows] == ["rope", "rope + yarn"]
    broken = {**lines[0], "by_depth": [{"bucket": 0, "value": 1.0}]}
    with pytest.raises(ValueError, match="by_depth"):
        Record.from_dict(broken, "results.jsonl, line 1")
