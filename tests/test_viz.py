"""Figures: every ``posenc plot`` figure writes a real image whose pixels follow the encoding.

Each case draws a figure for two settings of an encoding parameter. With every text artist hidden
(titles, tick labels, legends: they would differ even for an empty plot because the title names
the spec), the two renderings must differ and neither may be constant, so an empty axes or a plot
that ignores the parameter fails. The CLI cases check that the command writes a readable,
non-constant PNG or SVG.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from matplotlib.image import imread
from matplotlib.text import Text
from typer.testing import CliRunner

import posenc
from posenc.cli.app import _load_command_modules, app
from posenc.encodings.base import Kind
from posenc.examples import build_example
from posenc.viz import PlotOptions, figures_for, make_figure

_load_command_modules()

DPI = 40


def data_pixels(fig) -> np.ndarray:
    """RGB pixels of ``fig`` with every text artist hidden."""
    for text in fig.findobj(Text):
        text.set_visible(False)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    buffer.seek(0)
    return imread(buffer)[..., :3]


def assert_not_constant(pixels: np.ndarray) -> None:
    # A figure of nothing but white paper and axis frames has almost one colour.
    colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 8, f"image has only {len(colours)} colours"


# (figure, spec A, spec B, length): the two specs differ in one parameter the figure must show.
CASES = [
    ("seed", "sinusoidal:dim=64", "sinusoidal:dim=64,base=100", 64),
    ("dims", "sinusoidal:dim=32", "sinusoidal:dim=32,base=1000", 64),
    ("vectors", "sinusoidal:dim=32", "sinusoidal:dim=32,base=1000", 16),
    ("heatmap", "sinusoidal:dim=32", "sinusoidal:dim=32,layout=concat", 32),
    ("similarity", "sinusoidal:dim=32", "sinusoidal:dim=32,base=100", 32),
    ("heatmap", "learned:dim=16,max_len=32", "learned:dim=32,max_len=32", 16),
    ("buckets", "t5:bidirectional=true", "t5:bidirectional=false", 8),
    ("buckets", "t5:max_distance=128", "t5:max_distance=32", 8),
    ("bias", "alibi:mode=causal", "alibi:mode=symmetric", 12),
    ("bias", "t5:bidirectional=true", "t5:bidirectional=false", 12),
    ("profile", "alibi:num_heads=8", "alibi:num_heads=4", 32),
    ("slopes", "alibi:num_heads=8", "alibi:num_heads=6", 32),
    ("scaling", "rope:head_dim=32", "rope:head_dim=32,base=500", 256),
    ("decay", "rope:head_dim=16", "rope:head_dim=16,base=100", 256),
    ("index", "shaw:k=2", "shaw:k=4", 8),
    (
        "index",
        "deberta:position_buckets=-1,max_relative_positions=3",
        "deberta:position_buckets=8,max_relative_positions=32",
        8,
    ),
    ("attention", "alibi:num_heads=8", "alibi:num_heads=4", 12),
    ("attention", "rope:base=10000", "rope:base=10", 12),
]


@pytest.mark.parametrize(("name", "spec_a", "spec_b", "length"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_figure_follows_parameters(name: str, spec_a: str, spec_b: str, length: int) -> None:
    options = PlotOptions(length=length, max_heads=4)
    first = data_pixels(make_figure(build_example(spec_a), name, options))
    second = data_pixels(make_figure(build_example(spec_b), name, options))
    assert_not_constant(first)
    assert_not_constant(second)
    assert first.shape == second.shape
    assert np.abs(first - second).max() > 0.1, f"{name}: {spec_a} and {spec_b} draw the same pixels"


def test_causal_option_masks_future_keys() -> None:
    enc = build_example("t5:bidirectional=true")
    both = make_figure(enc, "attention", PlotOptions(length=8, max_heads=2, causal=False))
    causal = make_figure(enc, "attention", PlotOptions(length=8, max_heads=2))
    weights = both.axes[0].images[0].get_array()
    masked = causal.axes[0].images[0].get_array()
    upper = np.triu_indices(8, 1)
    assert np.asarray(masked)[upper].max() == 0.0
    assert np.asarray(weights)[upper].min() > 0.0
    # The bias heatmap hides future keys only on request (t5 defines them), always for causal ALiBi.
    shown = make_figure(enc, "bias", PlotOptions(length=8, max_heads=2)).axes[0].images[0].get_array()
    hidden = (
        make_figure(enc, "bias", PlotOptions(length=8, max_heads=2, causal=True))
        .axes[0]
        .images[0]
        .get_array()
    )
    alibi = (
        make_figure(build_example("alibi"), "bias", PlotOptions(length=8, max_heads=2))
        .axes[0]
        .images[0]
        .get_array()
    )
    assert np.isfinite(np.asarray(shown)[upper]).all()
    assert np.ma.getmaskarray(hidden)[upper].all() or np.isnan(np.asarray(hidden)[upper]).all()
    assert np.ma.getmaskarray(alibi)[upper].all() or np.isnan(np.asarray(alibi)[upper]).all()


def _attention_weights(spec: str, causal: bool | None) -> np.ndarray:
    fig = make_figure(build_example(spec), "attention", PlotOptions(length=8, max_heads=2, causal=causal))
    return np.asarray(fig.axes[0].images[0].get_array())


@pytest.mark.parametrize("name", posenc.available())
def test_no_causal_attention_figure_for_every_encoding(name: str) -> None:
    """``posenc plot NAME --figure attention --no-causal``: every encoding renders; one that is not
    causal_only shows future keys, a causal_only one is drawn causal (as documented)."""
    upper = np.triu_indices(8, 1)
    weights = _attention_weights(name, causal=False)
    if build_example(name).causal_only:
        assert weights[upper].max() == 0.0, f"{name} is causal_only: future keys must stay masked"
    else:
        assert weights[upper].min() > 0.0, f"{name}: --no-causal must show future keys"
    assert _attention_weights(name, causal=None)[upper].max() == 0.0, f"{name}: the default is causal"


def test_cli_no_causal_attention_figure(tmp_path) -> None:
    out = tmp_path / "rope.png"
    result = CliRunner().invoke(
        app, ["plot", "rope", "--figure", "attention", "--no-causal", "-o", str(out), "--dpi", str(DPI)]
    )
    assert result.exit_code == 0, result.output
    assert_not_constant(imread(out)[..., :3])


def test_data_pixels_catches_an_empty_plot() -> None:
    # The check itself must be able to fail: an axes with no data but a title is "constant".
    from posenc.viz import new_figure

    fig = new_figure(4, 3)
    ax = fig.subplots()
    ax.set_title("sinusoidal:dim=32")
    with pytest.raises(AssertionError):
        assert_not_constant(data_pixels(fig))


def test_every_registered_encoding_has_a_default_figure() -> None:
    for name in posenc.available():
        enc = build_example(name)
        figures = figures_for(enc)
        assert figures, f"{name} has no figure"
        if enc.kind is Kind.BIAS:
            assert "bias" in figures, f"BIAS encoding {name} lacks the generic bias heatmap"


@pytest.mark.parametrize("name", [n for n in posenc.available() if posenc.get_class(n).kind is Kind.BIAS])
def test_generic_bias_heatmap_for_every_bias_encoding(name: str) -> None:
    pixels = data_pixels(make_figure(build_example(name), "bias", PlotOptions(length=8, max_heads=2)))
    assert_not_constant(pixels)


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


def test_sinusoidal_seed_figure_draws_the_seed_dimensions() -> None:
    # The first panels are dims 2, 6, 12 of the table over the positions, as in the seed.
    fig = make_figure(build_example("sinusoidal:dim=32"), "dims", PlotOptions(length=128))
    lines = [ax.lines[0] for ax in fig.axes]
    assert [ax.get_ylabel() for ax in fig.axes] == ["dim 2", "dim 6", "dim 12"]
    positions = np.arange(128, dtype=np.float64)
    for line, dim in zip(lines, (2, 6, 12)):
        # Paper formula, interleaved: PE[p, 2k] = sin(p * 10000^(-2k/D)).
        expected = np.sin(positions * 10000.0 ** (-(dim // 2) * 2 / 32))
        np.testing.assert_allclose(line.get_ydata(), expected, atol=1e-6)


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


# ---------------------------------------------------------------------------- curves (issue 26)


def _curve_records(encodings: list[str], train_len: int = 16, eval_len: int = 48):
    from posenc.experiments.results.records import Record

    return [
        Record(e, "copy", n, "exact_match", float(n <= train_len + i), 0, train_len, 100)
        for i, e in enumerate(encodings)
        for n in range(1, eval_len + 1)
    ]


def test_curves_have_a_linear_length_axis_over_the_evaluated_range_with_l_marked():
    from posenc.viz.curves import curve_figure

    encodings = ["rope", "alibi", "t5"]
    fig = curve_figure(_curve_records(encodings), "copy", "exact_match", encodings, binomial=True)
    (ax,) = fig.axes
    assert ax.get_xscale() == "linear"
    low, high = ax.get_xlim()
    assert 0 <= low <= 1 and 48 <= high <= 49  # the evaluated lengths, nothing else
    assert any(list(line.get_xdata()) == [16, 16] for line in ax.get_lines())  # L
    assert any(text.get_text() == "L=16" for text in ax.texts)
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels == encodings
    # A base-2 axis stays available.
    log = curve_figure(_curve_records(encodings), "copy", "exact_match", encodings, log_lengths=True)
    assert log.axes[0].get_xscale() == "log"


def test_curves_past_six_encodings_are_small_multiples():
    from posenc.viz.curves import SMALL_MULTIPLES_ABOVE, curve_figure

    encodings = [f"alibi:slope_scale={i}" for i in range(SMALL_MULTIPLES_ABOVE + 1)]
    fig = curve_figure(_curve_records(encodings), "copy", "exact_match", encodings, binomial=True)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == encodings
    for ax, encoding in zip(panels, encodings):
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels.count(encoding) == 1  # this encoding in colour ...
        assert labels.count("_others") == len(encodings) - 1  # ... over the others in grey
        assert ax.get_xscale() == "linear"
    assert len(fig.axes) == 8  # a 4 x 2 grid, the last cell hidden
    six = curve_figure(_curve_records(encodings[:6]), "copy", "exact_match", encodings[:6])
    assert len(six.axes) == 1
