"""Sweeps that do not over-claim: a grid of a variant's settings, chosen on tuning windows and
reported on held-out ones.

A grid is an ``--eval-variants`` item with ``|`` between the values of an option
(``self_extend:group_size=2|4|8,neighbor_window=512|1024``: six settings, every combination) or of
a scaling's factor (``yarn:2|3|4``). Each setting is a variant of its own (a row, its own units).

``--tuning-windows K`` splits the study's ``--eval-examples N`` perplexity windows before any score:
``K`` of them, drawn with the study's seed (:func:`split_windows`), tune; the other ``N - K`` are
held out. A grid needs the split (picking the best setting on the windows it is then scored on
over-claims), and the split needs at least 2 held-out windows for a paired test.

The choice (:func:`chosen_settings`) reads the tuning windows only: per grid, the setting whose mean
NLL over the positions past the context (every bucket ``(lo, hi]`` with ``hi > c``, token-weighted)
is lowest. Every number the verdict reports and every paired test then reads the held-out windows
only (:func:`held_out`), with the grid's other settings left out of the comparisons. The needle
prompts are not split: a grid's settings are chosen on perplexity, and their retrieval is reported
as it is.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..results.records import seed_interval

__all__ = [
    "Choice",
    "chosen_settings",
    "decided",
    "expand_grid",
    "held_out",
    "is_grid",
    "split_windows",
    "unchosen",
]


def is_grid(item: str) -> bool:
    """Whether ``item`` is a grid of settings (``|`` in its options)."""
    return "|" in item


def expand_grid(item: str) -> list[str]:
    """The settings of a grid item, every combination in the order written:
    ``self_extend:group_size=2|4,neighbor_window=8`` -> ``self_extend:group_size=2,neighbor_window=8``,
    ``self_extend:group_size=4,neighbor_window=8``; ``yarn:2|4`` -> ``yarn:2``, ``yarn:4``. An item
    without ``|`` is its own one setting. ``ValueError`` names ``--eval-variants``, the item and the
    option with an empty value."""
    name, sep, rest = item.partition(":")
    if not sep or "|" not in rest:
        return [item]
    parts = [p.strip() for p in rest.split(",")]
    choices = []
    for part in parts:
        key, eq, text = part.rpartition("=") if "=" in part else ("", "", part)
        values = [v.strip() for v in text.split("|")]
        if not all(values):
            where = f"{key}'s grid" if key else "the grid"
            raise ValueError(
                f"--eval-variants {item!r}: {where} has an empty setting ({text!r}); give values between the |"
            )
        choices.append([f"{key}{eq}{v}" for v in values])
    return [f"{name}:{','.join(combo)}" for combo in itertools.product(*choices)]


def split_windows(windows: int, tuning: int, seed: int) -> list[int]:
    """The indices of the ``tuning`` windows among ``windows``, drawn with ``seed`` (sorted); fixed
    before any score, so the choice cannot lean on the held-out windows. ``ValueError`` names
    ``--tuning-windows`` when fewer than 2 windows would be held out."""
    if tuning < 0:
        raise ValueError(f"--tuning-windows must be >= 0, got {tuning}")
    if tuning and windows - tuning < 2:
        raise ValueError(
            f"--tuning-windows {tuning} of --eval-examples {windows} leaves {windows - tuning} held-out "
            "window(s); a paired test needs 2: give more --eval-examples or fewer --tuning-windows"
        )
    return sorted(random.Random(f"tuning-{seed}-{windows}").sample(range(windows), tuning))


@dataclass(frozen=True)
class Choice:
    """One grid's choice: the chosen row, and every setting's tuning score (mean NLL past the
    context on the tuning windows), best first."""

    grid: str
    chosen: str
    scores: tuple[tuple[str, float], ...]


def _past_context_nll(
    records: list[dict[str, Any]], label: str, windows: Sequence[int], context: int
) -> float:
    """Row ``label``'s token-weighted mean NLL over the buckets past ``context``, on ``windows`` only."""
    total = weight = 0.0
    for r in records:
        if r["encoding"] != label or r.get("metric") != "perplexity" or r["bucket"][1] <= context:
            continue
        per_window = r["tokens"] / len(r["window_nll"])
        for w in windows:
            total += r["window_nll"][w] * per_window
            weight += per_window
    return total / weight if weight else math.nan


def chosen_settings(settings: dict[str, Any], records: list[dict[str, Any]]) -> list[Choice]:
    """Each grid's chosen setting, from the tuning windows' values alone (none without a grid)."""
    tuning = settings.get("tuning_windows") or []
    if not tuning:
        return []
    context, labels = settings["train_len"], settings.get("variant_names") or {}
    by_variant = {variant: label for label, variant in labels.items()}
    choices = []
    for grid, members in (settings.get("sweeps") or {}).items():
        rows = [by_variant[m] for m in members if m in by_variant]
        scores = sorted(
            ((row, _past_context_nll(records, row, tuning, context)) for row in rows),
            key=lambda pair: (math.isnan(pair[1]), pair[1]),
        )
        if scores and not math.isnan(scores[0][1]):
            choices.append(Choice(grid, scores[0][0], tuple(scores)))
    return choices


def _restricted(record: dict[str, Any], windows: Sequence[int]) -> dict[str, Any]:
    """A perplexity record over ``windows`` only: its per-window values, mean, interval and tokens."""
    values = [record["window_nll"][w] for w in windows]
    nll = sum(values) / len(values)
    interval = seed_interval(values)
    per_window = record["tokens"] // len(record["window_nll"])
    return {
        **record,
        "window_nll": values,
        "nll": nll,
        "value": math.exp(nll),
        "interval": None if interval is None else [math.exp(interval[0]), math.exp(interval[1])],
        "examples": len(values),
        "tokens": per_window * len(values),
    }


def held_out(
    settings: dict[str, Any], records: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[Choice]]:
    """``(records, choices)``: the perplexity records over the held-out windows only (all records as
    they are without a split), and each grid's choice (:func:`chosen_settings`)."""
    tuning = settings.get("tuning_windows") or []
    if not tuning:
        return records, []
    choices = chosen_settings(settings, records)
    windows = [w for w in range(settings["eval_examples"]) if w not in set(tuning)]
    out = [
        _restricted(r, windows) if r.get("metric") == "perplexity" and r.get("window_nll") else r
        for r in records
    ]
    return out, choices


def decided(
    settings: dict[str, Any], records: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[Choice]]:
    """What the verdict compares: :func:`held_out`'s records without the settings a grid did not
    choose, and the choices."""
    kept, choices = held_out(settings, records)
    dropped = unchosen(settings, choices)
    return [r for r in kept if r["encoding"] not in dropped], choices


def unchosen(settings: dict[str, Any], choices: Sequence[Choice]) -> set[str]:
    """The rows of the grids' settings that were not chosen (none without a grid)."""
    labels = settings.get("variant_names") or {}
    members = {m for grid in (settings.get("sweeps") or {}).values() for m in grid}
    chosen = {choice.chosen for choice in choices}
    return {label for label, variant in labels.items() if variant in members and label not in chosen}
