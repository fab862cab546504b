"""The extrapolation runner: records for every task, the exact-match metric, outputs and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from posenc.encodings.spec import split_specs
from posenc.experiments import ExperimentConfig, run_experiment, summary_table
from posenc.experiments.results.folders import reproduce_command
from posenc.experiments.tasks.catalog import IGNORE, TASKS, make_task
from posenc.experiments.train import RunSpec, evaluate
from posenc.viz.folder import write_figures

TINY = dict(
    d_model=16,
    num_layers=1,
    num_heads=2,
    d_ff=16,
    batch_size=4,
    steps=2,
    warmup=1,
    eval_examples=3,
    checkpoint_every=1,
)


@pytest.mark.parametrize("task", list(TASKS))
def test_each_task_trains_and_writes_one_record_per_length_and_metric(task, tmp_path):
    train_len, eval_len = (8, 12) if task == "lm" else (2, 4)
    config = ExperimentConfig(
        task=task,
        encodings=["nope", "learned"],
        train_len=train_len,
        eval_len=eval_len,
        num_symbols=8,
        **TINY,
    )
    records = run_experiment(config, tmp_path, workers=1, figures=write_figures)
    metrics = ["perplexity"] if task == "lm" else ["exact_match", "token_accuracy"]
    keys = {(r["encoding"], r["task"], r["length"], r["seed"], r["metric"]) for r in records}
    assert len(keys) == len(records) == 2 * eval_len * len(metrics)
    assert keys == {
        (e, task, n, 0, m) for e in ("nope", "learned") for n in range(1, eval_len + 1) for m in metrics
    }
    for record in records:
        assert record["value"] >= 1.0 if task == "lm" else 0.0 <= record["value"] <= 1.0
        assert record["run"] == f"{record['encoding']}__{task}__seed0" and record["steps"] == 2
    assert json.loads((tmp_path / "config.json").read_text())["experiment"]["task"] == task
    csv_lines = (tmp_path / "results.csv").read_text().splitlines()
    assert (
        csv_lines[0].startswith("run,encoding,task,seed,length,metric,value")
        and len(csv_lines) == len(records) + 1
    )
    assert (tmp_path / "extrapolation.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        f"learned__{task}__seed0.pt",
        f"nope__{task}__seed0.pt",
    ]


class _Oracle(nn.Module):
    """Predicts the targets of a task's batches (looked up by the inputs), optionally one wrong token."""

    def __init__(self, table: dict, vocab: int, wrong_position: int | None = None) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))
        self.table, self.vocab, self.wrong = table, vocab, wrong_position

    def forward(self, inputs):
        logits = torch.zeros(*inputs.shape, self.vocab)
        for i, row in enumerate(inputs):
            targets = self.table[tuple(row.tolist())].clone()
            scored = (targets != IGNORE).nonzero()[:, 0]
            if self.wrong is not None and i == 0:
                targets[scored[self.wrong]] = (targets[scored[self.wrong]] + 1) % self.vocab
            logits[i, torch.arange(len(row)), targets.clamp(min=0)] = 1.0
        return logits


def test_exact_match_is_teacher_forced_all_positions(monkeypatch):
    """A model right at every output position scores 1; one wrong token (even EOS) fails that example."""
    config = ExperimentConfig(
        task="reverse", train_len=3, eval_len=3, eval_examples=4, eval_batch=4, num_symbols=8, distinct=False
    )
    task = make_task("reverse", num_symbols=8)
    table = {}
    original = task.batch

    def recording_batch(length, size, generator):
        batch = original(length, size, generator)
        for row, target in zip(batch.inputs, batch.targets):
            table[tuple(row.tolist())] = target
        return batch

    monkeypatch.setattr(task, "batch", recording_batch)
    run = RunSpec("nope", 0)
    perfect = evaluate(_Oracle(table, task.vocab_size), config, task, run, lambda *a: None)
    assert [r["value"] for r in perfect if r["metric"] == "exact_match"] == [1.0, 1.0, 1.0]
    for wrong in (0, -1):  # first output token, and EOS
        flawed = evaluate(_Oracle(table, task.vocab_size, wrong), config, task, run, lambda *a: None)
        assert [r["value"] for r in flawed if r["metric"] == "exact_match"] == [0.75, 0.75, 0.75]
        accuracy = [r["value"] for r in flawed if r["metric"] == "token_accuracy"]
        assert accuracy == [1 - 1 / (4 * (n + 1)) for n in (1, 2, 3)]


