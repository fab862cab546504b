"""The report's one view of a folder (posenc.viz.report.view): read once (records as Record, the summary, the
ranking), with variants, depths and missing runs read from records; a folder without results is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _report import (
    ENCODINGS,
    TRAIN_LEN,
    write_experiment,
)
from posenc.cli.app import app, load_command_modules
from posenc.experiments.results.folders import write_config
from posenc.experiments.results.records import load_results
from posenc.experiments.train import ExperimentConfig

load_command_modules()


def test_report_of_a_directory_without_results(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    # Rich wraps long paths at the runner's terminal width: compare without line breaks.
    assert "results.jsonlnotfound" in "".join(result.output.split())


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
