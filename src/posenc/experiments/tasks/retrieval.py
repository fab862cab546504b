"""Retrieval tasks: a passkey in filler, multi-query associative recall, several needles in a haystack.

Length generalization of current models is judged by retrieval at long range. These tasks are
symbol-level, generated from the ``torch.Generator`` passed in (no downloads), and keep the format
of every sequence task (:mod:`posenc.experiments.tasks.catalog`): one sequence ``BOS x SEP y EOS``, loss and
exact match on ``y EOS``. Symbols are split into disjoint alphabets so an answer is never ambiguous:
a marker ``MARK`` (the first symbol), answer symbols (keys and values) and filler.

=======  ===========================================================  =================================
task     x (``n`` = the length)                                      y
=======  ===========================================================  =================================
passkey  ``n`` filler symbols with ``MARK k1..km`` inserted after     the key ``k1..km``
         ``d`` of them (the depth ``d/n``), then ``MARK`` (the
         question)
mqar     ``n`` pairs ``k1 v1 ... kn vn`` (distinct keys), then        the values of the queried keys,
         ``q = min(n, queries)`` of the keys in random order           in query order
niah     ``n`` filler symbols with ``needles`` needles ``MARK k v``   the values of the queried keys,
         (distinct keys) each at its own random depth, then            in query order
         ``MARK`` and ``q = min(needles, queries)`` of their keys
=======  ===========================================================  =================================

``mqar`` follows Zoology's multi-query associative recall (Arora et al. 2023) and ``niah`` RULER's
multi-key, multi-query needle in a haystack (Hsieh et al. 2024), both at symbol level. Zoology
interleaves each query with its answer and scores only the answers; here the queries come together
before ``SEP`` and the answers follow in the same order (RULER's multi-query form), so the format and
the scoring stay those of the other tasks. The number of queries is fixed (not growing with ``n``),
so each answer sits a constant ``q + 1`` tokens after its query at every length and only the
distance to the pair grows.

Scoring (:data:`RETRIEVAL_EXACT_MATCH`): ``exact_match`` (every answer and ``EOS`` right) and
``token_accuracy`` per length like the other tasks; the ``exact_match`` record also carries
``query_accuracy`` (the fraction of answers right: for mqar and niah each answer is one symbol) and,
for passkey, ``by_depth``: per depth bucket, the fraction of keys retrieved whole (the answer
without ``EOS``) and the bucket's example count. Passkey evaluation is stratified: at each
length the examples are spread evenly over :data:`DEPTH_BUCKETS` depth buckets, and within its bucket
an example's depth is uniform over the integer depths the bucket holds at that length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .catalog import (
    BOS,
    EOS,
    EXACT_MATCH,
    FIRST_SYMBOL,
    IGNORE,
    SEP,
    Batch,
    Metric,
    PositionSampler,
    Score,
    SequenceTask,
    Task,
    mix_seed,
    register_task,
    teacher_forced_hits,
)

__all__ = [
    "DEPTH_BUCKETS",
    "MQAR",
    "RETRIEVAL_EXACT_MATCH",
    "MultiNeedle",
    "Passkey",
    "RetrievalTask",
    "depth_bucket",
    "depth_bucket_bounds",
]

#: Passkey depth buckets: bucket ``b`` holds depths ``d/n`` in ``[b/5, (b+1)/5)`` (the last one
#: includes 1.0, the key right before the question).
DEPTH_BUCKETS = 5


def depth_bucket(depth: int, length: int, buckets: int = DEPTH_BUCKETS) -> int:
    """The bucket of a needle after ``depth`` of ``length`` filler symbols (depth fraction ``depth/length``)."""
    return min(depth * buckets // length, buckets - 1)


def depth_bucket_bounds(bucket: int, buckets: int = DEPTH_BUCKETS) -> tuple[float, float]:
    """``(low, high)`` depth fractions of ``bucket``."""
    return bucket / buckets, (bucket + 1) / buckets


def _split_alphabet(num_symbols: int, name: str) -> tuple[int, int, int]:
    """``(mark, first answer symbol, answer symbols)``: the marker, then answers, then filler (the rest)."""
    if num_symbols < 3:
        raise ValueError(f"{name}: num_symbols must be >= 3 (marker, answers, filler), got {num_symbols}")
    answers = (num_symbols - 1) - (num_symbols - 1) // 2
    return FIRST_SYMBOL, FIRST_SYMBOL + 1, answers


@torch.no_grad()
def _evaluate_retrieval(
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
    """Teacher-forced exact match and token accuracy at ``1..eval_len``, like the other sequence tasks;
    the exact-match score also carries ``query_accuracy`` and, for tasks with depths, ``by_depth``."""
    if not hasattr(task, "eval_batch"):
        raise TypeError(f"the retrieval metric scores retrieval tasks, not {type(task).__name__}")
    device = next(model.parameters()).device
    scores = []
    for length in range(1, eval_len + 1):
        generator = torch.Generator().manual_seed(mix_seed(seed, length, "eval"))
        queries = task.queries(length)
        answer_len = task.output_length(length) // queries
        exact = correct = counted = answered = 0.0
        by_depth: dict[int, list[float]] = {}
        done = 0
        while done < examples:
            size = min(examples - done, batch_size)
            batch, depths = task.eval_batch(length, size, generator, first=done)
            hits, scored = teacher_forced_hits(model, batch, device, positions)
            exact += float((hits | ~scored).all(dim=1).sum())
            correct += float(hits.sum())
            counted += float(scored.sum())
            start = task.input_length(length) + 1  # the target index of y's first symbol
            answers = (
                hits[:, start : start + queries * answer_len].reshape(size, queries, answer_len).all(dim=2)
            )
            answered += float(answers.sum())
            if depths is not None:
                for right, depth in zip(answers[:, 0].tolist(), depths.tolist()):
                    cell = by_depth.setdefault(
                        depth_bucket(depth, length, task.depth_buckets or 1), [0.0, 0.0]
                    )
                    cell[0] += float(right)
                    cell[1] += 1.0
            done += size
        details: dict[str, Any] = {"query_accuracy": answered / (examples * queries)}
        if by_depth:
            details["by_depth"] = [
                {
                    "bucket": bucket,
                    "depth": list(depth_bucket_bounds(bucket, task.depth_buckets or 1)),
                    "value": hits_and_count[0] / hits_and_count[1],
                    "examples": int(hits_and_count[1]),
                }
                for bucket, hits_and_count in sorted(by_depth.items())
            ]
        scores.append(Score(length, "exact_match", exact / examples, details))
        scores.append(Score(length, "token_accuracy", correct / counted))
        progress(length, eval_len)
    return scores


#: Exact match of retrieval tasks: the record of every length also carries ``query_accuracy`` and,
#: for passkey, ``by_depth`` (keys retrieved whole per depth bucket, with each bucket's example count).
RETRIEVAL_EXACT_MATCH = Metric(
    name=EXACT_MATCH.name,
    label=EXACT_MATCH.label,
    length_label=EXACT_MATCH.length_label,
    log_scale=False,
    format=EXACT_MATCH.format,
    evaluate=_evaluate_retrieval,
    fits=True,
)


class RetrievalTask(SequenceTask):
    """A sequence task whose answers are retrieved from the input; scored by
    :data:`RETRIEVAL_EXACT_MATCH` (exact match with per-query accuracy and, where the task defines
    depths, accuracy per depth bucket)."""

    metric = RETRIEVAL_EXACT_MATCH
    #: Depth buckets the evaluation is stratified over (None: the task has no single depth).
    depth_buckets: int | None = None

    def __init__(self, num_symbols: int = 32, distinct: bool = False) -> None:
        super().__init__(num_symbols=num_symbols, distinct=False)  # retrieval alphabets are fixed

    def queries(self, length: int) -> int:
        """Number of answers in ``y`` (each ``output_length // queries`` symbols long)."""
        return 1

    def make_with_depths(
        self, length: int, batch: int, generator: torch.Generator, strata: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``x``, ``y`` and the needle depth of each example (``[batch]`` ints in ``0..length``, or
        None). ``strata [batch]``: the depth bucket each example's depth is drawn from."""
        raise NotImplementedError

    def make(self, length, batch, generator):
        x, y, _ = self.make_with_depths(length, batch, generator)
        return x, y

    def eval_batch(
        self, length: int, batch_size: int, generator: torch.Generator, first: int = 0
    ) -> tuple[Batch, Tensor | None]:
        """An evaluation batch and its depths; examples ``first, first + 1, ...`` of a length go to depth
        buckets in turn (over the buckets that hold a depth at this length), so any run of
        ``DEPTH_BUCKETS`` consecutive examples covers them evenly."""
        self.check_length(length)
        strata = None
        if self.depth_buckets is not None:
            held = sorted({depth_bucket(d, length, self.depth_buckets) for d in range(length + 1)})
            order = torch.arange(first, first + batch_size) % len(held)
            strata = torch.tensor(held)[order]
        x, y, depths = self.make_with_depths(length, batch_size, generator, strata)
        return _assemble(x, y), depths


def _assemble(x: Tensor, y: Tensor) -> Batch:
    """``BOS x SEP y EOS`` inputs and targets (loss on ``y EOS``), as :meth:`SequenceTask.batch` builds."""
    column = torch.zeros(x.shape[0], 1, dtype=torch.long)
    sequence = torch.cat([column + BOS, x, column + SEP, y, column + EOS], dim=1)
    inputs, targets = sequence[:, :-1], sequence[:, 1:].clone()
    targets[:, : x.shape[1] + 1] = IGNORE
    return Batch(inputs, targets)


def _draw_depths(
    length: int, batch: int, generator: torch.Generator, strata: Tensor | None, buckets: int
) -> Tensor:
    """Depths in ``0..length``: uniform, or uniform within each example's bucket ``strata[i]``."""
    if strata is None:
        return torch.randint(0, length + 1, (batch,), generator=generator)
    depths = torch.arange(length + 1)
    bucket_of = torch.tensor([depth_bucket(int(d), length, buckets) for d in depths])
    drawn = torch.empty(batch, dtype=torch.long)
    for bucket in strata.unique().tolist():
        rows = (strata == bucket).nonzero()[:, 0]
        choices = depths[bucket_of == bucket]
        if len(choices) == 0:
            raise ValueError(f"depth bucket {bucket} holds no depth at length {length}")
        drawn[rows] = choices[torch.randint(0, len(choices), (len(rows),), generator=generator)]
    return drawn


@register_task("passkey")
class Passkey(RetrievalTask):
    """A key of ``key_length`` answer symbols hidden at a random depth in ``n`` filler symbols."""

    depth_buckets = DEPTH_BUCKETS

    def __init__(self, num_symbols: int = 32, distinct: bool = False, key_length: int = 3) -> None:
        super().__init__(num_symbols=num_symbols)
        if key_length < 1:
            raise ValueError(f"passkey: key_length must be >= 1, got {key_length}")
        self.key_length = key_length
        self.mark, self.first_answer, self.answers = _split_alphabet(num_symbols, self.name)
        self.first_filler = self.first_answer + self.answers
        self.fillers = FIRST_SYMBOL + num_symbols - self.first_filler

    def input_length(self, length: int) -> int:
        return length + self.key_length + 2

    def output_length(self, length: int) -> int:
        return self.key_length

    def make_with_depths(self, length, batch, generator, strata=None):
        filler = torch.randint(
            self.first_filler, self.first_filler + self.fillers, (batch, length), generator=generator
        )
        key = torch.randint(
            self.first_answer, self.first_answer + self.answers, (batch, self.key_length), generator=generator
        )
        depths = _draw_depths(length, batch, generator, strata, self.depth_buckets or 1)
        mark = torch.full((batch, 1), self.mark, dtype=torch.long)
        rows = [
            torch.cat([filler[i, :d], mark[i], key[i], filler[i, d:], mark[i]])
            for i, d in enumerate(depths.tolist())
        ]
        return torch.stack(rows), key.clone(), depths


@register_task("mqar")
class MQAR(RetrievalTask):
    """Multi-query associative recall: ``n`` pairs, then ``min(n, queries)`` distinct queried keys.

    Keys are the first half of the symbols and values the second half (as in ``recall``), so
    ``n <= num_symbols // 2``.
    """

    def __init__(self, num_symbols: int = 32, distinct: bool = False, queries: int = 4) -> None:
        super().__init__(num_symbols=num_symbols)
        if queries < 1:
            raise ValueError(f"mqar: queries must be >= 1, got {queries}")
        self.max_queries = queries

    def check_length(self, length: int) -> None:
        Task.check_length(self, length)
        if length > self.num_symbols // 2:
            raise ValueError(
                f"mqar: {length} pairs need num_symbols >= {2 * length} (distinct keys), got {self.num_symbols}"
            )

    def queries(self, length: int) -> int:
        return min(length, self.max_queries)

    def input_length(self, length: int) -> int:
        return 2 * length + self.queries(length)

    def output_length(self, length: int) -> int:
        return self.queries(length)

    def make_with_depths(self, length, batch, generator, strata=None):
        half = self.num_symbols // 2
        keys = torch.rand(batch, half, generator=generator).argsort(dim=1)[:, :length] + FIRST_SYMBOL
        values = torch.randint(
            FIRST_SYMBOL + half, FIRST_SYMBOL + 2 * half, (batch, length), generator=generator
        )
        asked = torch.rand(batch, length, generator=generator).argsort(dim=1)[:, : self.queries(length)]
        pairs = torch.stack([keys, values], dim=2).reshape(batch, 2 * length)
        return torch.cat([pairs, keys.gather(1, asked)], dim=1), values.gather(1, asked), None


@register_task("niah")
class MultiNeedle(RetrievalTask):
    """Several needles ``MARK key value`` (distinct keys) at random depths in ``n`` filler symbols;
    ``min(needles, queries)`` of them are asked for after a final ``MARK``."""

    def __init__(
        self, num_symbols: int = 32, distinct: bool = False, needles: int = 4, queries: int = 2
    ) -> None:
        super().__init__(num_symbols=num_symbols)
        self.mark, self.first_answer, self.answers = _split_alphabet(num_symbols, self.name)
        self.first_filler = self.first_answer + self.answers
        self.fillers = FIRST_SYMBOL + num_symbols - self.first_filler
        if not 1 <= needles <= self.answers:
            raise ValueError(
                f"niah: needles must be in 1..{self.answers} (distinct keys from {self.answers} answer "
                f"symbols with num_symbols={num_symbols}), got {needles}; raise num_symbols"
            )
        if queries < 1:
            raise ValueError(f"niah: queries must be >= 1, got {queries}")
        self.needles, self.max_queries = needles, queries

    def queries(self, length: int) -> int:
        return min(self.needles, self.max_queries)

    def input_length(self, length: int) -> int:
        return length + 3 * self.needles + 1 + self.queries(length)

    def output_length(self, length: int) -> int:
        return self.queries(length)

    def make_with_depths(self, length, batch, generator, strata=None):
        k, q = self.needles, self.queries(length)
        filler = torch.randint(
            self.first_filler, self.first_filler + self.fillers, (batch, length), generator=generator
        )
        keys = torch.rand(batch, self.answers, generator=generator).argsort(dim=1)[:, :k] + self.first_answer
        values = torch.randint(
            self.first_answer, self.first_answer + self.answers, (batch, k), generator=generator
        )
        depths = torch.randint(0, length + 1, (batch, k), generator=generator).sort(dim=1).values
        asked = torch.rand(batch, k, generator=generator).argsort(dim=1)[:, :q]
        rows = []
        for i in range(batch):
            pieces, start = [], 0
            for j, depth in enumerate(depths[i].tolist()):
                pieces += [
                    filler[i, start:depth],
                    torch.tensor([self.mark, int(keys[i, j]), int(values[i, j])]),
                ]
                start = depth
            pieces += [filler[i, start:], torch.tensor([self.mark]), keys[i, asked[i]]]
            rows.append(torch.cat(pieces))
        return torch.stack(rows), values.gather(1, asked), None
