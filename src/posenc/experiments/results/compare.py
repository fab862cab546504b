"""``posenc compare RUN_DIR A B``: does encoding A beat encoding B beyond the training length?

Paired by seed: for every seed both rows have, the run's score beyond ``L`` (mean over the lengths
``> L`` of the task's metric, as in the summary table) of A minus that of B. The verdict rests on
the mean of these differences and its 95% Student's t interval (a paired t interval:
``mean ± t_{0.975, n-1} · s / √n`` over the ``n`` seeds' differences,
:func:`~posenc.experiments.results.records.seed_interval`): A beats B when the interval lies on A's side
of 0, B beats A when it lies on B's, and "cannot tell" when it contains 0 (or with one seed, where
there is no interval). With three seeds ``t_{0.975, 2} = 4.30``: differences of +1%, +2%, +3% give
[-0.5%, +4.5%], "cannot tell" (a bootstrap of the mean spans about the smallest to the largest
difference there, and would call it). Rows that did not fit their training lengths are not ranked, so they are
not compared either: naming one is an error, as is naming a row the folder does not hold.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from ..tasks.catalog import TASKS, Metric
from .records import INTERVAL_METHOD, experiment_settings, load_config, read_records, seed_interval, summarize

__all__ = ["Comparison", "Ranking", "compare_rows", "paired_comparison", "rank_rows"]


@dataclass(frozen=True)
class Comparison:
    """A paired comparison of rows ``a`` and ``b`` beyond ``train_len``.

    ``scores``: ``{seed: (a's score, b's score)}`` beyond ``L``; ``differences`` (a - b per seed, in
    seed order), their ``mean`` and 95% Student's t ``interval`` (None with one seed).
    """

    task: str
    a: str
    b: str
    metric: Metric
    train_len: int
    eval_len: int
    scores: dict[int, tuple[float, float]]
    mean: float
    interval: tuple[float, float] | None

    @property
    def differences(self) -> list[float]:
        return [a - b for a, b in self.scores.values()]

    @property
    def verdict(self) -> str:
        """``"a"`` (A beats B), ``"b"`` or ``"cannot tell"``."""
        if self.interval is None or self.interval[0] <= 0 <= self.interval[1]:
            return "cannot tell"
        a_higher = self.interval[0] > 0
        return "a" if a_higher == self.metric.higher_is_better else "b"

    def sentence(self) -> str:
        """The verdict in one line: ``"shaw beats t5 (+12.0% [+4.1%, +19.9%])"`` or
        ``"t5 vs alibi: cannot tell (+1.0% [-3.0%, +5.0%])"``; with one seed, ``"(one seed: no
        interval)"``. The numbers are the mean paired difference A - B beyond L and its interval."""
        fmt = self.metric.format
        if self.interval is None:
            numbers = f"{signed(self.mean, fmt)}; one seed: no interval"
        else:
            low, high = (signed(bound, fmt) for bound in self.interval)
            numbers = f"{signed(self.mean, fmt)} [{low}, {high}]"
        if self.verdict == "a":
            return f"{self.a} beats {self.b} ({numbers})"
        if self.verdict == "b":
            return f"{self.b} beats {self.a} ({numbers})"
        return f"{self.a} vs {self.b}: cannot tell ({numbers})"

    def lines(self) -> list[str]:
        """The comparison as text: the setting, one line per seed, the mean difference and the verdict."""
        fmt, seeds = self.metric.format, list(self.scores)
        head = (
            f"{self.task}: {self.a} vs {self.b}, {self.metric.label} beyond L={self.train_len} "
            f"(lengths {self.train_len + 1}..{self.eval_len}), paired by seed "
            f"({len(seeds)} seed{'s' if len(seeds) > 1 else ''}: {', '.join(map(str, seeds))})"
        )
        lines = [head]
        for seed, (a, b) in self.scores.items():
            lines.append(
                f"  seed {seed}: {self.a} {fmt(a)}, {self.b} {fmt(b)}, difference {signed(a - b, fmt)}"
            )
        spread = ""
        if self.interval is not None:
            low, high = (signed(bound, fmt) for bound in self.interval)
            spread = (
                f" [95% interval {low}, {high}: {INTERVAL_METHOD} on the {len(seeds)} paired "
                f"differences, {len(seeds) - 1} degree{'s' if len(seeds) > 2 else ''} of freedom]"
            )
        lines.append(f"mean difference {self.a} - {self.b}: {signed(self.mean, fmt)}{spread}")
        better = "higher" if self.metric.higher_is_better else "lower"
        if self.verdict == "a":
            lines.append(f"{self.a} beats {self.b} beyond L ({better} is better; the interval excludes 0)")
        elif self.verdict == "b":
            lines.append(f"{self.b} beats {self.a} beyond L ({better} is better; the interval excludes 0)")
        elif self.interval is None:
            lines.append("cannot tell: one seed gives no interval; run more seeds (--seeds 0,1,2)")
        else:
            lines.append("cannot tell: the interval contains 0")
        return lines


