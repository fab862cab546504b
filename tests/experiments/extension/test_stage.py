"""The extension stage end to end on a tiny trained folder: rows paired by seed, ranked by the
folder tools, resumed after an interruption record for record, and bad input refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from posenc.cli.app import app, load_command_modules
from posenc.experiments.config import ExperimentConfig
from posenc.experiments.extension.stage import ExtensionConfig, run_extension
from posenc.experiments.results.compare import compare_rows
from posenc.experiments.results.records import read_records
from posenc.experiments.runner import run_experiment
from posenc.experiments.train import INTERRUPT_ENV, Interrupted

TINY = dict(
    task="lm", train_len=4, eval_len=5, steps=6, batch_size=8, eval_examples=3, d_model=16, num_heads=2,
    d_ff=32, num_layers=1, warmup=2, checkpoint_every=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ext") / "base"
    config = ExperimentConfig(encodings=["rope", "learned", "alibi"], seeds=[0, 1], **TINY)
    run_experiment(config, folder, workers=1)
    return folder


def _values(folder):
    return sorted(
        (r["encoding"], r["seed"], r["length"], r["metric"], r["value"])
        for r in read_records(folder / "results.jsonl")
    )


def test_every_run_continues_under_every_recipe_paired_by_seed(trained, tmp_path):
    out = tmp_path / "to8"
    ext = ExtensionConfig(to_len=6, recipes=["continue", "full"], steps=3, eval_len=7)
    records = run_extension(trained, ext, out)
    rows = {r["encoding"] for r in records}
    assert rows == {f"{e}{s}" for e in ("rope", "learned", "alibi") for s in ("", " > continue", " > full")}
    for row in rows:
        seen = {(r["seed"], r["length"]) for r in records if r["encoding"] == row}
        assert seen == {(seed, n) for seed in (0, 1) for n in range(1, 8)}
    runs = read_records(out / "runs.jsonl")
    continued = [r for r in runs if r["recipe"] == "continue"]
    assert all(r["steps_trained"] == 3 and r["positions_seen"] > 0 for r in continued)
    full = [r for r in runs if r["recipe"] == "full"]
    assert all(r["steps_trained"] == TINY["steps"] for r in full)
    assert all(
        r["steps_trained"] == TINY["steps"] and r["positions_seen"] == 0
        for r in runs
        if r["recipe"] == "none"
    )
    settings = json.loads((out / "config.json").read_text())
    assert settings["experiment"]["train_len"] == 6 and settings["extension"]["recipes"] == [
        "continue",
        "full",
    ]
    comparison = compare_rows(
        out,
        "rope > continue",
        "rope",
    )
    assert set(comparison.scores) == {0, 1}


def test_the_base_row_scores_the_trained_run_as_it_was(trained, tmp_path):
    """The row named by the encoding is the run's checkpoint evaluated again: at the lengths both
    folders score, it equals the run's own records."""
    out = tmp_path / "to6"
    run_extension(trained, ExtensionConfig(to_len=5, recipes=["continue"], steps=1, eval_len=5), out)
    base = {
        (r["encoding"], r["seed"], r["length"]): r["value"] for r in read_records(trained / "results.jsonl")
    }
    again = {
        (r["encoding"], r["seed"], r["length"]): r["value"]
        for r in read_records(out / "results.jsonl")
        if r["recipe"] == "none"
    }
    assert again and all(again[key] == pytest.approx(base[key], abs=1e-12) for key in again)


