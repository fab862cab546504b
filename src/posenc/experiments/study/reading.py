"""How far each variant of a context-extension study reads and which variants the paired tests
separate, from its perplexity by position over the windows (:mod:`.hf_study`'s ``text-lm`` records).

Each window gives each position bucket one value, the mean NLL of its tokens there (``window_nll``); a
bucket's perplexity is ``exp`` of the mean of those values over the windows, and its 95% interval is
``exp`` of the Student's t interval of that mean (:func:`posenc.experiments.results.records.seed_interval`).
Every variant scores the same windows, so the verdict rests on paired differences, window by window:

* **reads to** ``N``: the last bucket past the context ``c`` up to which every bucket's paired
  difference from the in-context NLL stays at most ``log(1 +`` :data:`READ_MARGIN` ``)`` at 95% (the
  upper end of the paired t interval over the windows of ``nll_bucket(w) - nll_inside(w)``; the
  difference itself with one window). ``nll_inside(w)`` is window ``w``'s mean NLL over the positions
  ``(c/2, c]`` of the model as trained (the ``none`` row; a variant's own where the study has no such
  row); ``c`` itself when already the first bucket past it does not;
* **ordered**: at each bucket past the context, the variants best first, ``<`` only where the
  Holm-corrected paired t tests separate them and ``≈`` where they cannot tell
  (:func:`posenc.experiments.study.paired.ranked_order`); with one window nothing is tested.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..results.records import seed_interval
from ..results.stats import paired_t
from ..results.summary import SummaryTable
from .paired import ALPHA, perplexity_comparisons, ranked_order, retrieval_comparisons
from .sweep import Choice, decided, unchosen

__all__ = [
    "INTERVAL_KIND",
    "READ_MARGIN",
    "bucket_interval",
    "has_verdict",
    "inside_window_nll",
    "reads_to",
    "reference_perplexity",
    "verdict_notes",
    "verdict_table",
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


def inside_window_nll(records: list[dict[str, Any]], context: int) -> list[float] | None:
    """Each window's mean NLL over the positions ``(c/2, c]`` (token-weighted over the buckets there),
    from one row's records; None when they hold no such bucket or no per-window values."""
    inside = [r for (lo, hi), r in _perplexity(records).items() if lo >= context // 2 and hi <= context]
    if not inside or any(r.get("window_nll") is None for r in inside):
        return None
    windows = {len(r["window_nll"]) for r in inside}
    if len(windows) != 1:
        return None
    tokens = sum(r["tokens"] for r in inside)
    return [sum(r["window_nll"][w] * r["tokens"] for r in inside) / tokens for w in range(windows.pop())]


def _paired_upper(record: dict[str, Any], inside: list[float] | None, reference: float) -> float:
    """The 95% upper end of a bucket's NLL minus the in-context NLL: paired over the windows where both
    have per-window values, the difference of the values otherwise (one window, older records)."""
    values = record.get("window_nll")
    if inside is not None and values is not None and len(values) == len(inside) and len(values) >= 2:
        test = paired_t(values, inside)
        if test.interval is not None:
            return test.interval[1]
    return record["nll"] - math.log(reference)


def reads_to(
    records: list[dict[str, Any]],
    reference: float,
    context: int,
    margin: float = READ_MARGIN,
    inside: list[float] | None = None,
) -> int | None:
    """The last bucket end past ``context`` up to which every bucket's paired difference from the
    in-context NLL (``inside``: per window; ``reference``: its perplexity) stays at most
    ``log(1 + margin)`` at 95%; ``context`` when the first one past it does not; None when the records
    hold no bucket past ``context`` (nothing was read there to judge)."""
    buckets = sorted(_perplexity(records).items())
    if not any(hi > context for (_, hi), _record in buckets):
        return None
    reach = context
    for (_, hi), record in buckets:
        if hi <= context:
            continue
        if not _paired_upper(record, inside, reference) <= math.log1p(margin):
            break
        reach = hi
    return reach


def _reach_note(
    label: str, records: list[dict[str, Any]], trained: list[dict[str, Any]] | None, context: int
) -> str:
    """How far ``label`` reads, or why it cannot be said (no records, no position past the context,
    no in-context perplexity to compare with)."""
    if not _perplexity(records):
        return f"{label}: no perplexity records (not run, or still running)"
    own = trained if trained else records
    reference = reference_perplexity(own, context)
    if not math.isfinite(reference):
        return f"{label}: no in-context perplexity (positions ({context // 2}, {context}]) to compare with"
    reach = reads_to(records, reference, context, inside=inside_window_nll(own, context))
    if reach is None:
        return f"{label}: no position past the context {context} was evaluated (give --eval-len above it)"
    return f"{label} reads to {reach} ({reach / context:g}x)"


def _pair_text(comparison: dict[str, Any], short: bool = False) -> str:
    """``a − b +0.024 NLL [+0.016, +0.032], p_holm 0.023``: one separated pair (``short``: the
    variants by their method's name)."""
    low, high = comparison["interval"]
    a, b = (_short(comparison["a"]), _short(comparison["b"])) if short else (comparison["a"], comparison["b"])
    unit = " NLL" if comparison["metric"] == "nll" else ""
    return (
        f"{a} − {b} {comparison['mean_diff']:+.3f}{unit} [{low:+.3f}, {high:+.3f}], "
        f"p_holm {comparison['p_holm']:.2g}"
    )


def _short(label: str) -> str:
    """``yarn`` of ``smollm2-135m + yarn``; the model's own row keeps its name."""
    return label.split(" + ", 1)[1] if " + " in label else label


def _verdict_row(where: str, family: list[dict[str, Any]], means: dict[str, float], lower: bool) -> list[str]:
    """``[where, the order best first, the separated pairs]`` of one bucket or cell."""
    order = ranked_order({_short(k): v for k, v in means.items()}, [_shortened(c) for c in family], lower)
    if not family:
        return [where, order, "-: one variant, nothing to compare"]
    if all(c["p"] is None for c in family):
        return [where, order, family[0]["note"]]
    apart = [_pair_text(c, short=True) for c in family if c["separated"]]
    return [where, order, "; ".join(apart) if apart else "none: the tests cannot tell any two apart"]


def _shortened(comparison: dict[str, Any]) -> dict[str, Any]:
    return {**comparison, "a": _short(comparison["a"]), "b": _short(comparison["b"])}


def _sweep_notes(
    settings: dict[str, Any],
    choices: list[Choice],
    comparisons: list[dict[str, Any]],
    records: list[dict[str, Any]],
) -> tuple[str, ...]:
    """With ``--tuning-windows``: which windows tuned, each grid's chosen setting with its tuning
    score beside the next, and the recommendation at the longest bucket (held out) with its paired
    difference against the next best."""
    tuning = settings.get("tuning_windows") or []
    if not tuning:
        return ()
    held = settings["eval_examples"] - len(tuning)
    notes = [
        f"sweeps: chosen on the {len(tuning)} tuning window(s) {tuning} (mean NLL past the context); every number "
        f"above and every test on the other {held} held-out window(s)"
    ]
    for choice in choices:
        scores = ", ".join(f"{_short(label)} {score:.4f}" for label, score in choice.scores)
        notes.append(f"{choice.grid}: chose {_short(choice.chosen)} (tuning NLL: {scores})")
    ppl = [c for c in comparisons if c["task"] == "text-lm"]
    if ppl:
        last = max(tuple(c["bucket"]) for c in ppl)
        family = [c for c in ppl if tuple(c["bucket"]) == last]
        means = {
            r["encoding"]: r["nll"]
            for r in records
            if r.get("metric") == "perplexity" and tuple(r["bucket"]) == last
        }
        best, *rest = sorted(means, key=means.get)
        if rest:
            pair = next(c for c in family if {c["a"], c["b"]} == {best, rest[0]})
            sign = 1.0 if pair["a"] == best else -1.0
            low, high = (
                sorted(sign * v for v in pair["interval"]) if pair["interval"] else (math.nan, math.nan)
            )
            verdict = "separated" if pair["separated"] else "the test cannot tell them apart"
            notes.append(
                f"recommended at ({last[0]}, {last[1]}]: {_short(best)} (held-out NLL {means[best]:.4f}); against the next "
                f"best, {_short(rest[0])}: {sign * pair['mean_diff']:+.4f} NLL [{low:+.4f}, {high:+.4f}], "
                f"p_holm {pair['p_holm'] if pair['p_holm'] is None else format(pair['p_holm'], '.2g')}: {verdict}"
            )
    return tuple(notes)


def _ppl_rows(
    context: int, comparisons: list[dict[str, Any]], records: list[dict[str, Any]]
) -> list[list[str]]:
    """The verdict's rows of the perplexity buckets past the context."""
    ppl = [c for c in comparisons if c["task"] == "text-lm"]
    scored = [r for r in records if r.get("metric") == "perplexity"]
    rows = []
    for bucket in sorted({tuple(r["bucket"]) for r in scored if r["bucket"][1] > context}):
        family = [c for c in ppl if tuple(c["bucket"]) == bucket]
        means = {r["encoding"]: r["nll"] for r in scored if tuple(r["bucket"]) == bucket}
        name = f"ppl {bucket[1] / context:g}x ({bucket[0]}, {bucket[1]}]"
        rows.append(_verdict_row(name, family, means, lower=True))
    return rows


def _needle_rows(comparisons: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[list[str]]:
    """The verdict's rows of the retrieval lengths (every depth)."""
    needles = [c for c in comparisons if c["task"] != "text-lm" and c["depth"] == "all"]
    scored = [r for r in records if r.get("metric") == "exact_match"]
    rows = []
    for task, length in sorted({(r["task"], r["length"]) for r in scored}):
        family = [c for c in needles if (c["task"], c["length"]) == (task, length)]
        means = {r["encoding"]: r["value"] for r in scored if (r["task"], r["length"]) == (task, length)}
        rows.append(_verdict_row(f"{task.removeprefix('text-')} {length}", family, means, lower=False))
    return rows


def has_verdict(settings: dict[str, Any], records: list[dict[str, Any]]) -> bool:
    """Whether :func:`verdict_table` has a row: perplexity past the context, or any retrieval."""
    context = settings["train_len"]
    return any(
        (r.get("metric") == "perplexity" and r["bucket"][1] > context) or r.get("metric") == "exact_match"
        for r in records
    )


def verdict_table(settings: dict[str, Any], records: list[dict[str, Any]]) -> SummaryTable | None:
    """The paired verdict, shown before the study's table: one row per perplexity bucket past the
    context and per retrieval length (every depth), the variants best first (``<``/``>`` only where
    the Holm-corrected paired tests separate them, ``≈`` where they cannot tell) and the separated
    pairs with their difference, interval and ``p_holm``; notes on how far each variant reads. None
    when the records hold no perplexity past the context and no retrieval."""
    if not has_verdict(settings, records):
        return None
    records, choices = decided(settings, records)  # held-out windows, chosen settings
    comparisons = perplexity_comparisons(settings, records) + retrieval_comparisons(settings, records)
    context = settings["train_len"]
    rows = _ppl_rows(context, comparisons, records) + _needle_rows(comparisons, records)
    title = f"{Path(str(settings.get('hf_model', 'the model'))).name}: paired verdict (best first)"
    notes = (
        f"ppl: paired t over the windows of each variant's mean NLL in the bucket; retrieval: McNemar's exact "
        f"test on the same prompts (every depth of the length); Holm over the pairs of each row, separated at "
        f"p_holm < {ALPHA:g}; < (>) only where every variant on the left is separated from every one on the "
        "right; the records: comparisons.jsonl",
        *verdict_notes(
            {
                **settings,
                "encodings": [e for e in settings["encodings"] if e not in unchosen(settings, choices)],
            },
            records,
        ),
        *_sweep_notes(settings, choices, comparisons, records),
    )
    return SummaryTable(title, ["where", "best first", "separated (a − b [95%], p_holm)"], rows, notes)


def verdict_notes(settings: dict[str, Any], records: list[dict[str, Any]]) -> tuple[str, ...]:
    """The verdict's notes on how far each variant reads (none without perplexity records)."""
    context, labels = settings["train_len"], list(settings["encodings"])
    mine = {label: [r for r in records if r["encoding"] == label] for label in labels}
    if not any(_perplexity(rows) for rows in mine.values()):
        return ()
    names = settings.get("variant_names") or {}
    trained = next((label for label in labels if names.get(label, "none") == "none"), None)
    shared = mine[trained] if trained is not None and _perplexity(mine[trained]) else None
    reads = [_reach_note(label, mine[label], shared, context) for label in labels]
    windows = settings["eval_examples"]
    notes = [
        f"reads to: the last bucket past the context {context} whose paired difference from the in-context "
        f"NLL (positions ({context // 2}, {context}] of "
        f"{'the model as trained' if shared is not None else 'each variant'}, window by window) stays within "
        f"log(1 + {READ_MARGIN:g}) at 95%: " + "; ".join(reads)
    ]
    if windows < 2:
        notes.append("one window: cannot test, so no variant is ranked against another")
    return tuple(notes)