@dataclass(frozen=True)
class Ranking:
    """The rows of an experiment ranked by their score beyond ``L`` (mean over seeds of each seed's
    mean over the lengths ``> L``, as in the summary table), best first.

    ``rows``: the ranked rows; ``unranked``: ``{row: why}`` for rows that did not fit or have no
    score beyond L; ``neighbours``: :func:`compare_rows` of each row with the next one, the verdict
    ``posenc compare DIR A B`` prints for that pair (``uncompared`` the pairs it refuses, and why)."""

    rows: list[str]
    scores: dict[str, float]
    unranked: dict[str, str]
    neighbours: list[Comparison]
    #: ``{(a, b): why}`` for neighbours that cannot be compared (no seed in common).
    uncompared: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)


def _folder_metric(directory: Path, fit_threshold: float | None) -> tuple[str, Metric, int, float]:
    """``(task, metric, train_len, fit threshold)`` of the experiment in ``directory`` (its config.json)."""
    settings = experiment_settings(load_config(directory))
    task = str(settings.get("task", ""))
    if task not in TASKS or "train_len" not in settings:
        raise ValueError(
            f"{directory / 'config.json'} names no known task and train_len; is it a posenc folder?"
        )
    threshold = float(settings.get("fit_threshold", 0.95)) if fit_threshold is None else fit_threshold
    return task, TASKS[task].metric, int(settings["train_len"]), threshold


def rank_rows(directory: str | Path, fit_threshold: float | None = None) -> Ranking:
    """Rank the rows of the experiment in ``directory`` beyond ``L`` and compare each with the next
    (:func:`compare_rows`, paired by seed). Rows that did not fit are not ranked (nor compared).

    Raises the errors of :func:`compare_rows` for a folder that is not an experiment folder."""
    directory = Path(directory)
    _, metric, train_len, threshold = _folder_metric(directory, fit_threshold)
    records = [r for r in read_records(directory / "results.jsonl") if r["metric"] == metric.name]
    rows = list(dict.fromkeys(r["encoding"] for r in records))
    scores: dict[str, float] = {}
    unranked: dict[str, str] = {}
    for row in summarize(records, metric.name, train_len, rows, threshold if metric.fits else None):
        if row["fit"] is not None and row["fit"] < row["seeds"]:
            unranked[row["encoding"]] = (
                f"did not fit: in-distribution {metric.format(row['iid'])}, {row['fit']}/{row['seeds']} "
                f"seeds reach {metric.format(threshold)}"
            )
        elif row["beyond"] is None:
            unranked[row["encoding"]] = f"no length beyond L={train_len}"
        else:
            scores[row["encoding"]] = row["beyond"]
    ranked = sorted(scores, key=lambda row: -scores[row] if metric.higher_is_better else scores[row])
    neighbours, uncompared = [], {}
    for a, b in itertools.pairwise(ranked):
        try:
            neighbours.append(compare_rows(directory, a, b, threshold))
        except ValueError as err:  # no seed in common (a shard of the grid): said, not hidden
            uncompared[(a, b)] = str(err)
    return Ranking(ranked, scores, unranked, neighbours, uncompared)


def signed(value: float, fmt: Any) -> str:
    text = fmt(value)
    return text if text.startswith("-") else "+" + text


