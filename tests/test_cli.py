"""The `posenc` command line: list and show."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

import posenc
from posenc.cli.app import _load_command_modules, app

runner = CliRunner()
_load_command_modules()


def test_list_shows_every_encoding_with_kind_and_backends():
    result = runner.invoke(app, ["list"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for name in posenc.available():
        assert name in result.output
    assert "eager" in result.output and "bias" in result.output


def test_show_t5_prints_config_and_the_bucket_row():
    result = runner.invoke(app, ["show", "t5"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "num_buckets" in result.output and "max_distance" in result.output
    # The canonical bidirectional bucket of distance +1 is 17 (docs/conventions.md §4.2).
    assert "17" in result.output


def test_show_unknown_name_exits_with_a_suggestion():
    result = runner.invoke(app, ["show", "alibj"], terminal_width=200)
    assert result.exit_code == 2
    assert "did you mean 'alibi'" in result.output


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "posenc", "show", "rope:base=500000"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "500000" in out.stdout


def test_show_fills_the_required_example_options_a_spec_leaves_out():
    # sinusoidal2d needs grid_width; a spec that sets only base still gets the class's example width.
    result = runner.invoke(app, ["show", "sinusoidal2d:base=100"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "grid_width" in result.output and "100" in result.output


def _recording(builder, label: str, built: dict):
    def build(spec, *args, **kwargs):
        enc = builder(spec, *args, **kwargs)
        built[label] = enc.config()
        return enc

    return build


def test_show_and_plot_build_the_same_encoding_for_every_registered_name(monkeypatch, tmp_path):
    """``posenc show`` and ``posenc plot`` (default sizes) build equal encodings, bare or with options."""
    import posenc.cli.plots
    import posenc.examples

    built: dict[str, dict] = {}
    monkeypatch.setattr(
        posenc.examples, "build_example", _recording(posenc.examples.build_example, "show", built)
    )
    monkeypatch.setattr(
        posenc.cli.plots, "build_example", _recording(posenc.cli.plots.build_example, "plot", built)
    )
    specs = [*posenc.available(), "sinusoidal2d:base=100", "alibi:num_heads=4", "sinusoidal:dim=32"]
    for spec in specs:
        built.clear()
        shown = runner.invoke(app, ["show", spec], terminal_width=200)
        listed = runner.invoke(app, ["plot", spec, "--list"], terminal_width=200)
        assert shown.exit_code == 0 and listed.exit_code == 0, (spec, shown.output, listed.output)
        assert built["show"] == built["plot"], spec
