"""A complete ``--task text`` study folder merges, reports and prints as a complete study (issue 49,
items 8 and 13): on a tiny random Llama with a small trained BPE tokenizer saved to a tmp folder.

- ``posenc merge`` of two folders holding the same unit with the same results, timed differently,
  merges (their ``runs.jsonl`` differ only in ``seconds``); different results are still refused;
- ``posenc report`` of a complete unsharded study says nothing about a missing shard and shows the
  study's table; a one-length passkey curve has the length as its one tick on a readable axis;
- the study's table on an 80-column terminal shows every number whole.
"""

from __future__ import annotations

import io
import json
import re
import shutil

import pytest
from rich.console import Console
from typer.testing import CliRunner

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from _tiny_hf import TEXT, save_tiny_llama  # noqa: E402
from posenc.cli import experiments as experiments_cli  # noqa: E402
from posenc.cli.app import _load_command_modules, app  # noqa: E402
from posenc.experiments.cluster.shards import merge_folders  # noqa: E402
from posenc.experiments.results.records import as_records, read_records  # noqa: E402
from posenc.experiments.study.hf_study import study_summary  # noqa: E402

_load_command_modules()

CONTEXT = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", CONTEXT)


@pytest.fixture(scope="module")
def study(model_dir, tmp_path_factory):
    """A complete, unsharded ``--task text`` study folder (two variants, two lengths) by the CLI."""
    root = tmp_path_factory.mktemp("study")
    corpus = root / "corpus.txt"
    corpus.write_text(TEXT * 40)
    out = root / "text"
    args = ["extrapolate", "--hf-model", str(model_dir), "--task", "text", "--corpus", str(corpus)]
    args += ["--lengths", "100", "--depths", "0.5", "--eval-examples", "1", "--eval-variants", "none,yarn"]
    result = CliRunner().invoke(app, [*args, "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def one_length(model_dir, tmp_path_factory):
    """A ``--task text-passkey`` study folder at the one prompt length 100."""
    out = tmp_path_factory.mktemp("passkey") / "pk"
    args = ["extrapolate", "--hf-model", str(model_dir), "--task", "text-passkey", "--lengths", "100"]
    args += ["--eval-len", "100", "--depths", "0.5", "--eval-examples", "1", "--no-progress"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


# ---------------------------------------------------------------------------- item 8: merge


def test_merge_takes_two_folders_whose_shared_units_differ_only_in_timings(study, tmp_path):
    """merge refused them: "with different results (5 vs 5)": it compared the units' seconds."""
    again = tmp_path / "again"
    shutil.copytree(study, again)
    runs = _lines(again / "runs.jsonl")
    for run in runs:
        run["seconds"] = run["seconds"] + 7.5  # the same unit, measured slower elsewhere
    _write_lines(again / "runs.jsonl", runs)
    summary = merge_folders(tmp_path / "merged", [study, again])
    assert summary.missing == [] and summary.runs == len(runs)
    assert summary.duplicates == len(_lines(study / "results.jsonl"))
    assert _lines(tmp_path / "merged" / "runs.jsonl") == _lines(study / "runs.jsonl")  # the first's kept


def test_merge_still_refuses_a_unit_with_other_results_naming_the_field(study, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(study, other)
    runs = _lines(other / "runs.jsonl")
    runs[0]["value"] += 1  # another number of forwards: not the same measurement
    runs[0]["seconds"] += 1.0
    _write_lines(other / "runs.jsonl", runs)
    with pytest.raises(ValueError, match=r"with different results \(value \d+ vs \d+\)"):
        merge_folders(tmp_path / "merged", [study, other])
    assert not (tmp_path / "merged").exists()


def test_one_file_holding_a_unit_twice_timed_differently_reads_once(study, tmp_path):
    """The rule merge applies between folders holds inside one file too (read_records)."""
    runs = _lines(study / "runs.jsonl")
    _write_lines(tmp_path / "runs.jsonl", [*runs, {**runs[0], "seconds": runs[0]["seconds"] + 3}])
    with pytest.warns(UserWarning, match="dropped 1 exact duplicate"):
        assert read_records(tmp_path / "runs.jsonl") == runs
    _write_lines(tmp_path / "runs.jsonl", [*runs, {**runs[0], "value": runs[0]["value"] + 1}])
    with pytest.raises(ValueError, match=r"two different results of one measurement .*: value \d+ vs \d+\)"):
        read_records(tmp_path / "runs.jsonl")


# ---------------------------------------------------------------------------- item 13: report


def test_the_report_of_a_complete_study_has_its_table_and_no_missing_shard(study):
    """It said "incomplete: 2 of 2 runs have no results here ... combine the shards' folders" (the
    records' tasks text-lm and text-passkey are not the folder's text) and drew no table."""
    from posenc.viz.report import render_report

    page = render_report(study)
    assert "incomplete" not in page and 'id="missing"' not in page
    table = re.search(r'<table id="summary">(.*?)</table>', page, re.S)
    assert table, "no verdict table"
    for label in ("tiny-llama", "tiny-llama + yarn"):
        assert f"<code>{label}</code>" in table.group(1)
    assert "passkey 100" in table.group(1) and "ppl 2x" in table.group(1)
    assert len(re.findall(r'<td class="num">\d+\.\d\d</td>', table.group(1))) >= 2 * 10


def test_the_report_of_a_study_shard_names_its_missing_units(study, tmp_path):
    part = tmp_path / "part"
    shutil.copytree(study, part)
    runs = _lines(part / "runs.jsonl")
    kept = [r for r in runs if not (r["variant"] == "yarn" and r["length"] == 128)]
    _write_lines(part / "runs.jsonl", kept)
    from posenc.viz.report import render_report

    page = render_report(part)
    assert "incomplete: 1 of 4 units have no results here (tiny-llama + yarn @ 128)" in page


def test_a_one_length_curve_has_the_length_as_its_tick_on_a_readable_axis(one_length):
    """One dot at x in 99.6..100.4 and y in -0.04..0.04: the axis matplotlib makes for one point."""
    from posenc.viz.curves import curve_figure

    records = as_records(read_records(one_length / "results.jsonl"))
    assert sorted({r.length for r in records}) == [100]
    fig = curve_figure(records, "text-passkey", "exact_match", ["tiny-llama"])
    ax = fig.axes[0]
    fig.canvas.draw()
    assert list(ax.get_xticks()) == [100]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["100"]
    assert ax.xaxis.get_offset_text().get_text() == ""
    low, high = ax.get_xlim()
    assert low <= CONTEXT and high - low >= 100  # L=64 and the length both on the axis
    bottom, top = ax.get_ylim()
    assert bottom <= 0 and top >= 1  # an exact match spans [0, 1], not the one value +- 0.05


# ---------------------------------------------------------------------------- item 13: terminal


def _printed(renderable, width):
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=width, color_system=None)
    console.print(renderable)
    return buffer.getvalue(), console


def _cells(table):
    return [cell for row in table.rows for cell in row[1:]]


@pytest.mark.parametrize("width", [80, 60])
def test_the_study_table_on_a_narrow_terminal_shows_every_number_whole(study, width):
    """Fourteen columns in 80 were cut to "40…"; now the columns go into several tables that fit."""
    settings = json.loads((study / "config.json").read_text())["experiment"]
    table = study_summary(settings, read_records(study / "results.jsonl"))
    assert len(table.columns) == 14
    text, _ = _printed(table, width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    cells = [re.findall(r"│ *([^│]*?) *(?=│)", line) for line in text.splitlines() if line.startswith("│")]
    printed = [cell for row in cells for cell in row[1:]]
    assert sorted(printed) == sorted(_cells(table))  # each number once, whole, in its own cell
    assert " ".join(table.notes) in " ".join(text.split())


def test_the_study_table_on_a_wide_terminal_is_one_table(study):
    settings = json.loads((study / "config.json").read_text())["experiment"]
    table = study_summary(settings, read_records(study / "results.jsonl"))
    text, console = _printed(table, 250)
    assert text.count("┏") == 1 and console.measure(table).maximum < 250


def test_posenc_extrapolate_prints_the_study_table_whole_at_80_columns(model_dir, study, monkeypatch):
    terminal = Console(file=io.StringIO(), force_terminal=True, width=80, color_system=None)
    monkeypatch.setattr(experiments_cli, "console", terminal)
    settings = json.loads((study / "config.json").read_text())["experiment"]
    args = ["extrapolate", "--hf-model", str(model_dir), "--task", "text", "--corpus", settings["corpus"]]
    args += ["--lengths", "100", "--depths", "0.5", "--eval-examples", "1", "--eval-variants", "none,yarn"]
    result = CliRunner().invoke(app, [*args, "--no-progress", "--out", str(study)])  # resumes: all done
    assert result.exit_code == 0, result.output
    text = terminal.file.getvalue()
    table = study_summary(settings, read_records(study / "results.jsonl"))
    assert "…" not in text and all(cell in text for cell in _cells(table))