def _beyond_per_seed(
    records: list[dict[str, Any]], row: str, metric: str, train_len: int
) -> dict[int, float]:
    """``{seed: mean of metric over lengths > train_len}`` for row ``row``."""
    by_seed: dict[int, list[float]] = {}
    for record in records:
        if record["encoding"] == row and record["metric"] == metric and record["length"] > train_len:
            by_seed.setdefault(int(record.get("seed", 0)), []).append(float(record["value"]))
    return {seed: mean(values) for seed, values in sorted(by_seed.items())}


def compare_rows(directory: str | Path, a: str, b: str, fit_threshold: float | None = None) -> Comparison:
    """Compare rows ``a`` and ``b`` (encodings, or variants such as ``"rope + yarn"``) of the
    experiment in ``directory``; ``fit_threshold`` defaults to the folder's.

    Raises:
        ValueError: a row the folder does not hold, ``a == b``, a row that did not fit, no seed
            that both rows have, or no length beyond ``L``; each names what is at fault.
        FileNotFoundError: ``directory`` holds no ``results.jsonl``.
    """
    directory = Path(directory)
    if not (directory / "results.jsonl").is_file():
        raise FileNotFoundError(
            f"{directory / 'results.jsonl'} not found: is {directory} an experiment folder?"
        )
    task, metric, train_len, threshold = _folder_metric(directory, fit_threshold)
    if not 0 < threshold <= 1:
        raise ValueError(f"--fit-threshold must be in (0, 1], got {threshold}")
    if a == b:
        raise ValueError(f"compare: A and B are the same row ({a!r}); name two different ones")
    records = [r for r in read_records(directory / "results.jsonl") if r["metric"] == metric.name]
    rows = list(dict.fromkeys(r["encoding"] for r in records))
    missing = [name for name in (a, b) if name not in rows]
    if missing:
        raise ValueError(
            f"compare: {' and '.join(repr(m) for m in missing)} not in {directory} (it has: {', '.join(rows)})"
        )
    _refuse_unfit(records, metric, train_len, [a, b], threshold)
    return paired_comparison(task, records, a, b, train_len, where=str(directory))


def paired_comparison(
    task: str, records: list[dict[str, Any]], a: str, b: str, train_len: int, where: str = "the records"
) -> Comparison:
    """The paired-by-seed comparison of rows ``a`` and ``b`` of ``records`` (one task's records)
    beyond ``train_len``: the test :func:`compare_rows` applies once it has checked the folder and
    the fit. ``ValueError`` when a row has no length beyond L or the rows share no seed."""
    metric = TASKS[task].metric
    records = [r for r in records if r["metric"] == metric.name]
    per_seed = {name: _beyond_per_seed(records, name, metric.name, train_len) for name in (a, b)}
    if not per_seed[a] or not per_seed[b]:
        raise ValueError(f"compare: {where} has no lengths beyond L={train_len} to compare")
    shared = [seed for seed in per_seed[a] if seed in per_seed[b]]
    if not shared:
        raise ValueError(
            f"compare: {a!r} (seeds {sorted(per_seed[a])}) and {b!r} (seeds {sorted(per_seed[b])}) share no seed"
        )
    scores = {seed: (per_seed[a][seed], per_seed[b][seed]) for seed in shared}
    differences = [x - y for x, y in scores.values()]
    return Comparison(
        task=task,
        a=a,
        b=b,
        metric=metric,
        train_len=train_len,
        eval_len=max(int(r["length"]) for r in records),
        scores=scores,
        mean=mean(differences),
        interval=seed_interval(differences),
    )


def _refuse_unfit(
    records: list[dict[str, Any]], metric: Metric, train_len: int, rows: list[str], threshold: float
) -> None:
    """A row some seed of which did not fit is not ranked: ``ValueError`` naming it and its score."""
    if not metric.fits:
        return
    unfit = []
    for row in summarize(records, metric.name, train_len, rows, threshold):
        if row["fit"] is not None and row["fit"] < row["seeds"]:
            unfit.append(
                f"{row['encoding']!r} (in-distribution {metric.format(row['iid'])}, "
                f"{row['fit']}/{row['seeds']} seeds reach {metric.format(threshold)})"
            )
    if unfit:
        raise ValueError(
            f"compare: {' and '.join(unfit)} did not fit the training lengths: rows that did not fit are "
            "not ranked, so not compared (train longer, e.g. --until-fit --steps 8000, or lower --fit-threshold)"
        )
