"""The report's configuration section (posenc.viz.report.configuration): the recorded command parses back to
the settings."""

from __future__ import annotations

import shlex
from pathlib import Path

from posenc.cli.app import app, load_command_modules
from posenc.experiments.results.folders import reproduce_command
from posenc.experiments.train import ExperimentConfig

load_command_modules()


def test_recorded_command_parses_back_to_the_settings() -> None:
    import typer.main

    from posenc.cli.experiments import config_from_options

    config = ExperimentConfig(
        encodings=["rope:base=500000,pairing=half", "alibi", "t5/sinusoidal"],
        seeds=[0, 1, 2],
        steps=50,
        lr=1e-3,
        pack=True,
        distinct=False,
        randomize_positions=128,
        randomize_eval_positions=False,
        eval_examples=20,
        eval_batch=20,
        fit_threshold=0.9,
        eval_variants=["yarn", "temperature:0.2"],
    )
    command, caveats = reproduce_command(config, Path("runs/x y"))
    assert caveats == []
    args = shlex.split(command)
    assert args[:2] == ["posenc", "extrapolate"]
    click_command = typer.main.get_command(app).commands["extrapolate"]  # type: ignore[attr-defined]
    context = click_command.make_context("extrapolate", args[2:])
    assert config_from_options(context.params) == config
    assert context.params["out"] == Path("runs/x y")
    # A setting no option reaches is named, not silently dropped.
    _, caveats = reproduce_command(ExperimentConfig(weight_decay=0.1), Path("out"))
    assert caveats == ["weight_decay=0.1 (no command-line option; set from Python)"]
