"""How far each variant of a context-extension study reads, from its perplexity by position over
``--eval-examples`` windows (:mod:`.hf_study`'s ``text-lm`` records).

Each window gives each position bucket one value, the mean NLL of its tokens there; a bucket's
perplexity is ``exp`` of the mean of those values over the windows, and its 95% interval is ``exp``
of the Student's t interval of that mean (:func:`posenc.experiments.results.records.seed_interval`,
``mean ± t_{0.975, n-1} · s / √n`` over the ``n`` windows; ``exp`` is monotone, so the interval
keeps its coverage). One window has no interval.

The verdict:

* **reads to** ``N``: the last bucket past the context ``c`` up to which every bucket's interval
  (its value, with one window) stays at most :data:`READ_MARGIN` above the in-context perplexity,
  ``exp`` of the mean NLL over the positions ``(c/2, c]`` of the model as trained (the ``none`` row;
  a variant's own where the study has no such row); ``c`` itself when already the first bucket past
  it does not;
* **cannot be ranked**: at the longest bucket, variants whose intervals overlap, joined by ``≈``
  (ordered by perplexity, best first; ``<`` where the intervals are apart).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..results.records import seed_interval

__all__ = [
    "INTERVAL_KIND",
    "READ_MARGIN",
    "bucket_interval",
    "rank_groups",
    "reads_to",
    "reference_perplexity",
    "verdict_notes",
]

#: How far above the in-context perplexity a bucket's interval may reach and still count as read.
READ_MARGIN = 0.10
#: How the bucket intervals are made, as the records and the table's notes say it.
INTERVAL_KIND = "95% Student's t interval of the mean log-perplexity across windows, exponentiated"


def bucket_interval(window_nll: Sequence[float]) -> tuple[float, float] | None:
    """The 95% interval of a bucket's perplexity from its per-window mean NLLs (None for one window)."""
    interval = seed_interval(list(window_nll))
    return None if interval is None else (math.exp(interval[0]), math.exp(interval[1]))


def _perplexity(records: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    return {tuple(r["bucket"]): r for r in records if r.get("metric") == "perplexity"}


def reference_perplexity(records: list[dict[str, Any]], context: int) -> float:
    """``exp`` of the token-weighted mean NLL of the buckets inside ``(c/2, c]`` of one row's records."""
    inside = [r for (lo, hi), r in _perplexity(records).items() if lo >= context // 2 and hi <= context]
    tokens = sum(r["tokens"] for r in inside)
    if not tokens:
        return math.nan
    return math.exp(sum(r["nll"] * r["tokens"] for r in inside) / tokens)


def reads_to(
    records: list[dict[str, Any]], reference: float, context: int, margin: float = READ_MARGIN
) -> int | None:
    """The last bucket end past ``context`` up to which every bucket's upper bound (its value with one
    window) is at most ``(1 + margin) · reference``; ``context`` when the first one past it is not;
    None when the records hold no bucket past ``context`` (nothing was read there to judge)."""
    buckets = sorted(_perplexity(records).items())
    if not any(hi > context for (_, hi), _record in buckets):
        return None
    reach = context
    for (_, hi), record in buckets:
        if hi <= context:
            continue
        upper = record["interval"][1] if record.get("interval") else record["value"]
        if not upper <= (1 + margin) * reference:
            break
        reach = hi
    return reach


def rank_groups(rows: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Variants at one bucket (label -> record), best first, in groups whose intervals overlap in a
    chain: one group cannot be ranked within itself. A record without an interval is its own group."""
    ordered = sorted(rows, key=lambda label: rows[label]["value"])
    groups: list[list[str]] = []
    for label in ordered:
        interval = rows[label].get("interval")
        previous = rows[groups[-1][-1]].get("interval") if groups else None
        if groups and interval and previous and interval[0] <= previous[1]:
            groups[-1].append(label)
        else:
            groups.append([label])
    return groups


def _reach_note(label: str, records: list[dict[str, Any]], shared: float | None, context: int) -> str:
    """How far ``label`` reads, or why it cannot be said (no records, no position past the context,
    no in-context perplexity to compare with)."""
    if not _perplexity(records):
        return f"{label}: no perplexity records (not run, or still running)"
    reference = shared if shared is not None else reference_perplexity(records, context)
    if not math.isfinite(reference):
        return f"{label}: no in-context perplexity (positions ({context // 2}, {context}]) to compare with"
    reach = reads_to(records, reference, context)
    if reach is None:
        return f"{label}: no position past the context {context} was evaluated (give --eval-len above it)"
    return f"{label} reads to {reach} ({reach / context:g}x)"


def verdict_notes(settings: dict[str, Any], records: list[dict[str, Any]]) -> tuple[str, ...]:
    """The table's notes on how far each variant reads and which cannot be ranked (none without
    perplexity records)."""
    context, labels = settings["train_len"], list(settings["encodings"])
    mine = {label: [r for r in records if r["encoding"] == label] for label in labels}
    if not any(_perplexity(rows) for rows in mine.values()):
        return ()
    names = settings.get("variant_names") or {}
    trained = next((label for label in labels if names.get(label, "none") == "none"), None)
    shared = reference_perplexity(mine[trained], context) if trained is not None else None
    reads = [_reach_note(label, mine[label], shared, context) for label in labels]
    windows = settings["eval_examples"]
    notes = [
        f"reads to: the last bucket past the context {context} whose interval stays within "
        f"{READ_MARGIN:.0%} above the in-context perplexity (positions ({context // 2}, {context}] of "
        f"{'the model as trained' if shared is not None else 'each variant'}): " + "; ".join(reads)
    ]
    last = {
        label: _perplexity(rows)[max(_perplexity(rows))] for label, rows in mine.items() if _perplexity(rows)
    }
    if windows < 2:
        notes.append("one window: no intervals, so no variant is ranked against another")
    else:
        bucket = max(max(_perplexity(rows)) for rows in mine.values() if _perplexity(rows))
        order = " < ".join(" ≈ ".join(group) for group in rank_groups(last))
        notes.append(
            f"[lo, hi]: {INTERVAL_KIND} ({windows} windows); at positions {tuple(bucket)}, best first, "
            f"≈ joins variants whose intervals overlap (cannot be ranked): {order}"
        )
    return tuple(notes)
