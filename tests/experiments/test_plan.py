"""Checking an experiment before anything is written (posenc.experiments.plan.check_experiment): a bad spec,
and study options a run cannot take, fail before the folder exists."""

from __future__ import annotations

import pytest

from _experiments import TINY
from _study import STUDY_TINY
from posenc.experiments import ExperimentConfig, run_experiment


def test_a_bad_spec_fails_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    config = ExperimentConfig(task="copy", encodings=["nope", "rope:bse=3"], train_len=2, eval_len=3, **TINY)
    with pytest.raises(ValueError, match=r"--encodings 'rope:bse=3': rope: unknown option 'bse'"):
        run_experiment(config, out, workers=1)
    assert not out.exists()


# ----------------------------------------------------------------------------
# Training one run (posenc.experiments.train): randomized positions follow the paper's distribution and are
# checked, drawn at evaluation too unless contiguous; the warm-up shapes the schedule; an invalid setting
# names itself and what it must be.


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            dict(task="lm", train_len=8, eval_len=10, until_fit=True),
            r"--until-fit needs a task scored by exact match",
        ),
        (dict(fit_check_every=0), r"fit_check_every"),
        (
            dict(eval_variants=["yarn"], encodings=["rope", "alibi"]),
            r"'yarn' does not apply to --encodings 'alibi'",
        ),
        (dict(eval_variants=["warp"]), r"--eval-variants 'warp': unknown variant"),
        (dict(eval_variants=["yarn:0.5"]), r"'yarn:0.5': the factor must be >= 1"),
        (dict(eval_variants=["prope:1.5"]), r"'prope:1.5': the rotating fraction must be in \(0, 1\]"),
        (dict(eval_variants=["drop_rotation:2"]), r"drop_rotation takes no value"),
        (dict(eval_variants=["yarn", "yarn"]), r"lists yarn twice"),
        (
            dict(eval_variants=["temperature"], encodings=["llama4:chunk=2,nope_every=1"]),
            r"already scale their queries",
        ),
        (
            dict(eval_variants=["yarn"], encodings=["gemma3:window=2"]),
            r"'yarn' does not apply .*a layer preset",
        ),
    ],
)
def test_bad_study_options_fail_before_anything_is_written(tmp_path, options, match):
    settings = dict(task="copy", encodings=["rope"], train_len=2, eval_len=3, num_symbols=8, **STUDY_TINY)
    config = ExperimentConfig(**{**settings, **options})
    with pytest.raises(ValueError, match=match):
        run_experiment(config, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()
