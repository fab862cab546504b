"""Nothing silent in ``posenc plot`` and ``posenc show``.

* ``posenc plot`` with a length whose L x L map would not fit is refused up front, naming
  ``-n``, the memory per head and the largest length allowed, and writes no file; a figure linear
  in the length (RoPE's decay) is still drawn at that length.
* ``posenc show`` honours a spec's ``head_dim``, or refuses it with the reason.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "spec,figure", [("alibi", "bias"), ("rope", "attention"), ("sinusoidal", "similarity")]
)
def test_posenc_plot_with_a_huge_length_names_n_and_the_memory(spec, figure, tmp_path):
    from typer.testing import CliRunner

    from posenc.cli.app import app, load_command_modules

    load_command_modules()

    args = ["plot", spec, "-n", "100000", "--out", str(tmp_path / "f.png")]
    result = CliRunner().invoke(app, args + (["--figure", figure] if figure else []))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "-n/--length 100000 asks for a 100000 x 100000 map: 37.3 GiB per head" in text
    assert "use -n 8192 or less" in text
    assert not (tmp_path / "f.png").exists()


def test_a_long_but_linear_figure_is_still_drawn(tmp_path):
    """-n is the original context of RoPE's decay figure: no L x L map, no refusal."""
    from posenc.examples import build_example
    from posenc.viz.registry import PlotOptions, make_figure

    make_figure(build_example("rope"), "decay", PlotOptions(length=100_000))


def test_posenc_show_honours_the_spec_head_dim_or_refuses_it():
    from typer.testing import CliRunner

    from posenc.cli.app import app

    result = CliRunner().invoke(app, ["show", "rope:head_dim=15"])
    assert result.exit_code == 2
    assert "head_dim must be even" in result.output and "head_dim=15" in result.output
    result = CliRunner().invoke(app, ["show", "rope:head_dim=32"])
    assert result.exit_code == 0, result.output
    assert "rope:head_dim=32," in result.output and "rotary_dim=32/32" in result.output
