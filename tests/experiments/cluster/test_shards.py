"""``--shard i/n`` and ``posenc merge``: disjoint parts of the grid, merged back record for record."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from posenc.experiments import ExperimentConfig, run_experiment, summary_table
from posenc.experiments.cluster.shards import Shard, merge_folders
from posenc.experiments.results.summary import missing_runs
from posenc.experiments.train import RunSpec
from posenc.viz.folder import write_figures

TINY = dict(
    task="copy",
    encodings=["nope", "rope", "alibi"],
    seeds=[0, 1],
    train_len=2,
    eval_len=4,
    num_symbols=8,
    d_model=16,
    num_layers=1,
    num_heads=2,
    d_ff=16,
    batch_size=4,
    steps=2,
    warmup=1,
    eval_examples=3,
    checkpoint_every=1,
)


def _sorted_records(path):
    return sorted(json.dumps(json.loads(line), sort_keys=True) for line in path.read_text().splitlines())


def test_two_shards_merged_equal_one_unsharded_run(tmp_path):
    config = ExperimentConfig(**TINY)
    full = run_experiment(config, tmp_path / "full", workers=1)
    first = run_experiment(config, tmp_path / "s0", workers=1, shard=Shard(0, 2))
    second = run_experiment(config, tmp_path / "s1", workers=1, shard=Shard(1, 2))
    assert len(first) + len(second) == len(full) == 3 * 2 * 4 * 2  # encodings x seeds x lengths x metrics
    summary = merge_folders(tmp_path / "merged", [tmp_path / "s0", tmp_path / "s1"], figures=write_figures)
    assert summary.records == len(full) and summary.duplicates == 0 and summary.missing == []
    assert _sorted_records(tmp_path / "merged" / "results.jsonl") == _sorted_records(
        tmp_path / "full" / "results.jsonl"
    )
    merged_config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert (
        merged_config["experiment"]
        == json.loads((tmp_path / "full" / "config.json").read_text())["experiment"]
    )
    assert merged_config["runtime"]["shards"] == ["0/2", "1/2"]
    assert sorted(p.name for p in (tmp_path / "merged" / "checkpoints").iterdir()) == sorted(
        p.name for p in (tmp_path / "full" / "checkpoints").iterdir()
    )
    assert (tmp_path / "merged" / "extrapolation.png").read_bytes()[:4] == b"\x89PNG"
    assert len((tmp_path / "merged" / "results.csv").read_text().splitlines()) == len(full) + 1


def test_a_shard_says_which_runs_it_lacks(tmp_path):
    config = ExperimentConfig(**TINY)
    records = run_experiment(config, tmp_path, workers=1, shard=Shard(1, 2))
    assert json.loads((tmp_path / "config.json").read_text())["runtime"]["shard"] == "1/2"
    # Grid order is seed-major: nope0 rope0 alibi0 nope1 rope1 alibi1; shard 1/2 holds positions 1, 3, 5.
    assert {(r["encoding"], r["seed"]) for r in records} == {("rope", 0), ("nope", 1), ("alibi", 1)}
    lacking = missing_runs("copy", config.encodings, config.seeds, records)
    assert lacking == [RunSpec("nope", 0), RunSpec("alibi", 0), RunSpec("rope", 1)]
    notes = "\n".join(summary_table(config, records, config.make_task().metric).notes)
    assert "incomplete: 3 of 6 runs" in notes and "nope seed 0, alibi seed 0, rope seed 1" in notes
    from posenc.viz.report import render_report

    page = render_report(tmp_path)
    assert 'id="missing"' in page and "incomplete: 3 of 6 runs" in page
    complete = run_experiment(config, tmp_path, workers=1)  # the same folder, unsharded: completes it
    assert 'id="missing"' not in render_report(tmp_path)
    assert "incomplete" not in "\n".join(summary_table(config, complete, config.make_task().metric).notes)


def test_merge_drops_exact_duplicates_and_reports_missing_runs(tmp_path):
    config = ExperimentConfig(**TINY)
    run_experiment(config, tmp_path / "s0", workers=1, shard=Shard(0, 3))
    summary = merge_folders(tmp_path / "m", [tmp_path / "s0"])
    assert summary.missing == [
        RunSpec("rope", 0),
        RunSpec("alibi", 0),
        RunSpec("rope", 1),
        RunSpec("alibi", 1),
    ]
    again = merge_folders(tmp_path / "m2", [tmp_path / "s0", tmp_path / "m"])
    assert again.duplicates == again.records == summary.records
    assert _sorted_records(tmp_path / "m2" / "results.jsonl") == _sorted_records(
        tmp_path / "s0" / "results.jsonl"
    )


def test_merge_refuses_other_settings_naming_the_field_and_writes_nothing(tmp_path):
    run_experiment(ExperimentConfig(**TINY), tmp_path / "a", workers=1, shard=Shard(0, 2))
    run_experiment(ExperimentConfig(**{**TINY, "lr": 1e-3}), tmp_path / "b", workers=1, shard=Shard(1, 2))
    with pytest.raises(ValueError, match=r"other settings \(lr: 0\.001 there vs 0\.003 in"):
        merge_folders(tmp_path / "out", [tmp_path / "a", tmp_path / "b"])
    assert not (tmp_path / "out").exists()


def test_merge_refuses_conflicting_duplicates(tmp_path):
    run_experiment(ExperimentConfig(**TINY), tmp_path / "a", workers=1, shard=Shard(0, 2))
    lines = (tmp_path / "a" / "results.jsonl").read_text().splitlines()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    edited = json.loads(lines[0])
    edited["value"] = 0.5 if edited["value"] != 0.5 else 0.25
    (tmp_path / "b" / "results.jsonl").write_text(json.dumps(edited) + "\n")
    with pytest.raises(ValueError, match=r"both hold run .* with different results"):
        merge_folders(tmp_path / "out", [tmp_path / "a", tmp_path / "b"])
    assert not (tmp_path / "out").exists()


def test_merge_refuses_folders_that_are_not_experiments_and_an_out_holding_results(tmp_path):
    run_experiment(ExperimentConfig(**TINY), tmp_path / "a", workers=1, shard=Shard(0, 2))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        merge_folders(tmp_path / "out", [tmp_path / "a", tmp_path / "empty"])
    with pytest.raises(ValueError, match=r"is not a folder"):
        merge_folders(tmp_path / "out", [tmp_path / "a", tmp_path / "nowhere"])
    with pytest.raises(ValueError, match=r"already holds an experiment \(results\.jsonl\)"):
        merge_folders(tmp_path / "a", [tmp_path / "empty"])
    (tmp_path / "configured").mkdir()
    (tmp_path / "configured" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"already holds an experiment \(config\.json\)"):
        merge_folders(tmp_path / "configured", [tmp_path / "a"])
    with pytest.raises(ValueError, match=r"named twice"):
        merge_folders(tmp_path / "out", [tmp_path / "a", tmp_path / "a"])
    assert not (tmp_path / "out").exists()


def test_cli_shard_and_merge(tmp_path):
    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    base = ["extrapolate", "--encodings", "nope,alibi", "--train-len", "2", "--eval-len", "3", "--steps", "1"]
    base += ["--d-model", "16", "--num-layers", "1", "--d-ff", "16", "--eval-examples", "2", "--workers", "1"]
    base += ["--num-symbols", "8", "--no-progress"]
    for index in (0, 1):
        result = CliRunner().invoke(
            app,
            [*base, "--shard", f"{index}/2", "--out", str(tmp_path / f"s{index}")],
            env={"COLUMNS": "200"},
        )
        assert result.exit_code == 0, result.output
        assert "incomplete: 1 of 2 runs" in result.output
    merged = CliRunner().invoke(
        app, ["merge", str(tmp_path / "m"), str(tmp_path / "s0"), str(tmp_path / "s1")]
    )
    assert merged.exit_code == 0, merged.output
    assert "complete: every (encoding, seed) run" in merged.output
    for bad in ("2/2", "1", "x/2"):
        result = CliRunner().invoke(app, [*base, "--shard", bad, "--out", str(tmp_path / "bad")])
        assert result.exit_code == 2 and "--shard" in result.output, result.output
    assert not (tmp_path / "bad").exists()
    refused = CliRunner().invoke(app, ["merge", str(tmp_path / "m2"), str(tmp_path / "s0"), str(tmp_path)])
    assert refused.exit_code == 2 and "no config.json" in refused.output


def test_merge_refuses_a_folder_that_a_running_process_still_writes(tmp_path):
    import os
    import socket

    from posenc.experiments.results.folders import LOCK_NAME

    run_experiment(ExperimentConfig(**TINY), tmp_path / "a", workers=1, shard=Shard(0, 2))
    (tmp_path / "a" / LOCK_NAME).write_text(f"{os.getpid()} {socket.gethostname()}\n")  # this process: alive
    with pytest.raises(ValueError, match=r"is being written by a running posenc process"):
        merge_folders(tmp_path / "out", [tmp_path / "a"])
    # A lock from another host is assumed alive; one from a dead local pid is not.
    (tmp_path / "a" / LOCK_NAME).write_text("999999999 nohost-that-exists\n")
    with pytest.raises(ValueError, match=r"running posenc process"):
        merge_folders(tmp_path / "out", [tmp_path / "a"])
    (tmp_path / "a" / LOCK_NAME).write_text(f"999999999 {socket.gethostname()}\n")
    assert merge_folders(tmp_path / "out", [tmp_path / "a"]).records > 0
