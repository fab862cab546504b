"""The NoPE paper's preset (posenc.experiments.presets.nope_paper): reciprocal ranks sharing ties, the mean
past L only, training until fit, the published table beside ours with Kendall's tau and whether each
adjacent pair is reproduced."""

from __future__ import annotations

import json
import math

import pytest

from _presets import SCALE, _cli
from posenc.experiments import ExperimentConfig
from posenc.experiments.presets import (
    PAPER_PRESETS,
    apply_preset,
    mean_reciprocal_rank,
    reciprocal_ranks,
)


def test_reciprocal_ranks_share_ties():
    ranks = reciprocal_ranks({"a": 1.0, "b": 0.5, "c": 0.5, "d": 0.0})
    assert ranks == pytest.approx({"a": 1.0, "b": (1 / 2 + 1 / 3) / 2, "c": (1 / 2 + 1 / 3) / 2, "d": 1 / 4})
    assert sum(reciprocal_ranks({"x": 0.0, "y": 0.0, "z": 0.0}).values()) == pytest.approx(1 + 1 / 2 + 1 / 3)


def test_mean_reciprocal_rank_counts_lengths_past_l_only():
    curves = {
        "copy": {"p": {1: 0.0, 3: 1.0, 4: 0.2}, "q": {1: 1.0, 3: 0.5, 4: 0.9}},
        "reverse": {"p": {3: 0.1}, "q": {3: 0.3}},
    }
    mrr = mean_reciprocal_rank(curves, ["p", "q"], train_len=2)
    # scenarios: copy@3 (p first), copy@4 (q first), reverse@3 (q first); length 1 is in-distribution.
    assert mrr == pytest.approx({"p": (1 + 0.5 + 0.5) / 3, "q": (0.5 + 1 + 1) / 3})


def test_nope_paper_trains_until_fit_unless_the_command_line_says_otherwise():
    base = ExperimentConfig()
    (reverse,) = apply_preset("nope-paper", base, {}, task="reverse")
    # The budget README.md's "Published setups side by side" states (found by experiment).
    assert (reverse.until_fit, reverse.steps, reverse.lr, reverse.num_layers) == (True, 6000, 1e-3, 4)
    assert (reverse.fit_threshold, reverse.fit_margin) == (0.95, 0.02)  # stops at 97% held out
    given = {"steps": 300, "lr": 3e-3, "until_fit": False}  # what the command line gave, also in the config
    (mine,) = apply_preset("nope-paper", ExperimentConfig(**given), given, task="copy")
    assert (mine.until_fit, mine.steps, mine.lr, mine.num_layers) == (False, 300, 3e-3, 4)
    # The reduced form: a subset of the published seeds.
    assert [c.seeds for c in apply_preset("nope-paper", base, {"seeds": [0]})] == [[0], [0], [0]]