def test_an_interrupted_extension_resumes_to_the_records_of_a_straight_run(trained, tmp_path, monkeypatch):
    ext = ExtensionConfig(to_len=6, recipes=["pi", "pose"], steps=5, eval_len=6)
    single = tmp_path / "base"
    shutil.copytree(trained, single)
    config = json.loads((single / "config.json").read_text())
    config["experiment"]["encodings"] = ["rope"]
    (single / "config.json").write_text(json.dumps(config))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_extension(single, ext, straight)
    monkeypatch.setenv(INTERRUPT_ENV, "3")  # stop (checkpoint saved) 3 steps into the first recipe
    with pytest.raises(Interrupted):
        run_extension(single, ext, resumed)
    assert list((resumed / "checkpoints").glob("*.pt"))
    monkeypatch.delenv(INTERRUPT_ENV)
    run_extension(single, ext, resumed)
    assert _values(resumed) == _values(straight)
    lines = (resumed / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(set(lines))  # nothing duplicated


def test_added_recipes_join_the_folder_and_finished_rows_are_kept(trained, tmp_path):
    out = tmp_path / "grow"
    run_extension(trained, ExtensionConfig(to_len=5, recipes=["continue"], steps=1, eval_len=5), out)
    before = {(r["run"], r["length"], r["value"]) for r in read_records(out / "results.jsonl")}
    run_extension(trained, ExtensionConfig(to_len=5, recipes=["continue", "full"], steps=1, eval_len=5), out)
    after = {(r["run"], r["length"], r["value"]) for r in read_records(out / "results.jsonl")}
    assert before < after


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"to_len": 4}, "must be larger than the run's train_len L=4"),
        ({"to_len": 3}, "must be larger than the run's train_len"),
        ({"recipes": ["pi"]}, "'pi' does not apply to 'learned'"),
        ({"recipes": ["interpolate_table"]}, "'interpolate_table' does not apply to 'rope'"),
        ({"eval_len": 5}, "--eval-len 5 must be at least --to 6"),
        ({"steps": 0}, "--steps must be a positive integer"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_written(trained, tmp_path, settings, message):
    ext = ExtensionConfig(**{"to_len": 6, "recipes": ["continue"], "steps": 2, **settings})
    with pytest.raises(ValueError, match=message):
        run_extension(trained, ext, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_a_folder_without_checkpoints_is_refused(trained, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(trained / "config.json", bare / "config.json")
    with pytest.raises(ValueError, match="has no checkpoint for rope seed 0"):
        run_extension(bare, ExtensionConfig(to_len=6, recipes=["continue"], steps=1), tmp_path / "x")
    with pytest.raises(ValueError, match=r"has no config\.json"):
        run_extension(tmp_path / "nothing", ExtensionConfig(to_len=6, recipes=["continue"], steps=1))


def test_an_extension_is_never_written_into_a_folder_of_another_run(trained, tmp_path):
    ext = ExtensionConfig(to_len=5, recipes=["continue"], steps=1, eval_len=5)
    with pytest.raises(ValueError, match="holds a `posenc extrapolate` experiment"):
        run_extension(trained, ext, _experiment_folder(tmp_path))
    with pytest.raises(ValueError, match="the run's own folder"):
        run_extension(trained, ext, trained)
    out = tmp_path / "one"
    run_extension(trained, ext, out)
    with pytest.raises(ValueError, match="other settings"):
        run_extension(trained, ExtensionConfig(to_len=5, recipes=["continue"], steps=2, eval_len=5), out)
    other = tmp_path / "other-base"
    shutil.copytree(trained, other)
    with pytest.raises(ValueError, match="extends another run"):
        run_extension(other, ext, out)
    with pytest.raises(ValueError, match="is an extension folder"):
        run_extension(out, ExtensionConfig(to_len=8, recipes=["continue"], steps=1), tmp_path / "chain")


def _experiment_folder(tmp_path):
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"experiment": ExperimentConfig().to_dict()}))
    return folder


def test_the_command_refuses_a_bad_recipe_naming_it(trained, tmp_path):
    load_command_modules()
    result = CliRunner().invoke(
        app,
        [
            "extend",
            str(trained),
            "--to",
            "6",
            "--steps",
            "1",
            "--recipes",
            "stretch",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 2
    assert "--recipes 'stretch': unknown recipe" in " ".join(result.output.split())
