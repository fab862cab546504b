"""Tidy result records: atomic JSONL, CSV, the summary table and the metric-vs-length figure.

A record is one measurement: ``{"run", "encoding", "task", "seed", "length", "metric", "value",
"train_len", "steps", "examples"}``. ``results.jsonl`` holds one record per line and is always
rewritten whole through a temporary file and ``os.replace``, so a crash leaves either the old or
the new file, never a torn line.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from statistics import mean
from typing import Any

__all__ = [
    "RECORD_FIELDS",
    "SummaryRow",
    "append_records",
    "atomic_write_text",
    "plot_results",
    "read_records",
    "summarize",
    "write_csv",
]

RECORD_FIELDS = (
    "run",
    "encoding",
    "task",
    "seed",
    "length",
    "metric",
    "value",
    "train_len",
    "steps",
    "examples",
)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_records(path: Path) -> list[dict[str, Any]]:
    """All records of ``path`` (an empty list when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def append_records(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Add ``records`` to the JSONL file at ``path`` (rewritten atomically)."""
    lines = [json.dumps(record, sort_keys=False) for record in [*read_records(path), *records]]
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def write_csv(path: Path, records: list[dict[str, Any]]) -> None:
    """The records as a CSV with the columns of :data:`RECORD_FIELDS` (written atomically)."""
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=RECORD_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)
    atomic_write_text(path, buffer.getvalue())


def _curves(records: list[dict[str, Any]], metric: str) -> dict[str, dict[int, list[float]]]:
    """``encoding -> length -> values over seeds`` for one metric."""
    curves: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        if record["metric"] == metric:
            curves[record["encoding"]][int(record["length"])].append(float(record["value"]))
    return curves


class SummaryRow(dict):
    """``encoding``, ``at_train`` (metric at the training length), ``beyond`` (mean over lengths
    above it), ``at_next`` (at L+1), ``at_double`` (at 2L); None where not measured."""


def summarize(
    records: list[dict[str, Any]], metric: str, train_len: int, encodings: list[str]
) -> list[SummaryRow]:
    """One :class:`SummaryRow` per encoding (in ``encodings`` order), averaged over seeds."""
    curves = _curves(records, metric)
    rows = []
    for encoding in encodings:
        by_length = {length: mean(values) for length, values in curves.get(encoding, {}).items()}
        beyond = [value for length, value in by_length.items() if length > train_len]
        rows.append(
            SummaryRow(
                encoding=encoding,
                seeds=max((len(v) for v in curves.get(encoding, {}).values()), default=0),
                at_train=by_length.get(train_len),
                beyond=mean(beyond) if beyond else None,
                at_next=by_length.get(train_len + 1),
                at_double=by_length.get(2 * train_len),
            )
        )
    return rows


def plot_results(
    path: Path, records: list[dict[str, Any]], metric: str, train_len: int, encodings: list[str], title: str
) -> None:
    """Metric against length, one line per encoding (mean over seeds, min-max band), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    curves = _curves(records, metric)
    fig, ax = plt.subplots(figsize=(8.5, 4.5), dpi=120)
    for encoding in encodings:
        points = sorted(curves.get(encoding, {}).items())
        if not points:
            continue
        lengths = [length for length, _ in points]
        ax.plot(lengths, [mean(v) for _, v in points], label=encoding, linewidth=1.6)
        if any(len(v) > 1 for _, v in points):
            ax.fill_between(lengths, [min(v) for _, v in points], [max(v) for _, v in points], alpha=0.15)
    ax.axvline(train_len, color="grey", linestyle="--", linewidth=1)
    ax.text(train_len, ax.get_ylim()[1], " train length", va="top", fontsize=8, color="grey")
    ax.set_xlabel("length" if metric != "perplexity" else "position (context length)")
    ax.set_ylabel(metric.replace("_", " "))
    if metric == "perplexity" and all(v > 0 for c in curves.values() for vs in c.values() for v in vs):
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def format_value(value: float | None, metric: str) -> str:
    """A table cell: accuracy as a percentage, perplexity with two decimals, '-' when missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if metric == "perplexity":
        return f"{value:.2f}"
    return f"{100 * value:.1f}%"
