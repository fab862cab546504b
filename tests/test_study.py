"""The main job as a study (issue 14): fit first, uncertainty, inference-time variants, the report.

Expected numbers are computed in the tests from the per-length records (means written out here),
from the Wilson formula's published values, or by hand from tabulated Student's t quantiles.
"""

from __future__ import annotations

import json
import math
from statistics import mean

import pytest
import torch
from typer.testing import CliRunner

from posenc.experiments import ExperimentConfig, run_experiment, summary_table
from posenc.experiments import train as train_module
from posenc.experiments.results.compare import compare_rows
from posenc.experiments.results.records import (
    read_records,
    read_run_records,
    wilson_interval,
)
from posenc.experiments.variants import (
    build_variant_model,
    parse_eval_variants,
    variant_context,
    variant_encoding,
)
from posenc.viz.folder import write_figures

TINY = dict(
    d_model=16,
    num_layers=1,
    num_heads=2,
    d_ff=16,
    batch_size=4,
    steps=3,
    warmup=1,
    eval_examples=3,
    checkpoint_every=1,
)


def _app():
    from posenc.cli.app import _load_command_modules, app

    _load_command_modules()
    return app


# ---------------------------------------------------------------------------- 1. fit first


def test_every_run_writes_an_iid_record_with_its_fit_flag(tmp_path):
    config = ExperimentConfig(
        task="copy", encodings=["rope", "alibi"], train_len=3, eval_len=5, num_symbols=8, **TINY
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
    config = ExperimentConfig(task=task, encodings=["alibi"], train_len=24, eval_len=30, **TINY)
    run_experiment(config, tmp_path, workers=1)
    (run,) = read_run_records(tmp_path)
    assert run["fit"] is (run["value"] >= 0.95) and run["fit_threshold"] == 0.95


def test_lm_iid_is_the_perplexity_at_the_training_length_without_a_fit_flag(tmp_path):
    config = ExperimentConfig(task="lm", encodings=["alibi"], train_len=8, eval_len=10, **TINY)
    records = run_experiment(config, tmp_path, workers=1)
    (run,) = read_run_records(tmp_path)
    (at_l,) = [r["value"] for r in records if r["length"] == 8]
    assert run["value"] == at_l and run["fit"] is None and run["scored_by"] == "perplexity"


def test_a_folder_without_iid_records_loads_and_is_not_retrained(tmp_path):
    config = ExperimentConfig(
        task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **TINY
    )
    records = run_experiment(config, tmp_path, workers=1)
    metric = config.make_task().metric
    table = summary_table(config, records, metric)
    (tmp_path / "runs.jsonl").unlink()  # a folder written before per-run records
    checkpoint = tmp_path / "checkpoints" / "alibi__copy__seed0.pt"
    before = checkpoint.stat().st_mtime_ns
    again = run_experiment(config, tmp_path, workers=1)
    assert again == records and checkpoint.stat().st_mtime_ns == before
    assert summary_table(config, again, metric) == table
    assert read_run_records(tmp_path) == []


def test_until_fit_stops_at_the_first_check_that_fits(tmp_path, monkeypatch):
    """Scripted fit-check scores (0.5 at step 2, 0.97 at step 4): training stops at step 4."""
    checked: list[int] = []

    def scripted(model, config, task, run):
        checked.append(len(checked))
        return [0.5, 0.97][min(len(checked) - 1, 1)]

    monkeypatch.setattr(train_module, "fit_check_score", scripted)
    base = dict(task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **TINY)
    config = ExperimentConfig(**{**base, "steps": 9}, until_fit=True, fit_check_every=2)
    run_experiment(config, tmp_path / "fits", workers=1)
    (run,) = read_run_records(tmp_path / "fits")
    assert run["steps_trained"] == 4 and run["steps_to_fit"] == 4 and len(checked) == 2
    state = torch.load(tmp_path / "fits" / "checkpoints" / "alibi__copy__seed0.pt", weights_only=False)
    assert state["step"] == 4 and state["fitted_at"] == 4
    table = summary_table(config, read_records(tmp_path / "fits" / "results.jsonl"), config.make_task().metric,
                          read_run_records(tmp_path / "fits"))  # fmt: skip
    assert any("fit check passed at step" in note and note.endswith("alibi 4") for note in table.notes)
    # A threshold no check reaches: every step runs, checked at 2, 4, 6, 8 and the last step, 9.
    checked.clear()
    monkeypatch.setattr(train_module, "fit_check_score", lambda *args: checked.append(1) or 0.5)
    run_experiment(config, tmp_path / "never", workers=1)
    (run,) = read_run_records(tmp_path / "never")
    assert run["steps_trained"] == 9 and run["steps_to_fit"] is None and len(checked) == 5


def test_until_fit_with_a_margin_stops_only_above_threshold_plus_margin(tmp_path, monkeypatch):
    """Scripted scores 0.96 (step 2), 0.99 (step 4): at 0.95 + 0.02, 0.96 does not stop it."""
    scores = iter([0.96, 0.99])
    monkeypatch.setattr(train_module, "fit_check_score", lambda *args: next(scores))
    base = dict(task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **TINY)
    config = ExperimentConfig(**{**base, "steps": 9}, until_fit=True, fit_check_every=2, fit_margin=0.02)
    assert config.identity()["fit_margin"] == 0.02 and "fit_margin" not in ExperimentConfig(**base).identity()
    run_experiment(config, tmp_path, workers=1)
    (run,) = read_run_records(tmp_path)
    assert run["steps_trained"] == 4 and run["steps_to_fit"] == 4


def test_a_run_that_fitted_resumes_without_training_past_its_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(train_module, "fit_check_score", lambda *args: 1.0)
    base = dict(task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **TINY)
    config = ExperimentConfig(**{**base, "steps": 9}, until_fit=True, fit_check_every=2)
    first = run_experiment(config, tmp_path, workers=1)
    (tmp_path / "results.jsonl").unlink()  # as if killed after the checkpoint, before the records

    def no_more_checks(*args):
        raise AssertionError("a run that fitted was checked (trained) again")

    monkeypatch.setattr(train_module, "fit_check_score", no_more_checks)
    assert run_experiment(config, tmp_path, workers=1) == first
    (run,) = read_run_records(tmp_path)
    assert run["steps_trained"] == 2 and run["steps_to_fit"] == 2


def test_until_fit_checks_on_examples_apart_from_the_evaluation(monkeypatch):
    seen: list[int] = []
    config = ExperimentConfig(
        task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **TINY
    )
    task = config.make_task()
    original = task.metric.evaluate

    def spy(model, task, **kwargs):
        seen.append(kwargs["seed"])
        return original(model, task, **kwargs)

    monkeypatch.setattr(task, "metric", type(task.metric)(**{**task.metric.__dict__, "evaluate": spy}))
    model = train_module.build_model(config, task, "alibi")
    train_module.fit_check_score(model, config, task, train_module.RunSpec("alibi", 0))
    train_module.evaluate(model, config, task, train_module.RunSpec("alibi", 0), lambda *a: None)
    assert seen[0] == train_module.mix_seed(0, "fit-check") and seen[1] == 0 and seen[0] != seen[1]


def test_until_fit_enters_the_folder_identity_with_its_threshold(tmp_path):
    base = dict(task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **TINY)
    plain = ExperimentConfig(**base)
    assert "until_fit" in plain.identity() and "fit_check_every" not in plain.identity()
    assert "fit_threshold" not in plain.identity()
    assert ExperimentConfig(**base, until_fit=True).identity()["fit_threshold"] == 0.95
    run_experiment(plain, tmp_path, workers=1)
    run_experiment(ExperimentConfig(**base, fit_threshold=0.5), tmp_path, workers=1)  # display only
    with pytest.raises(ValueError, match=r"until_fit: False there vs True now"):
        run_experiment(ExperimentConfig(**base, until_fit=True), tmp_path, workers=1)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            dict(task="lm", train_len=8, eval_len=10, until_fit=True),
            r"--until-fit needs a task scored by exact match",
        ),
        (dict(fit_check_every=0), r"fit_check_every"),
        (
            dict(eval_variants=["yarn"], encodings=["rope", "alibi"]),
            r"'yarn' does not apply to --encodings 'alibi'",
        ),
        (dict(eval_variants=["warp"]), r"--eval-variants 'warp': unknown variant"),
        (dict(eval_variants=["yarn:0.5"]), r"'yarn:0.5': the factor must be >= 1"),
        (dict(eval_variants=["prope:1.5"]), r"'prope:1.5': the rotating fraction must be in \(0, 1\]"),
        (dict(eval_variants=["drop_rotation:2"]), r"drop_rotation takes no value"),
        (dict(eval_variants=["yarn", "yarn"]), r"lists yarn twice"),
        (
            dict(eval_variants=["temperature"], encodings=["llama4:chunk=2,nope_every=1"]),
            r"already scale their queries",
        ),
        (
            dict(eval_variants=["yarn"], encodings=["gemma3:window=2"]),
            r"'yarn' does not apply .*a layer preset",
        ),
    ],
)
def test_bad_study_options_fail_before_anything_is_written(tmp_path, options, match):
    settings = dict(task="copy", encodings=["rope"], train_len=2, eval_len=3, num_symbols=8, **TINY)
    config = ExperimentConfig(**{**settings, **options})
    with pytest.raises(ValueError, match=match):
        run_experiment(config, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


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


def _record(encoding, seed, length, value, examples=20, metric="exact_match", task="copy", train_len=2):
    return {"run": f"{encoding}-{seed}", "encoding": encoding, "task": task, "seed": seed, "length": length,
            "metric": metric, "value": value, "train_len": train_len, "steps": 1, "examples": examples}  # fmt: skip


def _band_of(ax, index):
    vertices = ax.collections[index].get_paths()[0].vertices
    return vertices[:, 1]


def test_plot_bands_are_wilson_with_one_seed_and_seed_t_interval_with_several():
    from posenc.experiments.results.records import Record
    from posenc.viz.curves import curve_figure

    one = [Record.from_dict(_record("rope", 0, n, v)) for n, v in ((1, 0.5), (2, 1.0))]
    fig = curve_figure(one, "copy", "exact_match", ["rope"], binomial=True)
    band = _band_of(fig.axes[0], 0)
    # 10/20 and 20/20 as Wilson intervals, written out: (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n).
    z, n = 1.959964, 20
    expected = []
    for p in (0.5, 1.0):
        centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        expected += [(centre - half) / (1 + z * z / n), min(1.0, (centre + half) / (1 + z * z / n))]
    assert min(band) == pytest.approx(min(expected)) and max(band) == pytest.approx(1.0)
    assert any(abs(y - expected[0]) < 1e-9 for y in band) and any(abs(y - expected[1]) < 1e-9 for y in band)
    # Three seeds: the Student's t interval of the mean, mean ± t(0.975, 2)·s/√3 with the tabulated
    # t(0.975, 2) = 4.302653, kept inside [0, 1]: at length 1 (0.5, 0.3, 0.4: mean 0.4, s = 0.1),
    # at length 2 (1.0, 0.6, 0.8: mean 0.8, s = 0.2, the top cut at 1).
    more = [((1, 0.3), (2, 0.6)), ((1, 0.4), (2, 0.8))]
    three = one + [Record.from_dict(_record("rope", s, n, v)) for s, ps in enumerate(more, 1) for n, v in ps]
    band = _band_of(curve_figure(three, "copy", "exact_match", ["rope"], binomial=True).axes[0], 0)
    half = 4.302653 / math.sqrt(3)
    expected = [0.4 - 0.1 * half, 0.4 + 0.1 * half, 0.8 - 0.2 * half, 1.0]
    assert sorted({round(float(y), 9) for y in band}) == pytest.approx(sorted(expected), abs=1e-6)


def test_plot_marks_encodings_that_did_not_fit():
    from posenc.experiments.results.records import Record
    from posenc.viz.curves import curve_figure

    records = [
        Record.from_dict(_record(e, 0, n, v)) for e in ("rope", "nope") for n, v in ((1, 0.04), (2, 0.04))
    ]
    fig = curve_figure(
        records, "copy", "exact_match", ["rope", "nope"], unfit={"nope": "did not fit: iid 4.0%"}
    )
    lines = {
        line.get_label(): line for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")
    }
    assert lines["rope"].get_linestyle() == "-"
    assert lines["nope (did not fit: iid 4.0%)"].get_linestyle() == "--"
    legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert "nope (did not fit: iid 4.0%)" in legend


def test_table_says_how_many_seeds_it_rests_on():
    records = [_record("rope", s, n, 1.0) for s in (0, 1, 2) for n in (1, 2, 3)]
    config = ExperimentConfig(task="copy", encodings=["rope"], train_len=2, eval_len=3, seeds=[0, 1, 2])
    assert summary_table(config, records, config.make_task().metric).title.endswith("; 3 seeds)")
    assert summary_table(config, records[:3], config.make_task().metric).title.endswith("; 1 seed)")


def _write_folder(directory, records, task="copy", train_len=2, encodings=None, eval_variants=()):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    encodings = encodings or list(dict.fromkeys(r["encoding"] for r in records))
    config = ExperimentConfig(
        task=task, encodings=encodings, train_len=train_len, eval_len=4, eval_variants=list(eval_variants)
    )
    (directory / "config.json").write_text(json.dumps({"experiment": config.to_dict(), "runtime": {}}))


def _curve(encoding, seed, beyond, inside=1.0, **kw):
    """In-distribution ``inside`` at lengths 1, 2; ``beyond`` at 3 and 4 (their mean is ``mean(beyond)``)."""
    return [_record(encoding, seed, n, v, **kw) for n, v in zip((1, 2, 3, 4), (inside, inside, *beyond))]


def test_compare_pairs_by_seed_and_says_who_wins(tmp_path):
    # Beyond L=2, per seed: a = 0.6, 0.7, 0.65; b = 0.4, 0.4, 0.45 -> differences 0.2, 0.3, 0.2.
    records = []
    for seed, (a, b) in enumerate(
        [((0.5, 0.7), (0.4, 0.4)), ((0.7, 0.7), (0.3, 0.5)), ((0.6, 0.7), (0.45, 0.45))]
    ):
        records += _curve("a", seed, a) + _curve("b", seed, b)
    records += [r for seed in (0, 1, 2) for r in _curve("c", seed, (0.4 + 0.1 * (seed == 1), 0.4))]
    _write_folder(tmp_path, records)
    result = compare_rows(tmp_path, "a", "b")
    assert result.differences == pytest.approx([0.2, 0.3, 0.2])
    assert result.mean == pytest.approx(0.7 / 3)
    # Paired t interval: mean 0.7/3, s = 0.1/√3 (deviations 1/30, 2/30, 1/30), so
    # 0.7/3 ± t(0.975, 2)·s/√3 = 0.7/3 ± 4.302653·0.1/3: [0.0899, 0.3768], which excludes 0.
    assert result.interval == pytest.approx(
        (0.7 / 3 - 4.302653 * 0.1 / 3, 0.7 / 3 + 4.302653 * 0.1 / 3), abs=1e-6
    )
    assert result.verdict == "a"
    assert result.lines()[-1].startswith("a beats b beyond L")
    assert compare_rows(tmp_path, "b", "a").verdict == "b"
    # b vs c: differences 0.0, -0.05, 0.05 (seed 1's c is 0.45 beyond): the interval contains 0.
    close = compare_rows(tmp_path, "b", "c")
    assert close.differences == pytest.approx([0.0, -0.05, 0.05]) and close.verdict == "cannot tell"
    assert close.lines()[-1] == "cannot tell: the interval contains 0"


def test_compare_refuses_missing_unfit_and_same_rows_and_one_seed_cannot_tell(tmp_path):
    records = _curve("rope", 0, (0.5, 0.5)) + _curve("nope", 0, (0.0, 0.0), inside=0.04)
    records += _curve("alibi", 0, (0.2, 0.2))
    _write_folder(tmp_path, records)
    with pytest.raises(ValueError, match=r"'t5' not in .* \(it has: rope, nope, alibi\)"):
        compare_rows(tmp_path, "rope", "t5")
    with pytest.raises(
        ValueError, match=r"'nope' \(in-distribution 4\.0%, 0/1 seeds reach 95\.0%\) did not fit"
    ):
        compare_rows(tmp_path, "rope", "nope")
    with pytest.raises(ValueError, match=r"same row"):
        compare_rows(tmp_path, "rope", "rope")
    single = compare_rows(tmp_path, "rope", "alibi")
    assert single.interval is None and single.verdict == "cannot tell"
    assert "one seed gives no interval" in single.lines()[-1]
    app = _app()
    result = CliRunner().invoke(app, ["compare", str(tmp_path), "rope", "nope"])
    assert result.exit_code == 2 and "did not fit" in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["compare", str(tmp_path), "rope", "alibi"])
    assert result.exit_code == 0 and "mean difference rope - alibi: +30.0%" in result.output


