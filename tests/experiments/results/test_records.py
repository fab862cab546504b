"""Result records (posenc.experiments.results.records): every run writes an in-distribution record with its
fit flag (retrieval too; the LM's is its perplexity at the training length), the Wilson interval matches
published values, and a bad line is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from _report import (
    write_experiment,
)
from _study import STUDY_TINY
from posenc.experiments import ExperimentConfig, run_experiment
from posenc.experiments.results.records import (
    load_results,
    read_run_records,
    wilson_interval,
)

# ---------------------------------------------------------------------------- 1. fit first


def test_every_run_writes_an_iid_record_with_its_fit_flag(tmp_path):
    config = ExperimentConfig(
        task="copy", encodings=["rope", "alibi"], train_len=3, eval_len=5, num_symbols=8, **STUDY_TINY
    )
    records = run_experiment(config, tmp_path, workers=1)
    assert all(r["metric"] != "iid" for r in records)  # results.jsonl keeps one record per length
    runs = read_run_records(tmp_path)
    assert sorted(r["encoding"] for r in runs) == ["alibi", "rope"]
    for run in runs:
        exact = [
            r["value"]
            for r in records
            if r["encoding"] == run["encoding"] and r["metric"] == "exact_match" and r["length"] <= 3
        ]
        assert len(exact) == 3
        assert run["metric"] == "iid" and run["length"] == 3 and run["scored_by"] == "exact_match"
        assert run["value"] == pytest.approx(sum(exact) / 3, abs=1e-12)
        assert run["examples"] == 3 * 3  # 3 examples at each of the lengths 1..3
        assert run["fit"] is (run["value"] >= 0.95) and run["fit_threshold"] == 0.95
        assert run["steps_trained"] == 3 and "steps_to_fit" not in run


@pytest.mark.parametrize("task", ["passkey", "mqar", "niah"])
def test_retrieval_runs_get_fit_flags_too(task, tmp_path):
    """Retrieval tasks are scored by exact match, so a run fits or not like copy does (without the
    flag their tables ranked runs that never learned the task)."""
    config = ExperimentConfig(task=task, encodings=["alibi"], train_len=24, eval_len=30, **STUDY_TINY)
    run_experiment(config, tmp_path, workers=1)
    (run,) = read_run_records(tmp_path)
    assert run["fit"] is (run["value"] >= 0.95) and run["fit_threshold"] == 0.95


def test_lm_iid_is_the_perplexity_at_the_training_length_without_a_fit_flag(tmp_path):
    config = ExperimentConfig(task="lm", encodings=["alibi"], train_len=8, eval_len=10, **STUDY_TINY)
    records = run_experiment(config, tmp_path, workers=1)
    (run,) = read_run_records(tmp_path)
    (at_l,) = [r["value"] for r in records if r["length"] == 8]
    assert run["value"] == at_l and run["fit"] is None and run["scored_by"] == "perplexity"


# ---------------------------------------------------------------------------- 2. uncertainty


def test_wilson_interval_matches_published_values():
    """Wilson (1927) 95% intervals, as tabulated (e.g. Newcombe 1998, Table I: 0/10, 5/10, 10/10)."""
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    # The formula written out for 81 of 263 (Newcombe's example: 0.2553 to 0.3662).
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    with pytest.raises(ValueError, match="trials"):
        wilson_interval(0, 0)


# ----------------------------------------------------------------------------
# ``posenc report DIR``: a self-contained HTML page read as a reader reads it, in headless Chromium.


def test_load_results_names_the_bad_line(tmp_path: Path) -> None:
    write_experiment(tmp_path, checkpoints=False)
    lines = len((tmp_path / "results.jsonl").read_text().splitlines())
    with (tmp_path / "results.jsonl").open("a") as handle:
        handle.write('{"encoding": "alibi", "length": 8}\n')
    with pytest.raises(ValueError, match=rf"results.jsonl, line {lines + 1}: record lacks metric, value"):
        load_results(tmp_path)
