"""posenc plot (posenc.cli.plots): the command writes a readable, non-constant PNG or SVG, picks the default
figure and layer sizes, lists the figures, and names what is wrong."""

from __future__ import annotations

import pytest
from matplotlib.image import imread
from typer.testing import CliRunner

from _pixels import DPI, assert_not_constant
from posenc.cli.app import app, load_command_modules

load_command_modules()


def test_cli_no_causal_attention_figure(tmp_path) -> None:
    out = tmp_path / "rope.png"
    result = CliRunner().invoke(
        app, ["plot", "rope", "--figure", "attention", "--no-causal", "-o", str(out), "--dpi", str(DPI)]
    )
    assert result.exit_code == 0, result.output
    assert_not_constant(imread(out)[..., :3])


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_cli_plot_writes_image(tmp_path, suffix: str) -> None:
    out = tmp_path / f"t5{suffix}"
    result = CliRunner().invoke(
        app, ["plot", "t5:num_buckets=16", "--figure", "buckets", "--out", str(out), "--dpi", str(DPI)]
    )
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 1000
    if suffix == ".png":
        assert_not_constant(imread(out)[..., :3])
    else:
        text = out.read_text()
        assert text.lstrip().startswith("<?xml") and "<svg" in text and "<path" in text


def test_cli_plot_default_figure_and_layer_sizes(tmp_path) -> None:
    out = tmp_path / "sin.png"
    result = CliRunner().invoke(
        app, ["plot", "sinusoidal:dim=32", "-n", "32", "-o", str(out), "--dpi", str(DPI)]
    )
    assert result.exit_code == 0, result.output
    assert_not_constant(imread(out)[..., :3])


def test_cli_plot_list(tmp_path) -> None:
    result = CliRunner().invoke(app, ["plot", "rope", "--list"])
    assert result.exit_code == 0, result.output
    for figure_name in ("scaling", "decay", "attention"):
        assert figure_name in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plot", "alibi", "--figure", "buckets", "-o", "x.png"], "not available for encoding 'alibi'"),
        (["plot", "alibi", "-o", "x.jpg"], ".png or .svg"),
        (["plot", "alibi"], "--out"),
        (["plot", "-o", "x.png"], "SPEC"),
        (["plot", "nosuch", "-o", "x.png"], "unknown encoding"),
    ],
)
def test_cli_plot_errors(tmp_path, monkeypatch, args: list[str], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split()), result.output
    assert not list(tmp_path.iterdir())