def test_compare_on_perplexity_lower_is_better(tmp_path):
    records = []
    for seed, (a, b) in enumerate([(3.0, 5.0), (3.5, 6.0), (3.2, 5.5)]):
        for encoding, value in (("a", a), ("b", b)):
            records += [
                _record(encoding, seed, n, value, metric="perplexity", task="lm") for n in (1, 2, 3, 4)
            ]
    _write_folder(tmp_path, records, task="lm")
    result = compare_rows(tmp_path, "a", "b")
    assert result.mean == pytest.approx(mean([-2.0, -2.5, -2.3])) and result.verdict == "a"


# ---------------------------------------------------------------------------- 3. variants


def test_identity_variants_reproduce_the_trained_records_exactly(tmp_path):
    """linear and NTK at factor 1 and p-RoPE with every pair rotating are RoPE itself; the log-length
    temperature leaves every position below the training length alone."""
    config = ExperimentConfig(
        task="copy",
        encodings=["rope"],
        train_len=2,
        eval_len=4,
        num_symbols=8,
        eval_variants=["linear:1", "ntk:1", "prope:1", "temperature:0.5"],
        **TINY,
    )
    records = run_experiment(config, tmp_path, workers=1, figures=write_figures)

    def values(label, longest):
        return [
            (r["length"], r["metric"], r["value"])
            for r in records
            if r["encoding"] == label and r["length"] <= longest
        ]

    trained = values("rope", 4)
    assert len(trained) == 8 and any(0 < v < 1 for _, m, v in trained if m == "token_accuracy")
    for variant in ("linear:1", "ntk:1", "prope:1"):
        assert values(f"rope + {variant}", 4) == trained
    # Copy of size n is 2n + 2 tokens: n <= 2 stays inside the 6 trained positions.
    assert values("rope + temperature:0.5", 2) == values("rope", 2)
    tagged = [r for r in records if r["encoding"] == "rope + ntk:1"]
    assert {r["variant"] for r in tagged} == {"ntk:1"} and {r["trained_encoding"] for r in tagged} == {"rope"}
    assert {r["run"] for r in tagged} == {"rope__copy__seed0__ntkx1"}
    runs = {r["encoding"]: r for r in read_run_records(tmp_path)}
    assert (
        runs["rope + prope:1"]["value"] == runs["rope"]["value"]
        and runs["rope + prope:1"]["variant"] == "prope:1"
    )
    table = summary_table(config, records, config.make_task().metric)
    assert [row[0] for row in table.rows] == ["rope", "rope + linear:1", "rope + ntk:1", "rope + prope:1",
                                              "rope + temperature:0.5"]  # fmt: skip
    assert (tmp_path / "extrapolation.png").read_bytes()[:4] == b"\x89PNG"