def test_cli_nope_paper_prints_published_beside_ours_and_the_report_shows_it(tmp_path):
    result = _cli(["extrapolate", "--preset", "nope-paper", "--task", "copy", *SCALE, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "nope-paper: published beside ours" in out and "Kazemnejad" in out and "Figure 1" in out
    for cells in (("nope (NoPE)", "0.69"), ("sinusoidal (APE, sinusoidal)", "0.22"), ("t5", "0.55")):
        assert all(cell in out for cell in cells)
    assert "not run here: count_copy, reverse" in " ".join(out.split())
    assert "Kendall's τ vs the paper's order" in " ".join(out.split())  # beside the paper's MRR column
    config = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert config["preset"] == "nope-paper" and config["experiment"]["train_len"] == 20
    # The preset's training defaults, except what the command line gave (--num-layers 1, --steps 1).
    experiment = config["experiment"]
    assert (experiment["until_fit"], experiment["fit_margin"], experiment["lr"]) == (True, 0.02, 1e-3)
    assert (experiment["num_layers"], experiment["steps"]) == (1, 1)
    records = [json.loads(line) for line in (tmp_path / "copy" / "results.jsonl").read_text().splitlines()]
    assert {(r["encoding"], r["seed"]) for r in records} == {
        (e, s) for e in ("nope", "rope", "alibi", "t5", "sinusoidal") for s in (0, 1, 2)
    }
    assert max(r["length"] for r in records) == 40
    from posenc.experiments.presets import comparison_for_folder

    table = comparison_for_folder(tmp_path / "copy")  # what posenc report shows for this folder
    assert table.rows[0][:2] == ["nope (NoPE)", "0.69"] and table.columns[-1] == "copy >20"
    # Trained until fit (at most --steps 1): the steps each run took, from runs.jsonl ("no": not fit).
    assert (
        "copy, steps to fit per seed (checked on held-out examples; no: not within the cap): nope no, no, no"
        in (" ".join(table.notes))
    )


def test_nope_paper_table_ranks_only_encodings_that_fit():
    preset = PAPER_PRESETS["nope-paper"]
    iid = {"rope": 1.0, "t5": 1.0, "nope": 0.5, "alibi": 0.5, "sinusoidal": 0.0}
    beyond = {"rope": 0.3, "t5": 0.6, "nope": 0.9, "alibi": 0.0, "sinusoidal": 0.0}
    records = [
        {"encoding": e, "task": "copy", "seed": seed, "metric": "exact_match", "length": n}
        | {"value": iid[e] if n <= 20 else beyond[e]}
        for e in iid
        for seed in (0, 1, 2)
        for n in range(1, 41)
    ]
    table = preset.compare(preset, {"copy": ({"fit_threshold": 0.95}, records)})
    rows = {row[0].split()[0]: row for row in table.rows}
    # Only rope and t5 fit (in-distribution 100% >= 95%): t5 ranks first at every length past 20.
    assert rows["t5"][2:4] == ["1.00", "3/3"] and rows["rope"][2:4] == ["0.50", "3/3"]
    assert rows["nope"][2:4] == ["not ranked", "0/3"]  # best beyond L, but it did not fit
    assert rows["nope"][4] == "90.0%"
    assert any(
        "not ranked, did not fit" in note and "nope, alibi, sinusoidal" in note for note in table.notes
    )


def _constant_records(task, per_seed, train_len=20, eval_len=24, iid=None):
    """Exact-match records: ``per_seed[encoding][seed]`` at every length past L, ``iid`` (1.0) below."""
    return [
        {"encoding": e, "task": task, "seed": seed, "metric": "exact_match", "length": n}
        | {"value": (iid or {}).get(e, 1.0) if n <= train_len else value}
        for e, by_seed in per_seed.items()
        for seed, value in enumerate(by_seed)
        for n in range(1, eval_len + 1)
    ]


def test_nope_paper_table_gives_kendall_tau_with_its_interval_across_seeds():
    preset = PAPER_PRESETS["nope-paper"]
    # Paper order: nope > t5 > alibi > rope > sinusoidal. Ours: nope's mean (0.633) beats t5 (0.6)
    # only when seed 2 (0.9) is drawn; a resample without it (probability (2/3)^3 = 8/27) puts t5
    # first: tau = (9 - 1) / 10 = 0.8 there, 1.0 otherwise -> interval [0.8, 1.0].
    per_seed = {
        "nope": [0.5, 0.5, 0.9],
        "t5": [0.6, 0.6, 0.6],
        "alibi": [0.4, 0.4, 0.4],
        "rope": [0.3, 0.3, 0.3],
        "sinusoidal": [0.2, 0.2, 0.2],
    }
    table = preset.compare(preset, {"copy": ({"fit_threshold": 0.95}, _constant_records("copy", per_seed))})
    assert "Kendall's τ vs the paper's order +1.00 [+0.80, +1.00]" in table.title
    note = next(n for n in table.notes if n.startswith("agreement"))
    assert (
        "= +1.00, 95% interval [+0.80, +1.00]" in note and "exact bootstrap over seeds (10 distinct" in note
    )
    # A tie in ours (nope = t5 at 0.6): tau-b = 9 / sqrt(9 * 10).
    tied = per_seed | {"nope": [0.6, 0.6, 0.6]}
    table = preset.compare(preset, {"copy": ({"fit_threshold": 0.95}, _constant_records("copy", tied))})
    assert f"+{9 / math.sqrt(90):.2f} [" in table.title


def test_nope_paper_table_says_per_task_whether_each_adjacent_pair_is_reproduced():
    preset = PAPER_PRESETS["nope-paper"]
    per_seed = {
        "nope": [0.9, 0.8, 0.85],  # nope - t5: +0.5, +0.5, +0.5 -> reproduced
        "t5": [0.4, 0.3, 0.35],  # t5 - alibi: -0.3, -0.4, -0.35 -> reversed
        "alibi": [0.7, 0.7, 0.7],  # alibi - rope: +0.01, -0.01, +0.02 -> cannot tell
        "rope": [0.69, 0.71, 0.68],
        "sinusoidal": [0.1, 0.1, 0.1],  # did not fit: rope > sinusoidal is not compared
    }
    records = _constant_records("reverse", per_seed, iid={"sinusoidal": 0.5})
    table = preset.compare(preset, {"reverse": ({"fit_threshold": 0.95}, records)})
    note = next(n for n in table.notes if n.startswith("reverse, the paper's order pair by pair"))
    assert "nope > t5 reproduced (+50.0% [+50.0%, +50.0%])" in note
    assert "t5 > alibi reversed (-35.0%" in note
    assert "alibi > rope cannot tell (+0.7%" in note
    assert "rope > sinusoidal not compared (sinusoidal did not fit)" in note