def test_same_seed_same_records_and_config_mismatch_refused(tmp_path):
    config = ExperimentConfig(
        task="copy", encodings=["alibi"], train_len=2, eval_len=3, num_symbols=8, **TINY
    )
    first = run_experiment(config, tmp_path / "a", workers=1)
    second = run_experiment(config, tmp_path / "b", workers=1)
    assert first == [dict(r) for r in second]
    other = ExperimentConfig(**{**config.to_dict(), "train_len": 3})
    with pytest.raises(ValueError, match="train_len"):
        run_experiment(other, tmp_path / "a", workers=1)


def test_two_workers_give_the_same_records_as_one(tmp_path):
    config = ExperimentConfig(
        task="copy", encodings=["nope", "alibi"], train_len=2, eval_len=3, num_symbols=8, **TINY
    )
    serial = run_experiment(config, tmp_path / "serial", workers=1)
    parallel = run_experiment(config, tmp_path / "parallel", workers=2)
    key = lambda r: (r["encoding"], r["length"], r["metric"])  # noqa: E731
    assert sorted(serial, key=key) == sorted(parallel, key=key)
    assert json.loads((tmp_path / "parallel" / "config.json").read_text())["runtime"]["workers"] == 2


def test_cli_prints_the_summary_table(tmp_path):
    from posenc.cli.app import _load_command_modules, app

    _load_command_modules()
    args = [
        "extrapolate",
        "--task",
        "count_copy",
        "--encodings",
        "nope,alibi:mode=symmetric",
        "--train-len",
        "2",
        "--eval-len",
        "5",
    ]
    args += [
        "--steps",
        "2",
        "--d-model",
        "16",
        "--num-layers",
        "1",
        "--d-ff",
        "16",
        "--eval-examples",
        "2",
        "--workers",
        "1",
    ]
    args += ["--out", str(tmp_path), "--no-progress"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    for text in ("at L=2", "mean 3..5", "at L+1=3", "at 2L=4", "nope", "alibi:mode=symmetric"):
        assert text in result.output, result.output
    bad = CliRunner().invoke(
        app, ["extrapolate", "--task", "kopy", "--out", str(tmp_path / "x"), "--no-progress"]
    )
    assert bad.exit_code == 2 and "unknown task" in bad.output


def test_split_specs_keeps_options_with_their_encoding():
    assert split_specs("nope,rope:base=500000,pairing=half,alibi") == [
        "nope",
        "rope:base=500000,pairing=half",
        "alibi",
    ]
    assert split_specs(" t5 , shaw:k=4 ") == ["t5", "shaw:k=4"]


def test_hybrid_encoding_runs_one_spec_per_layer(tmp_path):
    from posenc.experiments.train import build_model, run_id_for

    config = ExperimentConfig(
        task="copy",
        encodings=["t5/sinusoidal"],
        train_len=2,
        eval_len=3,
        num_symbols=8,
        **{**TINY, "num_layers": 2},
    )
    model = build_model(config, config.make_task(), "t5/sinusoidal")
    assert [b.attn.encoding.name for b in model.blocks] == ["t5", "nope"]
    assert [e.name for e in model.input_encodings] == ["sinusoidal"]
    run_id = run_id_for(config, RunSpec("t5/sinusoidal", 0))
    assert "/" not in run_id and run_id.startswith("t5+sinusoidal-")
    records = run_experiment(config, tmp_path, workers=1)
    assert {r["encoding"] for r in records} == {"t5/sinusoidal"}
    assert (tmp_path / "checkpoints" / f"{run_id}.pt").exists()


def test_experiment_library_runs_without_rich(tmp_path):
    """Rich is the CLI's (the ``cli`` extra): the library imports and runs a tiny experiment without it."""
    import subprocess
    import sys

    code = f"""
import sys
sys.modules["rich"] = None  # any "import rich..." now raises ImportError
from posenc.experiments import ExperimentConfig, run_experiment
config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, num_symbols=8, **{TINY!r})
events = []
records = run_experiment(config, sys.argv[1], workers=1, report=lambda *args: events.append(args), log=print)
assert len(records) == 3 * 2 and any(e[1] == "eval" for e in events), (records, events)
print("library ran without rich")
"""
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "library ran without rich" in done.stdout
    assert "done already" not in done.stdout and "results:" in done.stdout


def test_layer_presets_run_as_encodings(tmp_path):
    config = ExperimentConfig(
        task="copy", encodings=["gemma3:window=2,global_every=2", "gpt-oss:window=2"], train_len=2,
        eval_len=3, num_symbols=8, **TINY,
    )  # fmt: skip
    records = run_experiment(config, tmp_path, workers=1)
    assert {r["encoding"] for r in records} == set(config.encodings)


NEW_RECIPES = [
    "cohere2:window=2",
    "gemma4:window=2,global_every=2",
    "granite-swa:window=2,full_base=0",
    "olmo3:window=2",
    "swan:window=2",
]


def test_the_2025_recipes_train_from_the_command_line(tmp_path):
    """``posenc extrapolate --encodings cohere2:...,gemma4:...`` trains each recipe on four layers
    (both layer types present) and writes its records."""
    from typer.testing import CliRunner

    from posenc.cli.app import _load_command_modules, app

    _load_command_modules()
    out = tmp_path / "run"
    tiny = ["--encodings", ",".join(NEW_RECIPES), "--steps", "2", "--train-len", "2", "--eval-len", "3"]
    tiny += ["--num-symbols", "8", "--d-model", "16", "--num-layers", "4", "--num-heads", "2"]
    tiny += ["--d-ff", "16", "--batch-size", "4", "--eval-examples", "3", "--workers", "1"]
    result = CliRunner().invoke(app, ["extrapolate", *tiny, "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["encoding"] for r in records} == set(NEW_RECIPES)


def test_a_bad_spec_fails_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    config = ExperimentConfig(task="copy", encodings=["nope", "rope:bse=3"], train_len=2, eval_len=3, **TINY)
    with pytest.raises(ValueError, match=r"--encodings 'rope:bse=3': rope: unknown option 'bse'"):
        run_experiment(config, out, workers=1)
    assert not out.exists()


def test_packed_training_runs_end_to_end(tmp_path):
    config = ExperimentConfig(task="copy", encodings=["rope"], train_len=3, eval_len=4, pack=True, **TINY)
    records = run_experiment(config, tmp_path, workers=1)
    assert {r["length"] for r in records} == {1, 2, 3, 4}
    assert json.loads((tmp_path / "config.json").read_text())["experiment"]["pack"] is True
    unpacked = ExperimentConfig(task="copy", encodings=["rope"], train_len=3, eval_len=4, **TINY)
    with pytest.raises(ValueError, match="pack"):  # one folder never mixes packed and unpacked runs
        run_experiment(unpacked, tmp_path, workers=1)


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


def test_a_second_writer_on_one_folder_is_refused_and_a_dead_owner_is_taken_over(tmp_path):
    import os
    import socket

    from posenc.experiments.results.folders import LOCK_NAME, folder_lock

    config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, **TINY)
    tmp_path.mkdir(exist_ok=True)
    with (
        folder_lock(tmp_path),  # another writer holds the folder
        pytest.raises(ValueError, match="being written by another posenc process"),
    ):
        run_experiment(config, tmp_path, workers=1)
    assert not (tmp_path / LOCK_NAME).exists()  # released
    dead = 2**22 + 12345  # above the kernel's pid range: no such process
    (tmp_path / LOCK_NAME).write_text(f"{dead} {socket.gethostname()}\n")
    records = run_experiment(config, tmp_path, workers=1)  # a killed owner's lock is taken over
    assert len(records) == 3 * 2 and not (tmp_path / LOCK_NAME).exists()
    assert os.getpid() != dead


def test_duplicated_and_missing_records_are_repaired_on_the_next_run(tmp_path):
    config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, **TINY)
    first = run_experiment(config, tmp_path, workers=1)
    path = tmp_path / "results.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines + lines[:2]) + "\n")  # two records written twice
    with pytest.warns(UserWarning, match="dropped 2 exact duplicate record"):
        again = run_experiment(config, tmp_path, workers=1)
    assert len(again) == len(first)
    # A record lost from the file: the run counts as unfinished and is redone, never duplicated.
    lines = path.read_text().splitlines()
    kept = [line for n, line in enumerate(lines) if '"length": 3' not in line and line not in lines[:n]]
    path.write_text("\n".join(kept) + "\n")
    redone = run_experiment(config, tmp_path, workers=1)
    assert sorted((r["length"], r["metric"]) for r in redone) == sorted(
        (r["length"], r["metric"]) for r in first
    )


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


def test_a_folder_evaluated_at_contiguous_positions_is_not_reused_for_random_ones(tmp_path):
    """Folders written before --eval-positions evaluated randomized runs at 0..n-1: they read as
    contiguous, so a run that draws evaluation positions refuses them instead of mixing records."""
    common = {"task": "copy", "encodings": ["rope"], "train_len": 3, "eval_len": 4, "randomize_positions": 40}
    run_experiment(ExperimentConfig(**common, **TINY), tmp_path, workers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["experiment"].pop("randomize_eval_positions") is False  # now as an older folder
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="randomize_eval_positions"):
        run_experiment(ExperimentConfig(**common, randomize_eval_positions=True, **TINY), tmp_path, workers=1)
    # Plain runs never compare the option.
    plain = {**common, "randomize_positions": None}
    run_experiment(ExperimentConfig(**plain, **TINY), tmp_path / "plain", workers=1)
    run_experiment(
        ExperimentConfig(**plain, randomize_eval_positions=True, **TINY), tmp_path / "plain", workers=1
    )


def _records(encoding, seed, values_by_length, task="copy"):
    return [
        {"run": f"{encoding}-{seed}", "encoding": encoding, "task": task, "seed": seed, "train_len": 2,
         "steps": 1, "length": n, "metric": "exact_match", "value": v, "examples": 10}
        for n, v in values_by_length.items()
    ]  # fmt: skip


def test_summary_ranks_only_encodings_that_fit_and_gives_seed_intervals():
    """Hand-computed: rope fits on both seeds (in-distribution means 1.0 and 0.95), nope does not
    (0.5 and 1.0). Beyond L=2 rope's per-seed means are 0.4 and 0.8: mean 0.6, standard deviation
    0.2·√2, so the Student's t interval is 0.6 ± t(0.975, 1)·0.2 with the tabulated t(0.975, 1) =
    12.706205; the table keeps it inside [0%, 100%] (two seeds say almost nothing)."""
    from posenc.experiments.results.records import summarize

    records = (
        _records("rope", 0, {1: 1.0, 2: 1.0, 3: 0.4, 4: 0.4})
        + _records("rope", 1, {1: 1.0, 2: 0.9, 3: 0.8, 4: 0.8})
        + _records("nope", 0, {1: 0.5, 2: 0.5, 3: 0.0, 4: 0.0})
        + _records("nope", 1, {1: 1.0, 2: 1.0, 3: 0.1, 4: 0.3})
    )
    rope, nope = summarize(records, "exact_match", 2, ["rope", "nope"], fit_threshold=0.95)
    assert rope["iid"] == pytest.approx(0.975) and rope["fit"] == 2
    assert nope["iid"] == pytest.approx(0.75) and nope["fit"] == 1
    assert rope["beyond_interval"] == pytest.approx((0.6 - 12.706205 * 0.2, 0.6 + 12.706205 * 0.2), abs=1e-6)
    bounded = summarize(records, "exact_match", 2, ["rope"], fit_threshold=0.95, bounds=(0.0, 1.0))
    assert bounded[0]["beyond_interval"] == (0.0, 1.0)
    assert summarize(records, "exact_match", 2, ["rope"])[0]["fit"] is None  # no threshold, no flag
    config = ExperimentConfig(task="copy", encodings=["rope", "nope"], train_len=2, eval_len=4)
    table = summary_table(config, records, config.make_task().metric)
    assert table.columns[:3] == ["encoding", "<=2, fit", "at L=2"]
    assert table.rows[0][:2] == ["rope", "97.5%, 2/2"]
    assert table.rows[0][3] == "60.0% [0.0%, 100.0%]"
    assert table.rows[1][1] == "75.0%, 1/2"
    assert len(table.notes) == 2 and "not ranked" in table.notes[0]
    assert "95% Student's t interval" in table.notes[1]
    assert "nope (in-distribution 75.0%)" in table.notes[0] and "rope" not in table.notes[0]


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


@pytest.mark.parametrize(
    "words, named",
    [
        (["--lr", "inf"], "invalid lr=inf"),
        (["--until-fit", "--fit-margin", "0.06"], "invalid fit_margin=0.06"),
    ],
)
def test_cli_refuses_an_infinite_lr_and_an_unreachable_fit_target_before_writing(tmp_path, words, named):
    from posenc.cli.app import _load_command_modules, app

    _load_command_modules()
    out = tmp_path / "x"
    # A tiny grid, so that were the settings accepted the run would end in seconds.
    tiny = [
        "--encodings",
        "nope",
        "--steps",
        "1",
        "--train-len",
        "2",
        "--eval-len",
        "2",
        "--num-symbols",
        "8",
    ]
    tiny += ["--d-model", "8", "--num-layers", "1", "--num-heads", "1", "--d-ff", "8", "--batch-size", "2"]
    tiny += ["--eval-examples", "1", "--workers", "1", "--no-progress", "--out", str(out)]
    result = CliRunner().invoke(app, ["extrapolate", *tiny, *words])
    assert result.exit_code == 2 and named in result.output, result.output
    assert not out.exists()


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