def test_variants_are_added_to_a_finished_folder_without_retraining(tmp_path):
    base = dict(task="copy", encodings=["rope"], train_len=2, eval_len=3, num_symbols=8, **TINY)
    first = run_experiment(ExperimentConfig(**base), tmp_path, workers=1)
    checkpoint = tmp_path / "checkpoints" / "rope__copy__seed0.pt"
    before = checkpoint.stat().st_mtime_ns
    config = ExperimentConfig(**base, eval_variants=["yarn", "drop_rotation"])
    records = run_experiment(config, tmp_path, workers=1)
    assert checkpoint.stat().st_mtime_ns == before
    assert [r for r in records if r["encoding"] == "rope"] == first
    assert {r["encoding"] for r in records} == {"rope", "rope + yarn", "rope + drop_rotation"}


def test_variant_specs_and_models_carry_the_setting():
    config = ExperimentConfig(
        task="copy", encodings=["rope"], train_len=4, eval_len=8, d_model=16, num_heads=2
    )
    task = config.make_task()
    ctx = variant_context(config, task)
    # Copy of size n is 2n + 2 tokens: 10 trained, 18 evaluated, factor 18 / 10.
    assert (ctx.train_tokens, ctx.eval_tokens, ctx.head_dim) == (10, 18, 8)
    (yarn, given, prope, drop) = parse_eval_variants(["yarn", "yarn:4", "prope:0.5", "drop_rotation"])
    assert variant_encoding("rope:base=500", yarn, ctx) == (
        "rope:base=500,scaling=yarn,factor=1.8,original_max_position_embeddings=10"
    )
    assert variant_encoding("rope:scaling=linear,factor=2", given, ctx) == (
        "rope:scaling=yarn,factor=4.0,original_max_position_embeddings=10"
    )
    assert variant_encoding("t5/rope", prope, ctx) == "t5/rope:scaling=proportional,rotary_dim=4"
    assert variant_encoding("rope", drop, ctx) == "rope:drop_rotation=always"
    model = build_variant_model(config, task, "rope", parse_eval_variants(["temperature:0.3"])[0])
    temperatures = {
        layer.query_temperature for layer in model.modules() if hasattr(layer, "query_temperature")
    }
    (temperature,) = temperatures
    assert (temperature.floor_scale, temperature.attn_scale, temperature.position_offset) == (10.0, 0.3, 0.0)


