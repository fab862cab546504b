"""Figures of trained runs (posenc.viz.runs, posenc plot --run DIR): attention maps follow each run's
encoding and are causal probabilities."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.image import imread
from typer.testing import CliRunner

from _pixels import DPI, assert_not_constant, data_pixels
from posenc.cli.app import app, load_command_modules
from posenc.viz import PlotOptions

load_command_modules()


# ---------------------------------------------------------------------------- --run DIR: trained models


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """An experiment folder in the runner's layout with (untrained) checkpoints for two encodings."""
    import json

    import torch

    from posenc.experiments.train import ExperimentConfig, RunSpec, build_model, run_id_for

    directory = tmp_path_factory.mktemp("run")
    config = ExperimentConfig(
        task="copy",
        encodings=["alibi", "rope"],
        train_len=4,
        eval_len=8,
        d_model=32,
        num_layers=2,
        num_heads=2,
        d_ff=32,
    )
    (directory / "config.json").write_text(json.dumps({"experiment": config.to_dict(), "runtime": {}}))
    task = config.make_task()
    for enc in config.encodings:
        torch.manual_seed(0)
        model = build_model(config, task, enc)
        path = directory / "checkpoints" / f"{run_id_for(config, RunSpec(enc, 0))}.pt"
        path.parent.mkdir(exist_ok=True)
        state = {
            "model": model.state_dict(),
            "step": 7,
            "run": {"encoding": enc, "seed": 0},
            "config": config.to_dict(),
        }
        torch.save(state, path)
    return directory


def test_run_attention_maps_follow_the_encoding(run_dir) -> None:
    from posenc.viz.runs import run_attention_figure

    options = PlotOptions(length=6)
    alibi = data_pixels(run_attention_figure(run_dir, "alibi", options))
    rope = data_pixels(run_attention_figure(run_dir, "rope", options))
    assert_not_constant(alibi)
    assert_not_constant(rope)
    assert np.abs(alibi - rope).max() > 0.1


def test_run_attention_weights_are_causal_probabilities(run_dir) -> None:
    import torch

    from posenc.viz.runs import attention_weights, find_checkpoints, load_trained_model

    model, task, state = load_trained_model(find_checkpoints(run_dir)["alibi"])
    assert state["step"] == 7
    tokens = task.batch(5, 1, torch.Generator().manual_seed(0)).inputs
    maps = attention_weights(model, tokens)
    assert len(maps) == 2  # one per layer
    for weights in maps:
        assert weights.shape == (2, tokens.shape[1], tokens.shape[1])
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, tokens.shape[1]))
        assert float(weights.triu(1).abs().max()) == 0.0
    # The recording wrappers are removed afterwards.
    from posenc import MultiheadAttention

    assert all("forward" not in m.__dict__ for m in model.modules() if isinstance(m, MultiheadAttention))


def test_cli_plot_run(run_dir, tmp_path) -> None:
    out = tmp_path / "maps.png"
    result = CliRunner().invoke(
        app, ["plot", "rope", "--run", str(run_dir), "-n", "4", "-o", str(out), "--dpi", str(DPI)]
    )
    assert result.exit_code == 0, result.output
    assert_not_constant(imread(out)[..., :3])
    ambiguous = CliRunner().invoke(app, ["plot", "--run", str(run_dir), "-o", str(out)])
    assert ambiguous.exit_code == 2 and "name one" in ambiguous.output
    missing = CliRunner().invoke(app, ["plot", "t5", "--run", str(run_dir), "-o", str(out)])
    assert missing.exit_code == 2 and "no checkpoint for encoding 't5'" in " ".join(missing.output.split())
