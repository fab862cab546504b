"""Synthetic sequence tasks and a byte-level language model, generated on the fly.

Every synthetic task is one sequence ``BOS x SEP y EOS`` for a decoder-only model; the loss (and
the exact-match metric) covers the tokens ``y EOS`` only. Token ids: ``PAD=0, BOS=1, SEP=2,
EOS=3``, task symbols from 4. The *length* ``n`` of an example is the task's size parameter:

============  =====================================================  ================================
task          x                                                      y
============  =====================================================  ================================
copy          ``n`` random symbols                                   ``x``
reverse       ``n`` random symbols                                   ``x`` reversed
count_copy    one random symbol repeated ``n`` times                 the same (the model must count)
addition      ``a`` then ``+`` then ``b``, ``n`` digits each,        ``a + b``, ``n + 1`` digits,
              least significant digit first                          least significant digit first
sort          ``n`` random symbols                                   ``x`` sorted by symbol id
recall        ``n`` pairs ``k1 v1 ... kn vn`` (distinct keys), then  ``v`` of the queried key
              one queried key
============  =====================================================  ================================

Symbols are drawn with replacement unless ``distinct=True`` (copy, reverse, sort), which draws
``n`` different symbols and needs ``num_symbols >= n``.

``lm`` is a byte-level language model on any text file (vocabulary 256, the bytes themselves); its
length is the context length and its metric is perplexity per position. The default corpus is the
source of the standard library's ``argparse`` module (:func:`default_corpus`), which exists on
every CPython install, so nothing is downloaded.

The retrieval tasks ``passkey``, ``mqar`` and ``niah`` (several needles) live in
:mod:`posenc.experiments.tasks.retrieval`; every task is registered in :data:`TASKS` by
:func:`register_task`.

All randomness comes from the ``torch.Generator`` passed in, so a seed reproduces the data.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BOS",
    "EOS",
    "EXACT_MATCH",
    "IGNORE",
    "PAD",
    "PERPLEXITY",
    "SEP",
    "TASKS",
    "Batch",
    "ByteLM",
    "Metric",
    "Score",
    "SequenceTask",
    "Task",
    "default_corpus",
    "make_task",
    "mix_seed",
    "register_task",
]

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4
#: Target id that the loss ignores (``F.cross_entropy(ignore_index=IGNORE)``).
IGNORE = -100


@dataclass
class Batch:
    """Model inputs and next-token targets.

    ``inputs [B, T]`` token ids; ``targets [B, T]`` the next token at each position, ``IGNORE``
    where no loss is taken (the prompt ``BOS x`` and padding); ``document_ids [B, T]`` when several
    examples are packed into one row (each example one document, the padding after them another).
    """

    inputs: Tensor
    targets: Tensor
    document_ids: Tensor | None = None


def mix_seed(*numbers: int | str) -> int:
    """A 63-bit seed from integers and labels (stable across processes and Python versions)."""
    digest = hashlib.blake2b(",".join(map(str, numbers)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Score(NamedTuple):
    """One evaluated number: ``value`` of ``metric`` at ``length``; ``details``: extra fields of its
    record (a retrieval task's ``query_accuracy`` and ``by_depth``), or None."""

    length: int
    metric: str
    value: float
    details: dict[str, Any] | None = None


#: ``evaluate(model, task, eval_len=, examples=, batch_size=, seed=, progress=)`` -> scores;
#: ``progress(done, total)`` is called as the evaluation advances.
Evaluator = Callable[..., list[Score]]
#: Draws the positions ``[rows, width]`` of an evaluation batch (randomized positions).
PositionSampler = Callable[[int, int], Tensor]


def _positions(sampler: PositionSampler | None, inputs: Tensor, device: torch.device) -> dict[str, Tensor]:
    """The ``positions=`` keyword for the model: drawn by ``sampler``, or none (0..n-1)."""
    if sampler is None:
        return {}
    return {"positions": sampler(*inputs.shape).to(device)}


@dataclass(frozen=True)
class Metric:
    """How a task is scored, and how its headline number is shown.

    Attributes:
        name: the ``metric`` field of its records (``"exact_match"``, ``"perplexity"``).
        label: the short name in table titles (``"exact match"``, ``"ppl"``).
        length_label: what the length axis of its curve means.
        log_scale: draw the metric on a logarithmic axis (perplexity).
        format: a table cell for one value.
        evaluate: the evaluation loop; it returns every :class:`Score` it measures (the headline
            metric and any companion, such as token accuracy beside exact match).
        fits: whether a run *fits* its training lengths when its in-distribution score reaches the
            experiment's ``fit_threshold`` (a fraction, higher is better: exact match); runs that do
            not fit are never ranked.
        higher_is_better: whether a larger value is better (exact match) or worse (perplexity).
    """

    name: str
    label: str
    length_label: str
    log_scale: bool
    format: Callable[[float], str]
    evaluate: Evaluator
    fits: bool = False
    higher_is_better: bool = True


def teacher_forced_hits(
    model: nn.Module, batch: Batch, device: torch.device, positions: PositionSampler | None
) -> tuple[Tensor, Tensor]:
    """``(hits, scored)`` ``[B, T]`` bool: the teacher-forced argmax equals a scored target, and which
    targets are scored (not :data:`IGNORE`)."""
    predictions = model(batch.inputs.to(device), **_positions(positions, batch.inputs, device))
    scored = batch.targets != IGNORE
    return (predictions.argmax(dim=-1).cpu() == batch.targets) & scored, scored


@torch.no_grad()
def _evaluate_exact_match(
    model: nn.Module,
    task: Task,
    *,
    eval_len: int,
    examples: int,
    batch_size: int,
    seed: int,
    progress: Callable[[int, int], None],
    positions: PositionSampler | None = None,
) -> list[Score]:
    """Teacher-forced exact match (every scored position right) and token accuracy at ``1..eval_len``.

    ``positions``: draws each batch's positions ``[rows, width]`` (randomized positions); None: 0..n-1.
    """
    device = next(model.parameters()).device
    scores = []
    for length in range(1, eval_len + 1):
        generator = torch.Generator().manual_seed(mix_seed(seed, length, "eval"))
        exact = correct = counted = 0.0
        remaining = examples
        while remaining > 0:
            size = min(remaining, batch_size)
            batch = task.batch(length, size, generator)
            hits, scored = teacher_forced_hits(model, batch, device, positions)
            exact += float((hits | ~scored).all(dim=1).sum())
            correct += float(hits.sum())
            counted += float(scored.sum())
            remaining -= size
        scores.append(Score(length, "exact_match", exact / examples))
        scores.append(Score(length, "token_accuracy", correct / counted))
        progress(length, eval_len)
    return scores


@torch.no_grad()
def _evaluate_perplexity(
    model: nn.Module,
    task: Task,
    *,
    eval_len: int,
    examples: int,
    batch_size: int,
    seed: int,
    progress: Callable[[int, int], None],
    positions: PositionSampler | None = None,
) -> list[Score]:
    """Perplexity at each position of ``eval_len``-token windows from the held-out data."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(mix_seed(seed, "lm-eval"))
    total = torch.zeros(eval_len, dtype=torch.float64)
    remaining, done = examples, 0
    while remaining > 0:
        size = min(remaining, batch_size)
        batch = task.batch(eval_len, size, generator)
        logits = model(batch.inputs.to(device), **_positions(positions, batch.inputs, device))
        nll = F.cross_entropy(logits.transpose(1, 2), batch.targets.to(device), reduction="none")  # [B, T]
        total += nll.sum(dim=0).double().cpu()
        remaining -= size
        done += size
        progress(done, examples)
    mean_nll = total / examples
    return [
        Score(position + 1, "perplexity", float(torch.exp(mean_nll[position])))
        for position in range(eval_len)
    ]


#: Sequence tasks: the whole answer right, as a percentage (token accuracy is recorded beside it).
EXACT_MATCH = Metric(
    name="exact_match",
    label="exact match",
    length_label="length",
    log_scale=False,
    format=lambda value: f"{100 * value:.1f}%",
    evaluate=_evaluate_exact_match,
    fits=True,
)
#: Language models: perplexity at each position, two decimals.
PERPLEXITY = Metric(
    name="perplexity",
    label="ppl",
    length_label="position (context length)",
    log_scale=True,
    format=lambda value: f"{value:.2f}",
    evaluate=_evaluate_perplexity,
    higher_is_better=False,
)


#: Every task by name, in the order registered (:func:`register_task`); ``posenc extrapolate --task``.
TASKS: dict[str, type[Task]] = {}


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator: register a :class:`Task` under ``name`` (``posenc extrapolate --task name``).

    The modules of :mod:`posenc.experiments` that define tasks are imported with the package, so
    every built-in task is registered before any is looked up.
    """
    if not name or any(c in name for c in ":,= /") or name != name.lower():
        raise ValueError(f"invalid task name {name!r}: use lower-case letters, digits, '_' or '-'")

    def decorator(cls: type[Task]) -> type[Task]:
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TypeError(f"@register_task({name!r}) needs a Task subclass, got {cls!r}")
        if name in TASKS and TASKS[name] is not cls:
            raise ValueError(f"task name {name!r} is already registered by {TASKS[name].__qualname__}")
        cls.name = name
        TASKS[name] = cls
        return cls

    return decorator


class Task:
    """A source of batches at a chosen length, scored by its :class:`Metric`."""

    #: Set by :func:`register_task`.
    name: str = ""
    metric: Metric = EXACT_MATCH
    vocab_size: int

    def sequence_length(self, length: int) -> int:
        """Model input length ``T`` of an example of size ``length``."""
        raise NotImplementedError

    def batch(self, length: int, batch_size: int, generator: torch.Generator) -> Batch:
        """``batch_size`` examples of size exactly ``length``."""
        raise NotImplementedError

    def train_batch(
        self, min_length: int, max_length: int, batch_size: int, generator: torch.Generator
    ) -> Batch:
        """Examples with sizes uniform in ``[min_length, max_length]``, right-padded (loss ignores padding)."""
        raise NotImplementedError

    def packed_train_batch(
        self, min_length: int, max_length: int, batch_size: int, generator: torch.Generator
    ) -> Batch:
        """Rows of ``sequence_length(max_length)`` tokens, each packed with whole examples (sizes
        uniform in ``[min_length, max_length]``) back to back, with their ``document_ids``."""
        raise ValueError(f"{self.name}: packing several examples per row applies to the synthetic tasks only")

    def check_length(self, length: int) -> None:
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"{self.name}: length must be a positive int, got {length!r}")

    def data_fingerprint(self) -> dict[str, str] | None:
        """What identifies the data a task reads from outside (a file's path and sha256), recorded
        in the experiment folder so that a rerun on other data is refused; None: generated data."""
        return None

    @classmethod
    def from_options(cls, *, num_symbols: int, distinct: bool, corpus: str | None) -> Task:
        """Build the task from the experiment's task options (each task reads those it has)."""
        raise NotImplementedError


