"""The report's gallery (posenc.viz.report.gallery): it is a flag, and a spec that cannot be built gets a
visible note, never a silent gap."""

from __future__ import annotations

import html as html_lib
import json
from pathlib import Path

from _report import (
    CONFIG,
    write_experiment,
)
from posenc.viz.report import render_report


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