def test_cli_eval_variants_on_trained_runs(tmp_path):
    args = ["extrapolate", "--task", "copy", "--encodings", "rope", "--train-len", "2", "--eval-len", "3"]
    args += ["--num-symbols", "8", "--d-model", "16", "--num-layers", "1", "--num-heads", "2", "--d-ff", "16"]
    args += [
        "--steps",
        "2",
        "--eval-examples",
        "3",
        "--workers",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path),
    ]
    result = CliRunner().invoke(_app(), [*args, "--eval-variants", "none,yarn:2"])
    assert result.exit_code == 0, result.output
    assert "rope + yarn:2" in result.output and "1 seed)" in result.output
    assert "rope + none" not in result.output  # none is the trained row itself


# ---------------------------------------------------------------------------- 7. report


def test_report_shows_fit_flags_intervals_and_variants(tmp_path):
    from posenc.viz.report import render_report

    records = []
    for seed in (0, 1):
        records += _curve("rope", seed, (0.4 + 0.4 * seed, 0.4 + 0.4 * seed))
        records += [{**r, "encoding": "rope + yarn", "run": f"y{seed}", "variant": "yarn", "trained_encoding": "rope"}
                    for r in _curve("rope", seed, (0.9, 0.9))]  # fmt: skip
        records += _curve("nope", seed, (0.0, 0.0), inside=0.04)
    _write_folder(tmp_path, records, encodings=["rope", "nope"], eval_variants=["yarn"])
    text = render_report(tmp_path)
    section = text[
        text.index('<table id="summary">') : text.index("</table>", text.index('<table id="summary">'))
    ]
    rows = section.split("<tr")[2:]
    # In the order of the ranking beyond L (the variant first), the row that did not fit last.
    assert [row.split("<code>")[1].split("</code>")[0] for row in rows] == ["rope + yarn", "rope", "nope"]
    # Beyond L rope scores 0.4 and 0.8: 0.6 ± t(0.975, 1)·0.2 = 0.6 ± 2.54, kept inside [0%, 100%].
    assert "100.0%, 2/2" in rows[1] and "60.0% [0.0%, 100.0%]" in rows[1]
    assert "95% Student&#x27;s t interval of the mean across the n seeds" in text
    assert 'class="unfit"' in rows[2] and "not ranked (did not fit: iid 4.0%)" in rows[2]
    assert 'class="fit"' in rows[0] and "90.0%" in rows[0]
    assert "<b>2 seeds</b>" in text and "No figure for <code>rope + yarn" not in text
