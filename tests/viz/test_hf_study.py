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
