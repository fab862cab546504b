"""Inference-time variants of trained runs (posenc.experiments.variants): identity variants reproduce the
trained records exactly, variants are added to a finished folder without retraining, and their specs and
models carry the setting."""

from __future__ import annotations

from typer.testing import CliRunner

from _study import STUDY_TINY, _app
from posenc.experiments import ExperimentConfig, run_experiment, summary_table
from posenc.experiments.results.records import (
    read_run_records,
)
from posenc.experiments.variants import (
    build_variant_model,
    parse_eval_variants,
    variant_context,
    variant_encoding,
)
from posenc.viz.folder import write_figures

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
        **STUDY_TINY,
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
    base = dict(task="copy", encodings=["rope"], train_len=2, eval_len=3, num_symbols=8, **STUDY_TINY)
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
