"""The summary table (posenc.experiments.results.summary): only encodings that fit are ranked, with seed
intervals; it says how many seeds it rests on; the interval note and bracketed cells print whole on a
terminal (Rich read [low, high] as a markup tag)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from _study import _record
from posenc.cli import experiments as experiments_cli
from posenc.cli import output as output_cli
from posenc.experiments import ExperimentConfig, summary_table
from posenc.experiments.results.summary import INTERVAL_NOTE, SummaryTable


def test_the_interval_note_and_bracketed_cells_print_whole_on_a_terminal(monkeypatch):
    """Rich read "[low, high]" as a markup tag and printed the note as ": 95% Student's t ..."."""
    buffer = io.StringIO()
    terminal = Console(file=buffer, force_terminal=True, width=250, color_system=None)
    monkeypatch.setattr(output_cli, "console", terminal)  # print_table's module (re-exported by experiments)
    summary = SummaryTable(
        title="copy: exact match by length [bold]x[/bold] (3 seeds)",
        columns=["encoding", "mean 17..48"],
        rows=[["shaw [b]", "63.3% [4.5%, 100%]"], ["rope", "19.7% [low, high]"]],
        notes=(INTERVAL_NOTE + "; kept inside [0%, 100%]",),
    )
    experiments_cli.print_table(experiments_cli.rich_table(summary))
    text = " ".join(buffer.getvalue().split())  # Rich wraps the caption to the table's width
    assert "[low, high]: 95% Student's t interval of the mean across the n seeds" in text, text
    assert "; kept inside [0%, 100%]" in text
    assert "[bold]x[/bold]" in text and "shaw [b]" in text and "19.7% [low, high]" in text
    assert "63.3% [4.5%, 100%]" in text


# ----------------------------------------------------------------------------
# The extrapolation runner: records for every task, the exact-match metric, outputs and the CLI.


def _records(encoding, seed, values_by_length, task="copy"):
    return [
        {"run": f"{encoding}-{seed}", "encoding": encoding, "task": task, "seed": seed, "train_len": 2,
         "steps": 1, "length": n, "metric": "exact_match", "value": v, "examples": 10}
        for n, v in values_by_length.items()
    ]  # fmt: skip


def test_summary_ranks_only_encodings_that_fit_and_gives_seed_intervals():
    """Hand-computed: rope fits on both seeds (in-distribution means 1.0 and 0.95), nope does not
    (0.5 and 1.0). Beyond L=2 rope's per-seed means are 0.4 and 0.8: mean 0.6, standard deviation
    0.2·√2, so the Student's t interval is 0.6 ± t(0.975, 1)·0.2 with the tabulated t(0.975, 1) =
    12.706205; the table keeps it inside [0%, 100%] (two seeds say almost nothing)."""
    from posenc.experiments.results.records import summarize

    records = (
        _records("rope", 0, {1: 1.0, 2: 1.0, 3: 0.4, 4: 0.4})
        + _records("rope", 1, {1: 1.0, 2: 0.9, 3: 0.8, 4: 0.8})
        + _records("nope", 0, {1: 0.5, 2: 0.5, 3: 0.0, 4: 0.0})
        + _records("nope", 1, {1: 1.0, 2: 1.0, 3: 0.1, 4: 0.3})
    )
    rope, nope = summarize(records, "exact_match", 2, ["rope", "nope"], fit_threshold=0.95)
    assert rope["iid"] == pytest.approx(0.975) and rope["fit"] == 2
    assert nope["iid"] == pytest.approx(0.75) and nope["fit"] == 1
    assert rope["beyond_interval"] == pytest.approx((0.6 - 12.706205 * 0.2, 0.6 + 12.706205 * 0.2), abs=1e-6)
    bounded = summarize(records, "exact_match", 2, ["rope"], fit_threshold=0.95, bounds=(0.0, 1.0))
    assert bounded[0]["beyond_interval"] == (0.0, 1.0)
    assert summarize(records, "exact_match", 2, ["rope"])[0]["fit"] is None  # no threshold, no flag
    config = ExperimentConfig(task="copy", encodings=["rope", "nope"], train_len=2, eval_len=4)
    table = summary_table(config, records, config.make_task().metric)
    assert table.columns[:3] == ["encoding", "<=2, fit", "at L=2"]
    assert table.rows[0][:2] == ["rope", "97.5%, 2/2"]
    assert table.rows[0][3] == "60.0% [0.0%, 100.0%]"
    assert table.rows[1][1] == "75.0%, 1/2"
    assert len(table.notes) == 2 and "not ranked" in table.notes[0]
    assert "95% Student's t interval" in table.notes[1]
    assert "nope (in-distribution 75.0%)" in table.notes[0] and "rope" not in table.notes[0]


# ----------------------------------------------------------------------------
# The main job as a study (issue 14): fit first, uncertainty, inference-time variants, the report.


def test_table_says_how_many_seeds_it_rests_on():
    records = [_record("rope", s, n, 1.0) for s in (0, 1, 2) for n in (1, 2, 3)]
    config = ExperimentConfig(task="copy", encodings=["rope"], train_len=2, eval_len=3, seeds=[0, 1, 2])
    assert summary_table(config, records, config.make_task().metric).title.endswith("; 3 seeds)")
    assert summary_table(config, records[:3], config.make_task().metric).title.endswith("; 1 seed)")
