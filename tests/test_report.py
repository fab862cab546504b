"""``posenc report DIR``: a self-contained HTML page that renders in headless Chromium.

The experiment directory is written by hand in the runner's format (``results.jsonl`` records
``{run, encoding, task, seed, length, metric, value, train_len, steps, examples}`` and
``config.json``), so no training is needed. Chromium (Debian package ``chromium``) loads the page
from disk with every host name unresolvable, runs a probe script that records each image's decoded
width, and dumps the DOM; the test reads the table and the images from that DOM.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from posenc.cli import _load_command_modules, app
from posenc.experiments.results import load_results
from posenc.experiments.train import ExperimentConfig, RunSpec, build_model, run_id_for
from posenc.viz.report import render_report

_load_command_modules()

ENCODINGS = ["alibi", "rope:base=10000", "t5"]
LENGTHS = [8, 16, 32, 64]
TRAIN_LEN = 16

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # anything fetched from the network would fail to load
    "--virtual-time-budget=10000",
]


def accuracy(encoding: str, length: int, seed: int) -> float:
    drop = {"alibi": 0.02, "rope:base=10000": 0.2, "t5": 0.05}[encoding]
    return max(0.0, 1.0 - drop * max(0, length // 8 - 1) - 0.01 * seed)


def write_experiment(directory: Path, checkpoints: bool = False) -> None:
    """Records, config and (optionally) untrained model checkpoints in the runner's format."""
    records = [
        {
            "run": f"{enc}-copy-{seed}",
            "encoding": enc,
            "task": "copy",
            "seed": seed,
            "length": length,
            "metric": "accuracy",
            "value": accuracy(enc, length, seed),
            "train_len": TRAIN_LEN,
            "steps": 100,
            "examples": 64,
        }
        for enc in ENCODINGS
        for seed in (0, 1)
        for length in LENGTHS
    ]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = ExperimentConfig(
        task="copy",
        encodings=ENCODINGS,
        train_len=TRAIN_LEN,
        eval_len=max(LENGTHS),
        seeds=[0, 1],
        d_model=32,
        num_layers=1,
        num_heads=2,
        d_ff=32,
    )
    (directory / "config.json").write_text(
        json.dumps({"experiment": config.to_dict(), "runtime": {"workers": 1}})
    )
    if checkpoints:
        save_checkpoints(directory, config, ENCODINGS[:2])


def save_checkpoints(directory: Path, config: ExperimentConfig, encodings: list[str]) -> None:
    """``checkpoints/<run id>.pt`` as the runner saves them (model weights untrained)."""
    task = config.make_task()
    for enc in encodings:
        torch.manual_seed(0)
        model = build_model(config, task, enc)
        run = RunSpec(enc, 0)
        path = directory / "checkpoints" / f"{run_id_for(config, run)}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "model": model.state_dict(),
            "step": 0,
            "run": {"encoding": enc, "seed": 0},
            "config": config.to_dict(),
        }
        torch.save(state, path)


class _Page(HTMLParser):
    """Collects the results table's rows and every image's attributes from a DOM dump."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[dict[str, str]] = []
        self.rows: list[list[str]] = []
        self._in_results = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag == "img":
            self.images.append({k: v or "" for k, v in attributes.items()})
        elif tag == "table" and attributes.get("id") == "results":
            self._in_results = True
        elif tag == "tr" and self._in_results:
            self.rows.append([])
        elif tag in ("td", "th") and self._in_results:
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "table":
            self._in_results = False
        elif tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def chromium_dom(page: Path, tmp_path: Path) -> str:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not on PATH (Debian: apt-get install -y chromium); cannot render the report")
    probe = tmp_path / "probe.html"
    script = '<script>for (const i of document.images) i.setAttribute("data-decoded-width", i.naturalWidth);</script>'
    probe.write_text(page.read_text().replace("</body>", script + "</body>"))
    result = subprocess.run(
        [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'chromium-profile'}",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.fixture(scope="module")
def report_page(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("experiment")
    write_experiment(directory, checkpoints=True)
    result = CliRunner().invoke(app, ["report", str(directory)])
    assert result.exit_code == 0, result.output
    page = directory / "report.html"
    assert page.is_file()
    return page


def test_report_is_self_contained(report_page: Path) -> None:
    text = report_page.read_text()
    # No external resources: every src/href is a data: URI or an in-page anchor.
    for url in re.findall(r'(?:src|href)\s*=\s*["\']([^"\']*)', text):
        assert url.startswith("data:") or url.startswith("#"), url
    assert "<link" not in text and "@import" not in text and "url(" not in text
    assert "<script" not in text


def test_report_renders_in_chromium(report_page: Path, tmp_path: Path) -> None:
    page = _Page()
    page.feed(chromium_dom(report_page, tmp_path))
    # The results table: a header with the lengths, one row per encoding with the seed means.
    header = page.rows[0]
    assert header[:3] == ["task", "metric", "encoding"]
    assert header[3:] == [str(n) for n in LENGTHS]
    body = {row[2]: row[3:] for row in page.rows[2:]}
    assert sorted(body) == sorted(ENCODINGS)
    for enc in ENCODINGS:
        for cell, length in zip(body[enc], LENGTHS):
            mean = (accuracy(enc, length, 0) + accuracy(enc, length, 1)) / 2
            assert float(cell.split("±")[0]) == pytest.approx(mean, abs=5e-4)
    # One curve figure (one task, one metric), one figure per encoding and the attention maps of
    # the two models with checkpoints, all decoded by Chromium.
    assert len(page.images) == 1 + len(ENCODINGS) + 2
    for image in page.images:
        assert image["src"].startswith("data:image/png;base64,")
        assert int(image["data-decoded-width"]) > 100, image.get("alt")
    captions = [image["alt"] for image in page.images]
    assert "accuracy against length" in captions[0]
    for enc, caption in zip(ENCODINGS, captions[1:]):
        assert caption.startswith(enc.split(":")[0])
    assert captions[-2:] == [f"attention maps of the trained model: {enc}" for enc in ENCODINGS[:2]]


def test_load_results_names_the_bad_line(tmp_path: Path) -> None:
    write_experiment(tmp_path)
    with (tmp_path / "results.jsonl").open("a") as handle:
        handle.write('{"encoding": "alibi", "length": 8}\n')
    with pytest.raises(ValueError, match=r"results.jsonl, line 25: record lacks metric, value"):
        load_results(tmp_path)


def test_report_of_a_directory_without_results(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    # Rich wraps long paths at the runner's terminal width: compare without line breaks.
    assert "results.jsonlnotfound" in "".join(result.output.split())


def test_report_shows_a_missing_figure_instead_of_failing(tmp_path: Path) -> None:
    # A spec that cannot be built gets a visible note on the page, never a silent gap.
    record = {
        "encoding": "alibi:mode=sideways",
        "task": "copy",
        "length": 8,
        "metric": "accuracy",
        "value": 0.5,
    }
    (tmp_path / "results.jsonl").write_text(json.dumps(record) + "\n")
    text = render_report(tmp_path)
    assert "No figure for <code>alibi:mode=sideways</code>" in text
    assert "mode must be one of" in text or "must be one of" in text
