"""Retrieval tasks (passkey, mqar, niah): answers, depths and seeds checked against the independent
readers of ``_retrieval_reference``; the retrieval metric; a tiny end-to-end run of each."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from _retrieval_reference import MARK, expected_answer, passkey_parts
from posenc.experiments import ExperimentConfig, run_experiment
from posenc.experiments.tasks.catalog import BOS, EOS, SEP, make_task
from posenc.experiments.tasks.retrieval import DEPTH_BUCKETS
from posenc.viz.folder import write_figures

RETRIEVAL = ["passkey", "mqar", "niah"]

TINY = dict(
    d_model=16, num_layers=1, num_heads=2, d_ff=16, batch_size=4, steps=2, warmup=1, checkpoint_every=1
)


def _x_y(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[list[int], list[int]]:
    tokens = torch.cat([inputs, targets[-1:]]).tolist()
    assert tokens[0] == BOS and tokens[-1] == EOS
    sep = tokens.index(SEP)
    return tokens[1:sep], tokens[sep + 1 : -1]


def _bucket(depth: int, length: int) -> int:
    """Written from the definition: depth fraction d/n in [b/5, (b+1)/5), 1.0 in the last bucket."""
    fraction = Fraction(depth, length)
    return next(
        b for b in range(DEPTH_BUCKETS) if fraction < Fraction(b + 1, DEPTH_BUCKETS) or b == DEPTH_BUCKETS - 1
    )


@pytest.mark.parametrize("name", RETRIEVAL)
@pytest.mark.parametrize("num_symbols", [9, 16, 64])
@pytest.mark.parametrize("length", [1, 2, 4, 13])
def test_answers_are_right_for_every_example(name, num_symbols, length):
    task = make_task(name, num_symbols=num_symbols)
    if name == "mqar" and length > num_symbols // 2:
        with pytest.raises(ValueError, match=r"mqar: \d+ pairs need num_symbols"):
            task.batch(length, 1, torch.Generator())
        return
    batch = task.batch(length, 16, torch.Generator().manual_seed(length))
    for i in range(16):
        x, y = _x_y(batch.inputs[i], batch.targets[i])
        assert y == expected_answer(name, x, num_symbols)
        assert len(x) == task.input_length(length) and len(y) == task.output_length(length)
        if name == "passkey":
            assert passkey_parts(x, num_symbols)[2] == length, "the length counts filler symbols"
        if name == "niah":
            assert x.count(MARK) == 4 + 1 and len(y) == 2, "4 needles, 2 asked (defaults)"
        if name == "mqar":
            assert len(y) == min(length, 4)


def test_passkey_depths_are_where_the_key_is_and_uniform_within_their_buckets():
    task = make_task("passkey", num_symbols=16)
    length, examples = 10, 3000
    batch, depths = task.eval_batch(length, examples, torch.Generator().manual_seed(0))
    counts: dict[int, dict[int, int]] = {}
    for i in range(examples):
        x, _ = _x_y(batch.inputs[i], batch.targets[i])
        depth = passkey_parts(x, 16)[1]
        assert depth == int(depths[i])
        counts.setdefault(_bucket(depth, length), {}).setdefault(depth, 0)
        counts[_bucket(depth, length)][depth] += 1
    # Stratified: examples go to the buckets in turn, so each holds exactly a fifth of them.
    assert {b: sum(c.values()) for b, c in counts.items()} == {b: examples // 5 for b in range(5)}
    # Within a bucket every depth it holds at this length is drawn, equally often (5 sigma).
    expected_depths = {b: {d for d in range(length + 1) if _bucket(d, length) == b} for b in range(5)}
    for bucket, seen in counts.items():
        assert set(seen) == expected_depths[bucket]
        p = 1 / len(seen)
        n = sum(seen.values())
        for count in seen.values():
            assert abs(count - n * p) < 5 * (n * p * (1 - p)) ** 0.5
    # Training data: depths uniform over 0..n.
    train = task.batch(4, 2500, torch.Generator().manual_seed(1))
    drawn = [passkey_parts(_x_y(train.inputs[i], train.targets[i])[0], 16)[1] for i in range(2500)]
    for depth in range(5):
        assert abs(drawn.count(depth) - 500) < 5 * (2500 * 0.2 * 0.8) ** 0.5


def test_stratification_continues_across_evaluation_batches():
    task = make_task("passkey", num_symbols=16)
    gen = torch.Generator().manual_seed(0)
    first = task.eval_batch(20, 3, gen, first=0)[1]
    second = task.eval_batch(20, 7, gen, first=3)[1]
    buckets = [_bucket(int(d), 20) for d in torch.cat([first, second])]
    assert buckets == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    # At length 1 only depths 0 (bucket 0) and 1 (bucket 4) exist: examples alternate between them.
    tiny = task.eval_batch(1, 4, gen)[1]
    assert tiny.tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("name", RETRIEVAL)
def test_a_seed_reproduces_the_data(name):
    task = make_task(name, num_symbols=16)
    a = task.batch(6, 8, torch.Generator().manual_seed(5))
    b = task.batch(6, 8, torch.Generator().manual_seed(5))
    c = task.batch(6, 8, torch.Generator().manual_seed(6))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)


def test_bad_options_are_refused_with_the_parameter_named():
    with pytest.raises(ValueError, match=r"needles must be in 1\.\.4"):
        make_task("niah", num_symbols=8).__class__(num_symbols=8, needles=5)
    with pytest.raises(ValueError, match="num_symbols must be >= 3"):
        make_task("passkey", num_symbols=2)
    with pytest.raises(ValueError, match="key_length"):
        make_task("passkey").__class__(key_length=0)


class _NextToken(nn.Module):
    """Predicts every next token right (teacher forcing), except where ``wrong(row, x)`` says so:
    then the first answer symbol is off by one."""

    def __init__(self, vocab: int, wrong) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))
        self.vocab, self.wrong = vocab, wrong

    def forward(self, inputs):
        predicted = torch.cat([inputs[:, 1:], torch.full_like(inputs[:, :1], EOS)], dim=1)
        for i, row in enumerate(inputs.tolist()):
            sep = row.index(SEP)
            if self.wrong(row[1:sep]):
                predicted[i, sep] = (predicted[i, sep] + 1) % self.vocab
        return nn.functional.one_hot(predicted, self.vocab).float()


def _evaluate(task, model, eval_len, examples=10, batch_size=4):
    return task.metric.evaluate(
        model,
        task,
        eval_len=eval_len,
        examples=examples,
        batch_size=batch_size,
        seed=0,
        progress=lambda *a: None,
    )


def test_passkey_metric_breaks_exact_match_down_by_depth():
    task = make_task("passkey", num_symbols=16)
    # Wrong exactly when the key sits in the first fifth of the filler (read from the input itself).
    model = _NextToken(task.vocab_size, lambda x: _bucket(passkey_parts(x, 16)[1], len(x) - 5) == 0)
    scores = _evaluate(task, model, eval_len=10)
    for score in scores:
        if score.metric != "exact_match":
            continue
        cells = {cell["bucket"]: cell for cell in score.details["by_depth"]}
        assert sum(cell["examples"] for cell in cells.values()) == 10
        assert cells[0]["value"] == 0.0 and all(cells[b]["value"] == 1.0 for b in cells if b != 0)
        assert cells[0]["depth"] == [0.0, 0.2]
        assert score.value == pytest.approx(1 - cells[0]["examples"] / 10)
        assert score.details["query_accuracy"] == score.value
    assert {s.metric for s in scores} == {"exact_match", "token_accuracy"}


@pytest.mark.parametrize("name", ["mqar", "niah"])
def test_multi_query_metric_scores_each_query(name):
    task = make_task(name, num_symbols=16)
    model = _NextToken(task.vocab_size, lambda x: True)  # the first answer of every example wrong
    scores = {(s.length, s.metric): s for s in _evaluate(task, model, eval_len=5)}
    for length in range(1, 6):
        queries = task.output_length(length)
        exact = scores[(length, "exact_match")]
        assert exact.value == 0.0
        assert exact.details["query_accuracy"] == pytest.approx((queries - 1) / queries)
        assert "by_depth" not in exact.details
        assert scores[(length, "token_accuracy")].value == pytest.approx(queries / (queries + 1))


def test_passkey_run_writes_depths_heat_map_and_report_section(tmp_path):
    config = ExperimentConfig(
        task="passkey",
        encodings=["nope", "rope"],
        train_len=3,
        eval_len=6,
        num_symbols=8,
        eval_examples=5,
        **TINY,
    )
    records = run_experiment(config, tmp_path, workers=1, figures=write_figures)
    exact = [r for r in records if r["metric"] == "exact_match"]
    assert len(exact) == 2 * 6
    for record in exact:
        assert sum(cell["examples"] for cell in record["by_depth"]) == 5
        assert 0.0 <= record["query_accuracy"] <= 1.0
    assert (tmp_path / "depth.png").read_bytes()[:4] == b"\x89PNG"

    from posenc.cli.app import app, load_command_modules
    from posenc.viz.depth import depth_grid
    from posenc.viz.report import render_report

    lengths, bounds, grid = depth_grid(records, "rope")
    assert lengths == list(range(1, 7)) and bounds[0] == (0.0, 0.2) and grid.shape == (5, 6)
    assert 'id="depth"' in render_report(tmp_path)
    load_command_modules()
    result = CliRunner().invoke(
        app, ["plot", "--run", str(tmp_path), "--figure", "depth", "-o", str(tmp_path / "d.png")]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"


def test_copy_runs_write_no_depth_figure(tmp_path):
    config = ExperimentConfig(
        task="copy", encodings=["nope"], train_len=2, eval_len=3, num_symbols=8, eval_examples=2, **TINY
    )
    run_experiment(config, tmp_path, workers=1, figures=write_figures)
    assert not (tmp_path / "depth.png").exists()
    from posenc.cli.app import app, load_command_modules
    from posenc.viz.report import render_report

    assert 'id="depth"' not in render_report(tmp_path)
    load_command_modules()
    result = CliRunner().invoke(
        app,
        ["plot", "--run", str(tmp_path), "--figure", "depth", "-o", str(tmp_path / "d.png")],
    )
    assert result.exit_code != 0 and "by_depth" in result.output


@pytest.mark.parametrize("name", ["mqar", "niah"])
def test_multi_query_runs_end_to_end(name, tmp_path):
    config = ExperimentConfig(
        task=name, encodings=["alibi"], train_len=2, eval_len=4, num_symbols=16, eval_examples=3, **TINY
    )
    records = run_experiment(config, tmp_path, workers=1, figures=write_figures)
    exact = [r for r in records if r["metric"] == "exact_match"]
    assert [r["length"] for r in exact] == [1, 2, 3, 4]
    assert all("query_accuracy" in r and "by_depth" not in r for r in exact)
    assert not (tmp_path / "depth.png").exists()
