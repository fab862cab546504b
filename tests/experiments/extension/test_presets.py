"""The extension presets: each runs end to end in a tiny form (CI's), and a claim's verdict follows
the paired interval: A better on every seed holds, B better contradicts, a split cannot tell."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from posenc.cli.app import app, load_command_modules
from posenc.experiments.config import ExperimentConfig
from posenc.experiments.extension.presets import (
    EXTENSION_PRESETS,
    Claim,
    ExtensionPreset,
    check_claims,
    mean_positions_seen,
    run_extension_preset,
)
from posenc.experiments.extension.stage import ExtensionConfig


def _tiny(base: ExperimentConfig, extension: ExtensionConfig):
    base = dataclasses.replace(
        base, train_len=6, eval_len=6, steps=3, seeds=[0, 1], eval_examples=2, d_model=16, num_heads=2,
        d_ff=32, num_layers=1, batch_size=4, checkpoint_every=2, warmup=1,
    )  # fmt: skip
    return base, dataclasses.replace(extension, to_len=12, eval_len=14, steps=2)


@pytest.mark.parametrize("name", list(EXTENSION_PRESETS))
def test_each_preset_runs_in_its_tiny_form_and_checks_every_claim(name, tmp_path):
    folder, verdicts = run_extension_preset(name, tmp_path / name, scale=_tiny)
    preset = EXTENSION_PRESETS[name]
    assert [v.claim for v in verdicts] == list(preset.claims)
    assert all(v.outcome in ("holds", "contradicted", "cannot tell") for v in verdicts)
    seen = mean_positions_seen(folder)
    assert set(seen) == set(preset.extension.recipes)
    if (
        name == "pose-paper"
    ):  # PoSE trains at L, full-length fine-tuning at L2 = 2L: half the positions or fewer
        assert seen["pose:scaling=pi"] < seen["pi"]


def test_a_preset_changes_only_its_scale(tmp_path):
    def other_recipes(base, extension):
        return base, dataclasses.replace(extension, recipes=["continue"])

    with pytest.raises(ValueError, match="change only the scale"):
        run_extension_preset("yarn-paper", tmp_path, scale=other_recipes)
    with pytest.raises(ValueError, match="unknown; choose from"):
        run_extension_preset("rope-paper", tmp_path)


def _folder(tmp_path, a_values, b_values):
    """An extension folder of perplexities beyond L2 = 4: rows 'rope > a' and 'rope > b', per seed."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    settings = ExperimentConfig(task="lm", train_len=4, eval_len=6, encodings=["rope > a", "rope > b"])
    (tmp_path / "config.json").write_text(json.dumps({"experiment": settings.to_dict()}))
    lines = []
    for row, values in (("rope > a", a_values), ("rope > b", b_values)):
        for seed, value in enumerate(values):
            for length in range(1, 7):
                record = {
                    "run": f"{row}{seed}",
                    "encoding": row,
                    "task": "lm",
                    "seed": seed,
                    "length": length,
                }
                lines.append(json.dumps({**record, "metric": "perplexity", "value": value, "examples": 1}))
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("a_values", "b_values", "outcome"),
    [
        ([2.0, 2.1, 2.2], [3.0, 3.15, 3.2], "holds"),  # lower perplexity: A better on every seed
        ([3.0, 3.15, 3.2], [2.0, 2.1, 2.2], "contradicted"),
        ([2.0, 3.0, 2.5], [3.0, 2.0, 2.6], "cannot tell"),
    ],
)
def test_a_claims_verdict_follows_the_paired_interval(tmp_path, a_values, b_values, outcome):
    preset = ExtensionPreset(
        "toy", "nobody", ExperimentConfig(encodings=["rope"]), None, (Claim("a", "b", "a reads farther"),)
    )
    (verdict,) = check_claims(_folder(tmp_path, a_values, b_values), preset)
    assert verdict.outcome == outcome
    assert verdict.mean == pytest.approx(sum(a_values) / 3 - sum(b_values) / 3)


def test_the_command_runs_a_preset_and_prints_its_verdicts(tmp_path, monkeypatch):
    import posenc.experiments.extension.presets as presets

    tiny = {
        name: dataclasses.replace(
            p, base=_tiny(p.base, p.extension)[0], extension=_tiny(p.base, p.extension)[1]
        )
        for name, p in presets.EXTENSION_PRESETS.items()
    }
    monkeypatch.setattr(presets, "EXTENSION_PRESETS", tiny)
    load_command_modules()
    result = CliRunner().invoke(
        app, ["extend", str(tmp_path / "abf"), "--preset", "abf-paper", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "a raised base before continuing beats the old base" in text
    assert "compute (positions seen per run)" in text
    result = CliRunner().invoke(app, ["extend", str(tmp_path / "x")])
    assert result.exit_code == 2 and "give --to L2 and --steps N" in " ".join(result.output.split())
