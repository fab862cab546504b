"""Sweeps that do not over-claim (posenc.experiments.study.sweep; issue 58, item 4): a grid's settings
written out by hand, the tuning windows fixed before any score, the setting chosen on them alone (a
test that fails if the held-out windows leak into the choice), every paired test on the held-out
windows (scipy on those windows only), bad input refused by name before any weight loads, and the
sweep run end to end on a tiny random Llama."""

from __future__ import annotations

import json
import math

import pytest

from posenc.experiments.study.paired import study_comparisons
from posenc.experiments.study.reading import verdict_table
from posenc.experiments.study.sweep import chosen_settings, expand_grid, held_out, split_windows

scipy_stats = pytest.importorskip("scipy.stats")

CONTEXT = 64


def test_a_grid_is_every_combination_of_its_values():
    assert expand_grid("self_extend:group_size=2|4,neighbor_window=8|16") == [
        "self_extend:group_size=2,neighbor_window=8",
        "self_extend:group_size=2,neighbor_window=16",
        "self_extend:group_size=4,neighbor_window=8",
        "self_extend:group_size=4,neighbor_window=16",
    ]
    assert expand_grid("self_extend:group_size=2|4,neighbor_window=8") == [
        "self_extend:group_size=2,neighbor_window=8",
        "self_extend:group_size=4,neighbor_window=8",
    ]
    assert expand_grid("yarn:2|3") == ["yarn:2", "yarn:3"]
    assert expand_grid("dca") == ["dca"] and expand_grid("yarn:2/3") == ["yarn:2/3"]
    for empty in ("self_extend:group_size=", "self_extend:group_size=2||4", "yarn:2|"):
        with pytest.raises(ValueError, match=r"--eval-variants .* empty setting"):
            expand_grid(empty if "|" in empty else empty + "|4")


def test_the_tuning_windows_are_fixed_by_the_seed_and_leave_two_held_out():
    first = split_windows(8, 3, seed=0)
    assert first == split_windows(8, 3, seed=0) == sorted(set(first)) and len(first) == 3
    assert all(0 <= w < 8 for w in first)
    assert {tuple(split_windows(8, 3, seed)) for seed in range(10)} != {tuple(first)}  # the seed draws them
    assert split_windows(8, 0, seed=0) == []
    with pytest.raises(ValueError, match=r"--tuning-windows 7 of --eval-examples 8 leaves 1 held-out"):
        split_windows(8, 7, seed=0)


def _ppl(label, bucket, window_nll):
    lo, hi = bucket
    nll = sum(window_nll) / len(window_nll)
    return {"run": f"r-{label}-{hi}", "encoding": label, "task": "text-lm", "metric": "perplexity",
            "bucket": [lo, hi], "length": hi, "value": math.exp(nll), "nll": nll, "tokens": (hi - lo) * len(window_nll),
            "window": 2 * CONTEXT, "examples": len(window_nll), "window_nll": list(window_nll)}  # fmt: skip


SETTINGS = {
    "study": True,
    "hf_model": "m",
    "train_len": CONTEXT,
    "eval_examples": 6,
    "encodings": ["m", "m + se2", "m + se4", "m + dca"],
    "variant_names": {"m": "none", "m + se2": "se:2", "m + se4": "se:4", "m + dca": "dca"},
    "sweeps": {"se:2|4": ["se:2", "se:4"]},
    "tuning_windows": [1, 4],
}
HELD = [0, 2, 3, 5]


def _records(se2, se4, dca=(2.1, 2.0, 2.2, 2.1, 2.0, 2.3)):
    rows = {"m": [3.0, 3.1, 2.9, 3.3, 3.0, 3.2], "m + se2": se2, "m + se4": se4, "m + dca": dca}
    records = []
    for label, values in rows.items():
        records.append(_ppl(label, (32, 64), [2.0] * 6))
        records.append(_ppl(label, (64, 96), values))
        records.append(_ppl(label, (96, 128), [v + 0.1 for v in values]))
    return records


# se2 is better on the tuning windows (1, 4); se4 is far better on the held-out ones.
SE2 = [2.5, 1.0, 2.5, 2.5, 1.0, 2.5]
SE4 = [1.5, 1.2, 1.5, 1.5, 1.2, 1.5]


def test_the_chosen_setting_reads_the_tuning_windows_only():
    [choice] = chosen_settings(SETTINGS, _records(SE2, SE4))
    assert choice.grid == "se:2|4" and choice.chosen == "m + se2"  # over all six windows se4 would win
    assert [label for label, _ in choice.scores] == ["m + se2", "m + se4"]
    assert dict(choice.scores)["m + se2"] == pytest.approx(1.0 + 0.05)  # (1.0 + 1.1) / 2, both buckets
    # Any held-out value may change: the choice may not.
    for value in (-50.0, 0.0, 50.0):
        moved = [value if w in HELD else v for w, v in enumerate(SE2)]
        assert chosen_settings(SETTINGS, _records(moved, SE4))[0].chosen == "m + se2"
    # A tuning window's value changes it.
    worse = [9.0 if w == 1 else v for w, v in enumerate(SE2)]
    assert chosen_settings(SETTINGS, _records(worse, SE4))[0].chosen == "m + se4"