def _symbols(generator: torch.Generator, batch: int, length: int, count: int, distinct: bool) -> Tensor:
    """Symbol ids ``[batch, length]`` in ``[FIRST_SYMBOL, FIRST_SYMBOL + count)``."""
    if distinct:
        scores = torch.rand(batch, count, generator=generator)
        return scores.argsort(dim=1)[:, :length] + FIRST_SYMBOL
    return torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + count, (batch, length), generator=generator)


class SequenceTask(Task):
    """A ``BOS x SEP y EOS`` task; subclasses implement :meth:`make` (``x``, ``y`` for one size)."""

    def __init__(self, num_symbols: int = 32, distinct: bool = False) -> None:
        if num_symbols < 2:
            raise ValueError(f"{self.name}: num_symbols must be >= 2, got {num_symbols}")
        self.num_symbols, self.distinct = num_symbols, distinct
        self.vocab_size = FIRST_SYMBOL + num_symbols

    @classmethod
    def from_options(cls, *, num_symbols: int, distinct: bool, corpus: str | None) -> Task:
        if corpus is not None:
            raise ValueError(f"corpus is only used by the lm task, not {cls.name!r}")
        return cls(num_symbols=num_symbols, distinct=distinct)

    def make(self, length: int, batch: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``x [batch, len_x]`` and ``y [batch, len_y]`` for examples of size ``length``."""
        raise NotImplementedError

    def output_length(self, length: int) -> int:
        """``len(y)`` for size ``length``."""
        return length

    def input_length(self, length: int) -> int:
        """``len(x)`` for size ``length``."""
        return length

    def check_length(self, length: int) -> None:
        super().check_length(length)
        if self.distinct and length > self.num_symbols:
            raise ValueError(
                f"{self.name}: distinct symbols need num_symbols >= length; got length {length} > {self.num_symbols}"
            )

    def sequence_length(self, length: int) -> int:
        # BOS x SEP y EOS has len_x + len_y + 3 tokens; inputs drop the last one.
        return self.input_length(length) + self.output_length(length) + 2

    def batch(self, length: int, batch_size: int, generator: torch.Generator) -> Batch:
        self.check_length(length)
        x, y = self.make(length, batch_size, generator)
        column = torch.full((batch_size, 1), 0, dtype=torch.long)
        sequence = torch.cat([column + BOS, x, column + SEP, y, column + EOS], dim=1)
        inputs, targets = sequence[:, :-1], sequence[:, 1:].clone()
        targets[:, : x.shape[1] + 1] = IGNORE  # no loss on x and SEP (predicted from BOS x)
        return Batch(inputs, targets)

    def train_batch(
        self, min_length: int, max_length: int, batch_size: int, generator: torch.Generator
    ) -> Batch:
        if not 1 <= min_length <= max_length:
            raise ValueError(
                f"{self.name}: need 1 <= min_length <= max_length, got {min_length}, {max_length}"
            )
        lengths = torch.randint(min_length, max_length + 1, (batch_size,), generator=generator)
        total = self.sequence_length(max_length)
        inputs = torch.full((batch_size, total), PAD, dtype=torch.long)
        targets = torch.full((batch_size, total), IGNORE, dtype=torch.long)
        for length in sorted(set(lengths.tolist())):
            rows = (lengths == length).nonzero()[:, 0]
            part = self.batch(length, len(rows), generator)
            inputs[rows, : part.inputs.shape[1]] = part.inputs
            targets[rows, : part.targets.shape[1]] = part.targets
        return Batch(inputs, targets)

    def packed_train_batch(
        self, min_length: int, max_length: int, batch_size: int, generator: torch.Generator
    ) -> Batch:
        width = self.sequence_length(max_length)
        inputs = torch.full((batch_size, width), PAD, dtype=torch.long)
        targets = torch.full((batch_size, width), IGNORE, dtype=torch.long)
        documents = torch.zeros(batch_size, width, dtype=torch.long)
        for row in range(batch_size):
            start, doc = 0, 0
            while True:
                length = int(torch.randint(min_length, max_length + 1, (1,), generator=generator))
                size = self.sequence_length(length)
                if start + size > width:
                    break
                example = self.batch(length, 1, generator)
                inputs[row, start : start + size] = example.inputs[0]
                targets[row, start : start + size] = example.targets[0]
                documents[row, start : start + size] = doc
                start, doc = start + size, doc + 1
            documents[row, start:] = doc  # the padding after the last example: a document of its own
        return Batch(inputs, targets, documents)


@register_task("copy")
class Copy(SequenceTask):
    def make(self, length, batch, generator):
        x = _symbols(generator, batch, length, self.num_symbols, self.distinct)
        return x, x.clone()


@register_task("reverse")
class Reverse(SequenceTask):
    def make(self, length, batch, generator):
        x = _symbols(generator, batch, length, self.num_symbols, self.distinct)
        return x, x.flip(1)


@register_task("count_copy")
class CountCopy(SequenceTask):
    def check_length(self, length: int) -> None:
        Task.check_length(self, length)

    def make(self, length, batch, generator):
        symbol = _symbols(generator, batch, 1, self.num_symbols, False)
        x = symbol.expand(batch, length).clone()
        return x, x.clone()


@register_task("addition")
class Addition(SequenceTask):
    """``n``-digit addition, digits least significant first; ``y`` has ``n + 1`` digits."""

    def __init__(self, num_symbols: int = 32, distinct: bool = False) -> None:
        # Digits 0-9 are symbols 0-9 and "+" is symbol 10; num_symbols is fixed by the task.
        super().__init__(num_symbols=11, distinct=False)
        self.plus = FIRST_SYMBOL + 10

    def check_length(self, length: int) -> None:
        Task.check_length(self, length)

    def input_length(self, length: int) -> int:
        return 2 * length + 1

    def output_length(self, length: int) -> int:
        return length + 1

    def make(self, length, batch, generator):
        a = torch.randint(0, 10, (batch, length), generator=generator)
        b = torch.randint(0, 10, (batch, length), generator=generator)
        digits = torch.zeros(batch, length + 1, dtype=torch.long)
        carry = torch.zeros(batch, dtype=torch.long)
        for i in range(length):  # schoolbook addition from the least significant digit
            total = a[:, i] + b[:, i] + carry
            digits[:, i], carry = total % 10, total // 10
        digits[:, length] = carry
        plus = torch.full((batch, 1), self.plus, dtype=torch.long)
        x = torch.cat([a + FIRST_SYMBOL, plus, b + FIRST_SYMBOL], dim=1)
        return x, digits + FIRST_SYMBOL


@register_task("sort")
class Sort(SequenceTask):
    def make(self, length, batch, generator):
        x = _symbols(generator, batch, length, self.num_symbols, self.distinct)
        return x, x.sort(dim=1).values


@register_task("recall")
class Recall(SequenceTask):
    """Associative recall: ``n`` key-value pairs with distinct keys, then a key; answer its value.

    Keys are the first half of the symbols and values the second half, so ``n <= num_symbols // 2``.
    """

    def check_length(self, length: int) -> None:
        Task.check_length(self, length)
        if length > self.num_symbols // 2:
            raise ValueError(
                f"recall: {length} pairs need num_symbols >= {2 * length}, got {self.num_symbols}"
            )

    def input_length(self, length: int) -> int:
        return 2 * length + 1

    def output_length(self, length: int) -> int:
        return 1

    def make(self, length, batch, generator):
        half = self.num_symbols // 2
        keys = torch.rand(batch, half, generator=generator).argsort(dim=1)[:, :length] + FIRST_SYMBOL
        values = torch.randint(
            FIRST_SYMBOL + half, FIRST_SYMBOL + 2 * half, (batch, length), generator=generator
        )
        which = torch.randint(0, length, (batch, 1), generator=generator)
        pairs = torch.stack([keys, values], dim=2).reshape(batch, 2 * length)
        x = torch.cat([pairs, keys.gather(1, which)], dim=1)
        return x, values.gather(1, which)


def default_corpus() -> bytes:
    """The default LM corpus: the source of the standard library's ``argparse`` module (~100 KB)."""
    import argparse

    return inspect.getsource(argparse).encode("utf-8")


def read_corpus(path: Path) -> bytes:
    """The bytes of an LM corpus; ``ValueError`` naming ``--corpus`` when it is missing, not a file
    or empty."""
    if not path.exists():
        raise ValueError(f"--corpus {path} does not exist; give the path of a text file")
    if not path.is_file():
        raise ValueError(f"--corpus {path} is not a file; give the path of a text file")
    data = path.read_bytes()
    if not data:
        raise ValueError(f"--corpus {path} is empty; give a text file with content")
    return data


@register_task("lm")
class ByteLM(Task):
    """Byte-level language model on a text: random windows; the last 10% of the bytes is held out.

    ``length`` is the context length: a training example is ``length + 1`` consecutive bytes.
    Evaluation (:meth:`batch` with ``split="eval"``) draws windows from the held-out part.
    """

    metric = PERPLEXITY
    vocab_size = 256

    def __init__(self, corpus: str | Path | None = None, eval_fraction: float = 0.1) -> None:
        data = default_corpus() if corpus is None else read_corpus(Path(corpus))
        self.corpus = "stdlib:argparse" if corpus is None else str(corpus)
        self.sha256 = hashlib.sha256(data).hexdigest()
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"lm: eval_fraction must be in (0, 1), got {eval_fraction}")
        data_tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        split = int(len(data_tensor) * (1 - eval_fraction))
        self.train_data, self.eval_data = data_tensor[:split], data_tensor[split:]
        if len(self.eval_data) < 2:
            raise ValueError(f"lm: corpus {self.corpus!r} is too small ({len(data)} bytes)")

    def data_fingerprint(self) -> dict[str, str]:
        """The corpus's path and the sha256 of its bytes."""
        return {"corpus": self.corpus, "sha256": self.sha256}

    @classmethod
    def from_options(cls, *, num_symbols: int, distinct: bool, corpus: str | None) -> Task:
        return cls(corpus)  # a byte LM has no symbols: num_symbols and distinct do not apply

    def sequence_length(self, length: int) -> int:
        return length

    def _windows(self, data: Tensor, length: int, batch_size: int, generator: torch.Generator) -> Batch:
        self.check_length(length)
        if length + 1 > len(data):
            raise ValueError(
                f"lm: length {length} needs more than the {len(data)} bytes of this split of {self.corpus!r}"
            )
        starts = torch.randint(0, len(data) - length, (batch_size,), generator=generator)
        windows = data[starts[:, None] + torch.arange(length + 1)]
        return Batch(windows[:, :-1], windows[:, 1:])

    def batch(self, length: int, batch_size: int, generator: torch.Generator, split: str = "eval") -> Batch:
        return self._windows(
            self.eval_data if split == "eval" else self.train_data, length, batch_size, generator
        )

    def train_batch(
        self, min_length: int, max_length: int, batch_size: int, generator: torch.Generator
    ) -> Batch:
        return self._windows(self.train_data, max_length, batch_size, generator)


def make_task(name: str, *, num_symbols: int = 32, distinct: bool = False, corpus: str | None = None) -> Task:
    """Build task ``name`` (one of :data:`TASKS`)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
    return TASKS[name].from_options(num_symbols=num_symbols, distinct=distinct, corpus=corpus)
