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

All randomness comes from the ``torch.Generator`` passed in, so a seed reproduces the data.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "BOS",
    "EOS",
    "IGNORE",
    "PAD",
    "SEP",
    "TASKS",
    "Batch",
    "ByteLM",
    "SequenceTask",
    "Task",
    "default_corpus",
    "make_task",
]

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4
#: Target id that the loss ignores (``F.cross_entropy(ignore_index=IGNORE)``).
IGNORE = -100


@dataclass
class Batch:
    """Model inputs and next-token targets.

    ``inputs [B, T]`` token ids; ``targets [B, T]`` the next token at each position, ``IGNORE``
    where no loss is taken (the prompt ``BOS x`` and padding).
    """

    inputs: Tensor
    targets: Tensor


class Task:
    """A source of batches at a chosen length."""

    name: str = ""
    #: "exact_match" tasks are scored by teacher-forced exact match; "perplexity" by perplexity.
    metric: str = "exact_match"
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

    def check_length(self, length: int) -> None:
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"{self.name}: length must be a positive int, got {length!r}")


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


class Copy(SequenceTask):
    name = "copy"

    def make(self, length, batch, generator):
        x = _symbols(generator, batch, length, self.num_symbols, self.distinct)
        return x, x.clone()


class Reverse(SequenceTask):
    name = "reverse"

    def make(self, length, batch, generator):
        x = _symbols(generator, batch, length, self.num_symbols, self.distinct)
        return x, x.flip(1)


class CountCopy(SequenceTask):
    name = "count_copy"

    def check_length(self, length: int) -> None:
        Task.check_length(self, length)

    def make(self, length, batch, generator):
        symbol = _symbols(generator, batch, 1, self.num_symbols, False)
        x = symbol.expand(batch, length).clone()
        return x, x.clone()


class Sort(SequenceTask):
    name = "sort"

    def make(self, length, batch, generator):
        x = _symbols(generator, batch, length, self.num_symbols, self.distinct)
        return x, x.sort(dim=1).values


class Addition(SequenceTask):
    """``n``-digit addition, digits least significant first; ``y`` has ``n + 1`` digits."""

    name = "addition"

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


class Recall(SequenceTask):
    """Associative recall: ``n`` key-value pairs with distinct keys, then a key; answer its value.

    Keys are the first half of the symbols and values the second half, so ``n <= num_symbols // 2``.
    """

    name = "recall"

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


class ByteLM(Task):
    """Byte-level language model on a text: random windows; the last 10% of the bytes is held out.

    ``length`` is the context length: a training example is ``length + 1`` consecutive bytes.
    Evaluation (:meth:`batch` with ``split="eval"``) draws windows from the held-out part.
    """

    name = "lm"
    metric = "perplexity"
    vocab_size = 256

    def __init__(self, corpus: str | Path | None = None, eval_fraction: float = 0.1) -> None:
        data = default_corpus() if corpus is None else Path(corpus).read_bytes()
        self.corpus = "stdlib:argparse" if corpus is None else str(corpus)
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"lm: eval_fraction must be in (0, 1), got {eval_fraction}")
        data_tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        split = int(len(data_tensor) * (1 - eval_fraction))
        self.train_data, self.eval_data = data_tensor[:split], data_tensor[split:]
        if len(self.eval_data) < 2:
            raise ValueError(f"lm: corpus {self.corpus!r} is too small ({len(data)} bytes)")

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


TASKS: dict[str, type[Task]] = {
    cls.name: cls for cls in (Copy, Reverse, CountCopy, Addition, Sort, Recall, ByteLM)
}


def make_task(name: str, *, num_symbols: int = 32, distinct: bool = False, corpus: str | None = None) -> Task:
    """Build task ``name`` (one of :data:`TASKS`)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
    if name == ByteLM.name:
        return ByteLM(corpus)
    if corpus is not None:
        raise ValueError(f"corpus is only used by the lm task, not {name!r}")
    return TASKS[name](num_symbols=num_symbols, distinct=distinct)