def test_every_test_and_number_reads_the_held_out_windows_and_the_chosen_setting_only():
    records = _records(SE2, SE4)
    comparisons = study_comparisons(SETTINGS, records)
    assert {c["a"] for c in comparisons} | {c["b"] for c in comparisons} == {"m", "m + se2", "m + dca"}
    pair = next(
        c for c in comparisons if (c["a"], c["b"]) == ("m + se2", "m + dca") and c["bucket"] == [64, 96]
    )
    a = [SE2[w] for w in HELD]
    b = [[2.1, 2.0, 2.2, 2.1, 2.0, 2.3][w] for w in HELD]
    assert pair["n"] == 4 and pair["p"] == pytest.approx(scipy_stats.ttest_rel(a, b).pvalue, rel=1e-9)
    assert pair["mean_diff"] == pytest.approx(sum(a) / 4 - sum(b) / 4)
    kept, _ = held_out(SETTINGS, records)
    row = next(r for r in kept if r["encoding"] == "m + se4" and r["bucket"] == [64, 96])
    assert row["window_nll"] == [1.5] * 4 and row["examples"] == 4 and row["tokens"] == 32 * 4
    assert row["value"] == pytest.approx(math.exp(1.5))
    table = verdict_table(SETTINGS, records)
    notes = " ".join(table.notes)
    assert "chosen on the 2 tuning window(s) [1, 4]" in notes and "other 4 held-out window(s)" in notes
    assert "se:2|4: chose se2" in notes
    assert "recommended at (96, 128]: dca" in notes and "against the next best, se2" in notes
    assert all("se4" not in row[1] for row in table.rows)


# ---------------------------------------------------------------------------- the plan and the run

transformers = pytest.importorskip("transformers")


def _config():
    return transformers.LlamaConfig(
        vocab_size=420, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=CONTEXT,
    )  # fmt: skip


def _plan(**options):
    from posenc.experiments.study.plan import plan_study

    base = dict(task="text-lm", eval_examples=6, variants=["none", "rerope:window=16|32"], tuning_windows=2)
    return plan_study(_config(), "LlamaForCausalLM", "tiny", **{**base, **options})


def test_the_plan_records_the_grid_and_the_split_and_refuses_what_cannot_be_chosen_fairly():
    plan = _plan()
    settings = plan.settings
    assert settings["sweeps"] == {"rerope:window=16|32": ["rerope:window=16", "rerope:window=32"]}
    assert settings["tuning_windows"] == split_windows(6, 2, seed=0)
    assert [unit[0] for unit in plan.units] == ["none", "rerope:window=16", "rerope:window=32"]
    with pytest.raises(ValueError, match=r"is a grid: give --tuning-windows K"):
        _plan(tuning_windows=0)
    with pytest.raises(ValueError, match=r"--tuning-windows chooses a grid's setting"):
        _plan(variants=["none", "rerope"])
    with pytest.raises(ValueError, match=r"--tuning-windows 5 of --eval-examples 6 leaves 1 held-out"):
        _plan(tuning_windows=5)
    with pytest.raises(ValueError, match=r"window=200 is not below --eval-len 128"):
        _plan(variants=["rerope:window=16|200"])
    with pytest.raises(ValueError, match=r"empty setting"):
        _plan(variants=["rerope:window=16|"])
    with pytest.raises(ValueError, match=r"--tuning-windows splits perplexity windows"):
        _plan(task="text-passkey", lengths=[100])
    # Without a grid nothing is added: a folder from before grids plans the same settings.
    assert "sweeps" not in _plan(variants=["none", "rerope"], tuning_windows=0).settings


@pytest.mark.hf
def test_a_sweep_runs_chooses_on_tuning_windows_and_reports_held_out(tmp_path):
    pytest.importorskip("tokenizers")
    from typer.testing import CliRunner

    from _tiny_hf import TEXT, save_tiny_llama
    from posenc.cli.app import app, load_command_modules
    from posenc.experiments.study.plan import study_command

    model_dir = save_tiny_llama(tmp_path / "tiny-llama", CONTEXT)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 40)
    out = tmp_path / "sweep"
    load_command_modules()
    args = ["extrapolate", "--hf-model", str(model_dir), "--task", "text-lm", "--corpus", str(corpus)]
    args += ["--eval-examples", "4", "--tuning-windows", "2", "--eval-variants", "none,rerope:window=16|32"]
    result = CliRunner().invoke(app, [*args, "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "chose" in result.output and "recommended at" in result.output
    settings = json.loads((out / "config.json").read_text())["experiment"]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    comparisons = [json.loads(line) for line in (out / "comparisons.jsonl").read_text().splitlines()]
    [choice] = chosen_settings(settings, records)
    held = [w for w in range(4) if w not in settings["tuning_windows"]]
    assert {c["n"] for c in comparisons} == {2}
    losers = {label for label, _ in choice.scores} - {choice.chosen}
    assert not any(c["a"] in losers or c["b"] in losers for c in comparisons)
    rows = {(r["encoding"], tuple(r["bucket"])): r for r in records}
    pair = next(c for c in comparisons if c["bucket"] == [96, 128])
    a = [rows[pair["a"], (96, 128)]["window_nll"][w] for w in held]
    b = [rows[pair["b"], (96, 128)]["window_nll"][w] for w in held]
    assert pair["p"] == pytest.approx(scipy_stats.ttest_rel(a, b).pvalue, rel=1e-7)
    # The reproducing command plans the same study.
    words = study_command(settings, tmp_path / "again").split()
    assert "--tuning-windows" in words and "none,rerope:window=16|32" in " ".join(words)


@pytest.mark.parametrize("option", [["--tuning-windows", "2"], ["--dtype", "bfloat16"]])
@pytest.mark.parametrize("command", ["extrapolate", "submit"])
def test_the_study_options_on_a_run_that_trains_are_refused_by_name(command, option, tmp_path):
    from typer.testing import CliRunner

    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    result = CliRunner().invoke(app, [command, *option, "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and option[0] in result.output and "--hf-model" in result.output
    assert not (tmp_path / "x").exists()
