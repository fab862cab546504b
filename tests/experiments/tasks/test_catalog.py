"""The task catalog (posenc.experiments.tasks.catalog): each sequence task's format and answers hand-checked
for a small length, seeds, padding and packing, the byte LM's corpus and windows, exact match
teacher-forced at every position."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from posenc.experiments import ExperimentConfig
from posenc.experiments.tasks.catalog import (
    BOS,
    EOS,
    FIRST_SYMBOL,
    IGNORE,
    PAD,
    SEP,
    TASKS,
    default_corpus,
    make_task,
)
from posenc.experiments.train import RunSpec, evaluate


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


# ----------------------------------------------------------------------------
# Synthetic tasks and the byte LM: format ``BOS x SEP y EOS``, answers checked independently.


SEQUENCE_TASKS = [name for name in TASKS if name != "lm"]


def _split(row: torch.Tensor) -> tuple[list[int], list[int]]:
    """``x`` and ``y`` of one full sequence ``BOS x SEP y EOS`` (recovered from inputs + last target)."""
    tokens = row.tolist()
    assert tokens[0] == BOS and tokens[-1] == EOS
    sep = tokens.index(SEP)
    return tokens[1:sep], tokens[sep + 1 : -1]


def _full(batch, i: int) -> torch.Tensor:
    return torch.cat([batch.inputs[i], batch.targets[i, -1:]])


def _digits(symbols: list[int]) -> int:
    return sum((s - FIRST_SYMBOL) * 10**i for i, s in enumerate(symbols))  # least significant first


def _expected(name: str, x: list[int]) -> list[int]:
    if name == "copy" or name == "count_copy":
        return list(x)
    if name == "reverse":
        return x[::-1]
    if name == "sort":
        return sorted(x)
    if name == "addition":
        n = (len(x) - 1) // 2
        total = _digits(x[:n]) + _digits(x[n + 1 :])
        return [FIRST_SYMBOL + (total // 10**i) % 10 for i in range(n + 1)]
    if name == "recall":
        pairs = dict(zip(x[:-1:2], x[1:-1:2]))
        return [pairs[x[-1]]]
    if name in ("passkey", "mqar", "niah"):
        from _retrieval_reference import expected_answer

        return expected_answer(name, x, num_symbols=16)
    raise AssertionError(name)


@pytest.mark.parametrize("name", SEQUENCE_TASKS)
@pytest.mark.parametrize("length", [1, 3, 7])
def test_sequence_task_format_and_answers(name, length):
    task = make_task(name, num_symbols=16)
    batch = task.batch(length, 8, torch.Generator().manual_seed(length))
    assert batch.inputs.shape == (8, task.sequence_length(length)) == batch.targets.shape
    for i in range(8):
        x, y = _split(_full(batch, i))
        assert y == _expected(name, x)
        assert len(x) == task.input_length(length) and len(y) == task.output_length(length)
        # Loss only on y EOS: exactly the targets after SEP.
        scored = (batch.targets[i] != IGNORE).nonzero()[:, 0].tolist()
        assert scored == list(range(len(x) + 1, len(x) + 1 + len(y) + 1))
        assert batch.targets[i, scored[-1]] == EOS
        shifted = batch.inputs[i, 1:]
        assert all(int(batch.targets[i, j]) == int(shifted[j]) for j in scored[:-1]), (
            "targets are the next tokens"
        )


def test_task_specifics():
    g = torch.Generator().manual_seed(0)
    x = make_task("count_copy", num_symbols=16).batch(5, 4, g).inputs[:, 1:6]
    assert bool((x == x[:, :1]).all())
    distinct = make_task("copy", num_symbols=8, distinct=True).batch(8, 16, g).inputs[:, 1:9]
    assert all(len(set(row.tolist())) == 8 for row in distinct)
    recall = make_task("recall", num_symbols=16).batch(8, 16, g).inputs[:, 1:17:2]
    assert all(len(set(row.tolist())) == 8 for row in recall), "recall keys are distinct"
    with pytest.raises(ValueError, match="num_symbols"):
        make_task("copy", num_symbols=8, distinct=True).batch(9, 1, g)
    with pytest.raises(ValueError, match="unknown task"):
        make_task("kopy")


@pytest.mark.parametrize("name", SEQUENCE_TASKS)
def test_same_seed_same_data_and_train_batch_padding(name):
    task = make_task(name, num_symbols=16)
    a = task.train_batch(1, 6, 12, torch.Generator().manual_seed(3))
    b = task.train_batch(1, 6, 12, torch.Generator().manual_seed(3))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert a.inputs.shape[1] == task.sequence_length(6)
    for i in range(12):
        row = a.inputs[i].tolist()
        end = len(row) - row[::-1].index(next(t for t in reversed(row) if t != PAD))  # last real token + 1
        assert all(t == PAD for t in row[end:])
        assert bool((a.targets[i, end:] == IGNORE).all()), "no loss on padding"
        assert int(a.targets[i, end - 1]) == EOS


def test_byte_lm_default_corpus_and_windows():
    import argparse

    assert default_corpus() == inspect.getsource(argparse).encode()
    task = make_task("lm")
    assert task.vocab_size == 256
    batch = task.train_batch(1, 32, 4, torch.Generator().manual_seed(0))
    assert batch.inputs.shape == (4, 32)
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    held_out = bytes(task.eval_data.tolist())
    window = task.batch(16, 2, torch.Generator().manual_seed(1))
    assert bytes(window.inputs[0].tolist()) in held_out


def test_byte_lm_reads_a_text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(b"abcdefghij" * 20)
    task = make_task("lm", corpus=str(path))
    assert bytes(task.train_data[:10].tolist()) == b"abcdefghij"
    with pytest.raises(ValueError, match="lm"):
        task.batch(100, 1, torch.Generator())


def test_packed_rows_hold_whole_examples_with_their_document_ids():
    from posenc.experiments.tasks.catalog import BOS, EOS, make_task

    task = make_task("copy", num_symbols=8)
    gen = torch.Generator().manual_seed(3)
    batch = task.packed_train_batch(1, 4, 6, gen)
    width = task.sequence_length(4)
    assert batch.inputs.shape == batch.targets.shape == batch.document_ids.shape == (6, width)
    for row in range(6):
        docs = batch.document_ids[row]
        assert bool((docs[1:] >= docs[:-1]).all())
        examples = 0
        for doc in docs.unique().tolist():
            span = (docs == doc).nonzero()[:, 0]
            inputs, targets = batch.inputs[row, span], batch.targets[row, span]
            if inputs[0] != BOS:  # the padding after the last example
                assert doc == docs.max() and bool((targets == -100).all())
                continue
            examples += 1
            assert targets[-1] == EOS  # an example ends its own document
            length = (len(span) - 2) // 2  # BOS x SEP y: x and y have the same length in copy
            assert torch.equal(inputs[1 : 1 + length], targets[length + 1 : 2 * length + 1])
        assert examples >= 1


def test_packing_is_refused_for_the_byte_lm():
    from posenc.experiments.tasks.catalog import make_task

    with pytest.raises(ValueError, match="packing several examples per row applies to the synthetic tasks"):
        make_task("lm").packed_train_batch(4, 8, 2, torch.Generator())
