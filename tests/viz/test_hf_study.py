"""A study's figures (posenc.viz.hf_study): the depth heat map is in tokens and names each depth."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")

tokenizers = pytest.importorskip("tokenizers")

from _tiny_hf import save_tiny_llama  # noqa: E402
from posenc.experiments.results.records import read_records  # noqa: E402
from posenc.experiments.study.hf_study import (  # noqa: E402
    run_study,
)

CONTEXT = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", CONTEXT)


def test_the_depth_heat_map_of_a_study_is_in_tokens_and_names_each_depth(model_dir, tmp_path):
    """The heat map said "length (filler symbols)" (the synthetic task's unit) and "25%-25%"."""
    from posenc.viz.hf_study import study_figures

    _, settings = run_study(
        model_dir, tmp_path / "o", task="text-passkey", lengths=[100], depths="0,0.25", eval_len=128
    )
    records = read_records(tmp_path / "o" / "results.jsonl")
    figures = {}
    study_figures(tmp_path, settings, records, lambda fig, path: figures.setdefault(path.name, fig))
    ax = figures["depth.png"].axes[0]
    assert ax.get_xlabel() == "prompt length (tokens)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0%", "25%"]


def test_the_perplexity_figure_shades_each_variants_interval_across_windows():
    """Records with intervals (--eval-examples >= 2) get a band per variant between the interval's
    ends; a variant without intervals (one window) gets its line only."""
    from matplotlib.collections import PolyCollection

    from posenc.viz.hf_study import perplexity_by_position_figure

    def record(label, length, value, interval):
        return {
            "encoding": label,
            "metric": "perplexity",
            "length": length,
            "value": value,
            "interval": interval,
        }

    records = [
        record("m", 32, 10.0, [9.0, 11.0]),
        record("m", 64, 12.0, [10.0, 14.0]),
        record("m + yarn", 32, 10.5, None),
        record("m + yarn", 64, 11.0, None),
    ]
    settings = {"encodings": ["m", "m + yarn"], "train_len": 32, "hf_model": "tiny", "model_class": "Llama"}
    ax = perplexity_by_position_figure(settings, records).axes[0]
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1
    vertices = bands[0].get_paths()[0].vertices
    assert {round(float(y), 6) for y in vertices[:, 1]} >= {9.0, 10.0, 11.0, 14.0}
    assert [line.get_label() for line in ax.get_lines()][:2] == ["m", "m + yarn"]
