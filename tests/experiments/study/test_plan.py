"""A study's plan (posenc.experiments.study.plan): the plan from the config alone is the plan the run
records."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")

tokenizers = pytest.importorskip("tokenizers")

from _tiny_hf import TEXT, save_tiny_llama  # noqa: E402
from posenc.experiments.cluster.shards import Shard  # noqa: E402
from posenc.experiments.study.hf_study import (  # noqa: E402
    run_study,
)

CONTEXT = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", CONTEXT)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT * 40)
    return str(path)


STUDY = dict(task="text", lengths=[100, 128], depths="0.5", eval_examples=1, variants=["none", "ntk", "yarn"])


def test_the_plan_from_the_config_alone_is_the_plan_the_run_records(model_dir, corpus, tmp_path):
    """``posenc submit`` plans on a login node from the config (no weights); the array tasks must
    find that same plan, or a rerun would count the wrong units as missing."""
    from posenc.experiments.study.plan import study_grid

    grid = study_grid(model_dir, corpus=corpus, **STUDY)
    _, settings = run_study(model_dir, tmp_path / "run", shard=Shard(0, 6), corpus=corpus, **STUDY)
    assert grid.settings() == settings
    assert grid.size() == 3 * 2  # variants x lengths
    # variant-major, shard 1 of 4 takes positions 1 and 5
    assert [u.label for u in grid.units(1, 4)] == ["tiny-llama @ 128", "tiny-llama + yarn @ 128"]
