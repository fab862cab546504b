"""The study's table (:func:`study_summary`): one row per variant, perplexity per position bucket
inside the context and past it, each needle's exact match per length, the paired verdict first when
the records carry one; and which units a partial folder still misses."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..results.records import wilson_interval
from ..results.summary import SummaryTable

# Imported by name, so _run_unit looks them up here (a test replaces hf_study.greedy_answer).
from ..tasks.longppl import KEY_GAP, KEY_LOSS
from ..tasks.text import (
    position_buckets,
)
from .needles import NEEDLES
from .plan import (
    TASK_PARTS,
    runs_lm,
    unit_id,
)
from .reading import has_verdict
from .sweep import held_out

__all__ = ["study_summary"]


def study_summary(settings: dict[str, Any], records: list[dict[str, Any]]) -> Any:
    """One row per variant: perplexity per position bucket inside the context, at 1.5x and 2x of it
    (``(c, 1.5c]`` and ``(1.5c, 2c]``), then each needle's exact match per length (and over all),
    as ``hits/trials [95% Wilson interval]``."""
    context, eval_len = settings["train_len"], settings["eval_len"]
    verdict = has_verdict(settings, records)
    records, _ = held_out(settings, records)  # with --tuning-windows: the held-out windows' numbers
    names = _bucket_names(settings)
    needles = [part for part in TASK_PARTS[settings["task"]] if part in NEEDLES]
    lengths = settings["lengths"] if needles else []
    columns = ["variant", *names.values()]
    if settings.get("longppl"):
        columns += ["ppl all", "LongPPL (keys)"]
    for needle in needles:
        columns += [*(f"{needle} {n}" for n in lengths), f"{needle} all"]
    rows = [_summary_row(label, records, names, lengths, needles) for label in settings["encodings"]]
    if settings.get("longppl"):
        at = 1 + len(names)
        rows = [
            [*row[:at], *_longppl_cells(label, records), *row[at:]]
            for label, row in zip(settings["encodings"], rows, strict=True)
        ]
    title = (
        f"{Path(settings['hf_model']).name} (context {context}): perplexity by position, "
        f"passkey exact match by length"
    )
    notes = (
        f"ppl <=N: positions (previous bound, N]; 1.5x: ({context}, {3 * context // 2}], 2x: "
        f"({3 * context // 2}, {2 * context}]; from {settings['eval_examples']} window(s) of {eval_len} tokens"
        + _held_out_words(settings)
        + f"; weights and activations in {settings.get('dtype', 'float32')}",
    )
    if settings.get("longppl"):
        short = settings["longppl"]
        notes += (
            f"LongPPL (Fang et al. 2025, the model its own evaluator): perplexity over the key tokens, those "
            f"whose loss with at most {short['trunc'] + short['stride'] - 1} tokens of context (blocks of "
            f"{short['stride']} after {short['trunc']}) exceeds their loss in the whole window by more than "
            f"{KEY_GAP:g} while below {KEY_LOSS:g}; ppl all: every position of the window",
        )
    if needles:
        notes += (
            f"{' and '.join(needles)}: hits/trials at each length (every depth) and over all, with the 95% "
            "Wilson interval of the exact match",
        )
    if verdict:
        notes += (
            "the paired verdict, how far each variant reads and which the tests separate: the table "
            "before this one, and comparisons.jsonl",
        )
    missing = _missing_units(settings, records)
    if missing:
        shown = ", ".join(f"{label} @ {length}" for label, length in missing)
        notes += (
            f"incomplete: {len(missing)} unit(s) have no results yet ({shown}; a shard, or an interrupted "
            "run); passkey all is shown only for a row with every length",
        )
    return SummaryTable(title, columns, rows, notes)


def _held_out_words(settings: dict[str, Any]) -> str:
    """``, the 4 held out (windows [0, 3] tuned the grids)`` with ``--tuning-windows``, else nothing."""
    tuning = settings.get("tuning_windows") or []
    held = settings["eval_examples"] - len(tuning)
    return f", the {held} held out (windows {tuning} tuned the grids)" if tuning else ""


def _bucket_names(settings: dict[str, Any]) -> dict[tuple[int, int], str]:
    """The perplexity columns of :func:`study_summary` by position bucket ``(lo, hi)``: ``ppl <=hi``
    inside the context, ``ppl 1.5x`` and ``ppl 2x`` past it (none for the passkey task)."""
    context, eval_len = settings["train_len"], settings["eval_len"]
    buckets = position_buckets(context, eval_len) if runs_lm(settings["task"]) else []
    inside = [b for b in buckets if b[1] <= context]
    names = {b: f"ppl <={b[1]}" for b in inside}
    for lo, hi in buckets:
        if hi > context:
            ratio = hi / context
            names[(lo, hi)] = f"ppl {ratio:g}x" if ratio in (1.5, 2.0) else f"ppl <={hi}"
    return names


def _summary_row(
    label: str,
    records: list[dict[str, Any]],
    names: dict[tuple[int, int], str],
    lengths: list[int],
    needles: list[str],
) -> list[str]:
    """The row of variant ``label``: its perplexity per bucket of ``names``, then per needle its exact
    match per length of ``lengths`` and over all of them."""
    mine = [r for r in records if r["encoding"] == label]
    ppl = {tuple(r["bucket"]): r for r in mine if r["metric"] == "perplexity"}
    row = [label, *(_ppl_cell(ppl.get(b)) for b in names)]
    for needle in needles:
        task = NEEDLES[needle].task
        keys = {r["length"]: r for r in mine if r["metric"] == "exact_match" and r.get("task", task) == task}
        row += [_needle_cell(keys.get(n)) for n in lengths]
        # Over every length or not at all: a shard's "all" was the mean of the lengths it ran.
        every = all(n in keys for n in lengths)
        hits = sum(r.get("hits", r["value"] * r["examples"]) for r in keys.values())
        count = sum(r["examples"] for r in keys.values())
        total = {"value": hits / count, "examples": count} if count and every else None
        if total is not None and all("hits" in r for r in keys.values()):
            total["hits"] = hits
        row.append(_needle_cell(total))
    return row


def _longppl_cells(label: str, records: list[dict[str, Any]]) -> list[str]:
    """``[ppl all, LongPPL (keys)]`` of row ``label``: the window's perplexity over every position,
    and over its key tokens with their count (``4.21 (37)``; ``-`` without any)."""
    mine = [r for r in records if r["encoding"] == label and r["metric"] == "perplexity" and r.get("tokens")]
    tokens = sum(r["tokens"] for r in mine)
    everything = math.exp(sum(r["nll"] * r["tokens"] for r in mine) / tokens) if tokens else None
    keyed = [r for r in mine if r.get("key_tokens")]
    keys = sum(r["key_tokens"] for r in keyed)
    longppl = math.exp(sum(math.log(r["longppl"]) * r["key_tokens"] for r in keyed) / keys) if keys else None
    return [_fmt(everything, "{:.2f}"), "-" if longppl is None else f"{longppl:.2f} ({keys})"]


def _needle_cell(record: dict[str, Any] | None) -> str:
    """A needle's exact match: ``hits/trials [Wilson 95%]`` (the value alone in a folder from before)."""
    if record is None:
        return "-"
    if "hits" not in record:
        return _fmt(record["value"], "{:.2f}")
    low, high = wilson_interval(record["hits"], record["examples"])
    return f"{record['hits']}/{record['examples']} [{low:.2f}, {high:.2f}]"


def _ppl_cell(record: dict[str, Any] | None) -> str:
    """A bucket's perplexity, with its 95% interval across windows when it has one: ``12.30 [11.90, 12.71]``."""
    if record is None:
        return "-"
    interval = record.get("interval")
    value = _fmt(record["value"], "{:.2f}")
    return value if not interval else f"{value} [{interval[0]:.2f}, {interval[1]:.2f}]"


def _missing_units(settings: dict[str, Any], records: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """The ``(row label, length)`` units of ``settings`` of which ``records`` hold no result."""
    done = {r.get("run") for r in records}
    names = settings.get("variant_names") or {}
    return [
        (label, length)
        for label in settings["encodings"]
        for length in settings["lengths"]
        if unit_id(names.get(label, "none"), length) not in done
    ]


def _fmt(value: float | None, form: str) -> str:
    return "-" if value is None or value != value else form.format(value)
