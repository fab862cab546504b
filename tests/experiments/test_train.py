"""Training one run (posenc.experiments.train): randomized positions follow the paper's distribution and are
checked, drawn at evaluation too unless contiguous; the warm-up shapes the schedule; training until fit;
an invalid setting names itself and what it must be."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from _experiments import TINY
from _study import STUDY_TINY
from posenc.experiments import ExperimentConfig, run_experiment, summary_table
from posenc.experiments import train as train_module
from posenc.experiments.results.folders import reproduce_command
from posenc.experiments.results.records import (
    read_records,
    read_run_records,
)
from posenc.experiments.train import RunSpec, evaluate


def test_random_positions_follow_the_papers_distribution():
    """Ruoss et al. 2023: a uniform draw of n distinct positions out of N, sorted. Each position is
    then included with probability n/N, and the draws are sorted and distinct."""
    from posenc.experiments.train import random_positions

    gen = torch.Generator().manual_seed(0)
    n, big_n, rows = 6, 20, 20000
    pos = random_positions(rows, n, big_n, gen)
    assert pos.shape == (rows, n)
    assert bool((pos[:, 1:] > pos[:, :-1]).all()) and int(pos.min()) >= 0 and int(pos.max()) < big_n
    inclusion = torch.bincount(pos.flatten(), minlength=big_n).float() / rows
    torch.testing.assert_close(inclusion, torch.full((big_n,), n / big_n), atol=0.015, rtol=0)
    # The smallest of n uniform draws without replacement: P(min >= m) = C(N - m, n) / C(N, n).
    from math import comb

    for m in (1, 3, 6):
        expected = comb(big_n - m, n) / comb(big_n, n)
        assert abs(float((pos[:, 0] >= m).float().mean()) - expected) < 0.015


def test_randomized_positions_train_and_are_checked(tmp_path):
    config = ExperimentConfig(
        task="copy", encodings=["rope", "learned"], train_len=3, eval_len=4, randomize_positions=64, **TINY
    )
    records = run_experiment(config, tmp_path / "ok", workers=1)
    assert {r["encoding"] for r in records} == {"rope", "learned"}
    small = ExperimentConfig(
        task="copy", encodings=["rope"], train_len=3, eval_len=4, randomize_positions=5, **TINY
    )
    with pytest.raises(ValueError, match="must be at least the training sequence length 8"):
        run_experiment(small, tmp_path / "small", workers=1)
    assert not (tmp_path / "small").exists()


def test_randomized_positions_are_drawn_at_evaluation_too_unless_contiguous(tmp_path):
    """The paper's reference code samples positions at test time as well: every evaluation batch gets
    sorted distinct positions from [0, N); with --eval-positions contiguous it gets none (0..n-1)."""
    seen = []

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, inputs, positions=None):
            seen.append(positions)
            return torch.zeros(*inputs.shape, 16)

    for randomize_eval, expect_positions in ((True, True), (False, False)):
        seen.clear()
        config = ExperimentConfig(
            task="copy", encodings=["rope"], train_len=3, eval_len=4, randomize_positions=40,
            randomize_eval_positions=randomize_eval, **TINY,
        )  # fmt: skip
        evaluate(Recorder(), config, config.make_task(), RunSpec("rope", 0), lambda *a: None)
        assert seen and all((p is not None) == expect_positions for p in seen)
        for positions in seen if expect_positions else []:
            assert positions.min() >= 0 and positions.max() < 40
            assert (positions[:, 1:] > positions[:, :-1]).all()  # sorted and distinct
    # Drawing from [0, N) needs N at least the longest evaluated input (copy at 4: BOS x SEP y = 10).
    short = ExperimentConfig(
        task="copy", encodings=["rope"], train_len=3, eval_len=4, randomize_positions=9,
        randomize_eval_positions=True, **TINY,
    )  # fmt: skip
    with pytest.raises(ValueError, match="longest evaluated sequence, 10"):
        run_experiment(short, tmp_path / "short", workers=1)
    contiguous = ExperimentConfig(
        task="copy", encodings=["rope"], train_len=3, eval_len=4, randomize_positions=9,
        randomize_eval_positions=False, **TINY,
    )  # fmt: skip
    assert run_experiment(contiguous, tmp_path / "contiguous", workers=1)


@pytest.mark.parametrize("threshold", [0.0, 1.5, -0.1])
def test_fit_threshold_outside_0_1_is_refused(threshold):
    with pytest.raises(ValueError, match="fit_threshold"):
        ExperimentConfig(task="copy", encodings=["rope"], fit_threshold=threshold).validate()


@pytest.mark.parametrize(
    "settings, name, need",
    [
        ({"warmup": -1}, "warmup", "0 or more steps"),
        ({"train_len": 8, "eval_len": 4}, "eval_len", "at least train_len"),
        ({"min_train_len": 0}, "min_train_len", "between 1 and train_len"),
        ({"lr": 0.0}, "lr", "positive"),
        ({"seeds": [1, 1]}, "seeds", "no duplicates"),
        ({"fit_margin": 1.0}, "fit_margin", "in [0, 1)"),
        # inf passed `lr > 0` and trained nan weights; the other float settings had the same hole.
        ({"lr": math.inf}, "lr", "positive and finite"),
        ({"weight_decay": math.nan}, "weight_decay", "0 or more and finite"),
        ({"weight_decay": math.inf}, "weight_decay", "0 or more and finite"),
        ({"grad_clip": math.nan}, "grad_clip", "positive finite norm"),
        ({"grad_clip": math.inf}, "grad_clip", "positive finite norm"),
        ({"dropout": math.nan}, "dropout", "in [0, 1)"),
        ({"dropout": math.inf}, "dropout", "in [0, 1)"),
    ],
)
def test_invalid_setting_names_itself_and_what_it_must_be(settings, name, need):
    with pytest.raises(ValueError) as error:
        ExperimentConfig(task="copy", encodings=["rope"], **settings).validate()
    assert f"invalid {name}=" in str(error.value) and need in str(error.value)


def test_until_fit_refuses_a_target_above_an_exact_match_of_one():
    """--fit-threshold 0.95 --fit-margin 0.06 asks for 101%: no run would fit, each would train to
    --steps without a word. Up to 1 exactly is fine, and without --until-fit the margin is unused."""
    config = ExperimentConfig(task="copy", encodings=["rope"], until_fit=True, fit_margin=0.06)
    with pytest.raises(ValueError) as error:
        config.validate()
    message = str(error.value)
    assert "invalid fit_margin=0.06" in message and "0.95 + 0.06 = 1.01" in message
    assert "lower --fit-margin to at most 0.05" in message
    ExperimentConfig(task="copy", encodings=["rope"], until_fit=True, fit_margin=0.05).validate()
    ExperimentConfig(
        task="copy", encodings=["rope"], until_fit=True, fit_threshold=0.93, fit_margin=0.07
    ).validate()
    ExperimentConfig(task="copy", encodings=["rope"], fit_margin=0.06).validate()


def test_warmup_is_an_option_and_shapes_the_schedule():
    from posenc.experiments.train import _lr_factor

    # The paper formula written out: linear to the peak over `warmup` steps, then cosine to 10%.
    config = ExperimentConfig(task="copy", encodings=["rope"], steps=100, warmup=10)
    factor = _lr_factor(config)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0) and factor(100) == pytest.approx(0.1)
    assert factor(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    no_warmup = _lr_factor(ExperimentConfig(task="copy", encodings=["rope"], steps=100, warmup=0))
    assert no_warmup(0) == pytest.approx(1.0)
    command, caveats = reproduce_command(config, Path("out"))
    assert "--warmup 10" in command and caveats == []


# ----------------------------------------------------------------------------
# The main job as a study (issue 14): fit first, uncertainty, inference-time variants, the report.


def test_until_fit_stops_at_the_first_check_that_fits(tmp_path, monkeypatch):
    """Scripted fit-check scores (0.5 at step 2, 0.97 at step 4): training stops at step 4."""
    checked: list[int] = []

    def scripted(model, config, task, run):
        checked.append(len(checked))
        return [0.5, 0.97][min(len(checked) - 1, 1)]

    monkeypatch.setattr(train_module, "fit_check_score", scripted)
    base = dict(task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **STUDY_TINY)
    config = ExperimentConfig(**{**base, "steps": 9}, until_fit=True, fit_check_every=2)
    run_experiment(config, tmp_path / "fits", workers=1)
    (run,) = read_run_records(tmp_path / "fits")
    assert run["steps_trained"] == 4 and run["steps_to_fit"] == 4 and len(checked) == 2
    state = torch.load(tmp_path / "fits" / "checkpoints" / "alibi__copy__seed0.pt", weights_only=False)
    assert state["step"] == 4 and state["fitted_at"] == 4
    table = summary_table(config, read_records(tmp_path / "fits" / "results.jsonl"), config.make_task().metric,
                          read_run_records(tmp_path / "fits"))  # fmt: skip
    assert any("fit check passed at step" in note and note.endswith("alibi 4") for note in table.notes)
    # A threshold no check reaches: every step runs, checked at 2, 4, 6, 8 and the last step, 9.
    checked.clear()
    monkeypatch.setattr(train_module, "fit_check_score", lambda *args: checked.append(1) or 0.5)
    run_experiment(config, tmp_path / "never", workers=1)
    (run,) = read_run_records(tmp_path / "never")
    assert run["steps_trained"] == 9 and run["steps_to_fit"] is None and len(checked) == 5


def test_until_fit_with_a_margin_stops_only_above_threshold_plus_margin(tmp_path, monkeypatch):
    """Scripted scores 0.96 (step 2), 0.99 (step 4): at 0.95 + 0.02, 0.96 does not stop it."""
    scores = iter([0.96, 0.99])
    monkeypatch.setattr(train_module, "fit_check_score", lambda *args: next(scores))
    base = dict(task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **STUDY_TINY)
    config = ExperimentConfig(**{**base, "steps": 9}, until_fit=True, fit_check_every=2, fit_margin=0.02)
    assert config.identity()["fit_margin"] == 0.02 and "fit_margin" not in ExperimentConfig(**base).identity()
    run_experiment(config, tmp_path, workers=1)
    (run,) = read_run_records(tmp_path)
    assert run["steps_trained"] == 4 and run["steps_to_fit"] == 4


def test_a_run_that_fitted_resumes_without_training_past_its_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(train_module, "fit_check_score", lambda *args: 1.0)
    base = dict(task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **STUDY_TINY)
    config = ExperimentConfig(**{**base, "steps": 9}, until_fit=True, fit_check_every=2)
    first = run_experiment(config, tmp_path, workers=1)
    (tmp_path / "results.jsonl").unlink()  # as if killed after the checkpoint, before the records

    def no_more_checks(*args):
        raise AssertionError("a run that fitted was checked (trained) again")

    monkeypatch.setattr(train_module, "fit_check_score", no_more_checks)
    assert run_experiment(config, tmp_path, workers=1) == first
    (run,) = read_run_records(tmp_path)
    assert run["steps_trained"] == 2 and run["steps_to_fit"] == 2


def test_until_fit_checks_on_examples_apart_from_the_evaluation(monkeypatch):
    seen: list[int] = []
    config = ExperimentConfig(
        task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **STUDY_TINY
    )
    task = config.make_task()
    original = task.metric.evaluate

    def spy(model, task, **kwargs):
        seen.append(kwargs["seed"])
        return original(model, task, **kwargs)

    monkeypatch.setattr(task, "metric", type(task.metric)(**{**task.metric.__dict__, "evaluate": spy}))
    model = train_module.build_model(config, task, "alibi")
    train_module.fit_check_score(model, config, task, train_module.RunSpec("alibi", 0))
    train_module.evaluate(model, config, task, train_module.RunSpec("alibi", 0), lambda *a: None)
    assert seen[0] == train_module.mix_seed(0, "fit-check") and seen[1] == 0 and seen[0] != seen[1]


def test_until_fit_enters_the_folder_identity_with_its_threshold(tmp_path):
    base = dict(task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **STUDY_TINY)
    plain = ExperimentConfig(**base)
    assert "until_fit" in plain.identity() and "fit_check_every" not in plain.identity()
    assert "fit_threshold" not in plain.identity()
    assert ExperimentConfig(**base, until_fit=True).identity()["fit_threshold"] == 0.95
    run_experiment(plain, tmp_path, workers=1)
    run_experiment(ExperimentConfig(**base, fit_threshold=0.5), tmp_path, workers=1)  # display only
    with pytest.raises(ValueError, match=r"until_fit: False there vs True now"):
        run_experiment(ExperimentConfig(**base, until_fit=True), tmp_path, workers=1)
