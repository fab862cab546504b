"""``--preset``: published setups, their numbers with citations, and the published-vs-ours table.

The runs here are tiny (a few steps): they test the wiring and the table, not the numbers.
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from posenc.experiments import ExperimentConfig
from posenc.experiments.presets import (
    PAPER_PRESETS,
    apply_preset,
    mean_reciprocal_rank,
    perplexity_ratios,
    published,
    reciprocal_ranks,
    window_perplexity,
)

SCALE = ["--steps", "1", "--d-model", "16", "--num-layers", "1", "--num-heads", "2", "--d-ff", "16"]
SCALE += ["--batch-size", "4", "--eval-examples", "1", "--workers", "1", "--no-progress"]


def _cli(args):
    from posenc.cli.app import _load_command_modules, app, console

    _load_command_modules()
    # Wide enough for the preset tables' headers on one line, whatever terminal a test worker has
    # (rich reads its width once per console, not from each CliRunner's environment).
    width, console.width = console.width, 200
    try:
        return CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    finally:
        console.width = width


def test_every_preset_has_published_numbers_with_a_full_citation():
    for name, preset in PAPER_PRESETS.items():
        entry = published(name)  # read through importlib.resources: the file ships as package data
        cite = entry["citation"]
        assert cite["authors"] and all(
            isinstance(author, str) and " " in author for author in cite["authors"]
        )
        assert cite["title"] and cite["venue"] and isinstance(cite["year"], int) and cite["arxiv"]
        assert ("Table" in entry["source"] or "Figure" in entry["source"]) and isinstance(
            entry["approximate"], bool
        )
        assert set(entry["paper_names"]) == set(preset.settings["encodings"])
    nope = published("nope-paper")
    assert {"what", "why"} <= set(nope["ours_changes"])  # what posenc changed from the paper's setup
    assert set(nope["values"]) == set(PAPER_PRESETS["nope-paper"].settings["encodings"])
    # Reciprocal ranks of five methods sum to 1/1 + ... + 1/5 = 2.283 (two-decimal values: within 0.02).
    assert abs(sum(nope["values"].values()) - sum(1 / k for k in range(1, 6))) < 0.02
    alibi = published("alibi-paper")
    for curve in alibi["perplexity"].values():
        assert set(curve) == {str(alibi["train_length"]), *map(str, alibi["eval_lengths"].values())}


def test_window_perplexity_is_exp_of_the_mean_log_perplexity():
    curve = {1: math.e, 2: math.e, 3: math.e**3, 4: math.e**3}
    assert window_perplexity(curve, 2) == pytest.approx(math.e)
    assert window_perplexity(curve, 4) == pytest.approx(math.e**2)  # exp((1 + 1 + 3 + 3) / 4)
    assert window_perplexity(curve, 5) is None  # position 5 was not measured


def test_perplexity_ratios_average_the_ratio_of_each_seed():
    records = [
        {"metric": "perplexity", "encoding": "alibi", "seed": seed, "length": n, "value": value}
        for seed, values in ((0, [2.0, 2.0, 8.0, 8.0]), (1, [4.0, 4.0, 4.0, 4.0]))
        for n, value in enumerate(values, start=1)
    ]
    records.append({"metric": "perplexity", "encoding": "rope", "seed": 0, "length": 1, "value": 100.0})
    ratios = perplexity_ratios(records, "alibi", 2, [2, 4])
    # seed 0: window(4) = exp(mean(log 2, log 2, log 8, log 8)) = 4, window(2) = 2 -> 2; seed 1: 1.
    assert ratios[2] == pytest.approx((2.0 + 1.0) / 2)
    assert ratios[4] is None  # 8 positions were not measured


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


def test_apply_preset_sets_the_published_setup_and_refuses_contradictions():
    base = ExperimentConfig(steps=7, d_model=32)
    configs = apply_preset("nope-paper", base, explicit={"steps": 7, "d_model": 32})
    assert [c.task for c in configs] == ["copy", "count_copy", "reverse"]
    for config in configs:
        assert (config.train_len, config.eval_len, config.seeds) == (20, 40, [0, 1, 2])
        assert config.encodings == ["nope", "rope", "alibi", "t5", "sinusoidal"]
        assert (config.steps, config.d_model) == (7, 32)  # the scale stays the command line's
    assert [c.task for c in apply_preset("nope-paper", base, {"train_len": 20}, task="reverse")] == [
        "reverse"
    ]
    with pytest.raises(
        ValueError, match=r"--preset nope-paper runs --task copy, count_copy, reverse; --task lm"
    ):
        apply_preset("nope-paper", base, {}, task="lm")
    with pytest.raises(ValueError, match=r"sets --train-len 20 .*drop --train-len 16"):
        apply_preset("nope-paper", base, {"train_len": 16})
    with pytest.raises(ValueError, match=r"sets --encodings sinusoidal,rope,t5,alibi"):
        apply_preset("alibi-paper", base, {"encodings": ["rope"]})
    with pytest.raises(ValueError, match=r"unknown --preset 'gpt'; available: nope-paper, alibi-paper"):
        apply_preset("gpt", base, {})
    alibi = apply_preset("alibi-paper", base, {"seeds": [3]})
    assert [(c.task, c.train_len, c.eval_len) for c in alibi] == [("lm", 64, 512)]


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


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "lm"], "--task lm is not one of them"),
        (["--train-len", "16"], "sets --train-len 20"),
        (["--seeds", "0,5"], "sets --seeds 0,1,2 (the published setup); drop --seeds 0,5"),
        (["--corpus", "README.md"], "corpus is only used by the lm task"),
        (["--shard", "3/3"], "--shard 3/3"),
    ],
)
def test_cli_preset_with_conflicting_options_is_an_error_before_anything_is_written(tmp_path, args, message):
    result = _cli(["extrapolate", "--preset", "nope-paper", *args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "out").exists()


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


def test_cli_alibi_paper_prints_paper_ratios_from_table_3(tmp_path):
    result = _cli(["extrapolate", "--preset", "alibi-paper", *SCALE, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "alibi-paper: perplexity ratio" in out and "Table 3" in out and "Press" in out
    # Table 3 by hand: sinusoidal 51.09 / 19.34 = 2.64, 284.88 / 19.34 = 14.73; ALiBi 18.05 / 18.66 = 0.97.
    for text in ("2.64", "14.73", "0.97", "paper 8x", "ours 8x"):
        assert text in out, out
    ours_row = next(line for line in out.splitlines() if "alibi (ALiBi)" in line)
    assert ours_row.count("-") < 2  # our ratios were measured (not '-')
    assert json.loads((tmp_path / "lm" / "config.json").read_text())["preset"] == "alibi-paper"
    import shutil

    from posenc.viz.report import render_report

    shutil.rmtree(
        tmp_path / "lm" / "checkpoints"
    )  # attention maps at 512 positions take seconds; not tested here
    page = render_report(tmp_path / "lm")
    assert 'id="published"' in page and "14.73" in page and "Press, Smith, Lewis (2022)" in page
    assert "Kendall&#x27;s τ vs Table 3&#x27;s order" in page and "ours ppl at L" in page


def test_the_published_table_says_when_ours_rests_on_a_shard(tmp_path):
    from posenc.experiments.presets import comparison_for_folder

    args = ["extrapolate", "--preset", "alibi-paper", *SCALE, "--shard", "0/2", "--out", str(tmp_path)]
    result = _cli(args)
    assert result.exit_code == 0, result.output
    notes = " ".join(comparison_for_folder(tmp_path / "lm").notes)
    # Grid order sinusoidal, rope, t5, alibi: shard 0/2 holds sinusoidal and t5.
    assert (
        "incomplete, ours rests on part of the grid: lm lacks 2 run(s) (rope seed 0, alibi seed 0)" in notes
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


# ---------------------------------------------------------------------------- agreement (Kendall's τ)


def test_kendall_tau_matches_known_values_ties_included():
    from posenc.experiments.results.agreement import kendall_tau

    # scipy.stats.kendalltau's docstring example (tau-b): tau = -0.47140452079103173.
    assert kendall_tau([12, 2, 1, 12, 2], [1, 4, 7, 1, 0]) == pytest.approx(-0.47140452079103173)
    assert kendall_tau([1, 2, 3, 4, 5], [5, 4, 3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)  # C = 2, D = 1 of 3 pairs
    # One tie in x: 6 pairs, 5 concordant, 1 tied in x -> 5 / sqrt(5 * 6).
    assert kendall_tau([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(5 / math.sqrt(30))
    assert kendall_tau([1, 1, 1], [1, 2, 3]) is None and kendall_tau([1], [2]) is None


def test_seed_resamples_enumerate_the_bootstrap_exactly():
    from posenc.experiments.results.agreement import seed_bootstrap, seed_resamples

    resamples = seed_resamples([0, 1, 2])
    assert len(resamples) == 10 and sum(p for p, _ in resamples) == pytest.approx(1.0)
    probability = {tuple(sorted(counts.items())): p for p, counts in resamples}
    assert probability[((0, 3),)] == pytest.approx(1 / 27)
    assert probability[((0, 1), (1, 1), (2, 1))] == pytest.approx(6 / 27)
    values = {0: 0.0, 1: 1.0, 2: 2.0}

    def mean_of(resample):
        counts = resample["t"]
        return sum(values[s] * c for s, c in counts.items()) / sum(counts.values())

    # The extremes 0 and 2 each have probability 1/27 > 2.5%: the 95% percentile interval is [0, 2].
    exact = seed_bootstrap({"t": [0, 1, 2]}, mean_of)
    assert (exact.low, exact.high) == (0.0, 2.0) and "exact" in exact.method
    drawn = seed_bootstrap({"t": [0, 1, 2]}, mean_of, exact_limit=0, draws=2000)
    assert "Monte Carlo" in drawn.method and drawn.low <= 1 / 3 and drawn.high >= 5 / 3
    assert seed_bootstrap({"t": [0]}, mean_of) is None  # one seed: nothing to resample


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


def _lm_records(base, longer, seeds=(0, 1, 2), train_len=64, eval_len=512):
    """Perplexity records: ``base[e]`` at positions 1..L, ``longer[e]`` past L, every seed."""
    return [
        {"encoding": e, "task": "lm", "seed": seed, "metric": "perplexity", "length": n}
        | {"value": base[e] if n <= train_len else longer[e]}
        for e in base
        for seed in seeds
        for n in range(1, eval_len + 1)
    ]


def test_alibi_paper_table_checks_the_fit_at_l_and_gives_tau_per_factor():
    preset = PAPER_PRESETS["alibi-paper"]
    # t5 is 25% above the best at L (> 10%): it did not fit and is left out of tau.
    base = {"sinusoidal": 4.0, "rope": 4.0, "t5": 5.0, "alibi": 4.0}
    longer = {"sinusoidal": 40.0, "rope": 8.0, "t5": 5.0, "alibi": 3.0}
    table = preset.compare(preset, {"lm": ({}, _lm_records(base, longer))})
    rows = {row[0].split()[0]: row for row in table.rows}
    assert rows["t5"][-2:] == ["5.00", "0/3"] and rows["alibi"][-2:] == ["4.00", "3/3"]
    # Ours orders alibi < rope < sinusoidal as Table 3 does at every factor: tau = 1 (seeds agree).
    assert "2x +1.00 [+1.00, +1.00]; 4x +1.00 [+1.00, +1.00]; 8x +1.00 [+1.00, +1.00]" in table.title
    assert any("did not fit: t5" in note for note in table.notes)
    # Swap sinusoidal and rope past L: one discordant pair of three -> (2 - 1) / 3.
    swapped = longer | {"sinusoidal": 8.0, "rope": 40.0}
    table = preset.compare(preset, {"lm": ({}, _lm_records(base, swapped))})
    assert "2x +0.33 [+0.33, +0.33]" in table.title
    one_seed = preset.compare(preset, {"lm": ({}, _lm_records(base, longer, seeds=(0,)))})
    assert "8x +1.00;" not in one_seed.title and one_seed.title.endswith("8x +1.00")
