"""Paired verdicts of a context-extension study: every variant scores the same windows and the same
prompts, so two variants are compared on their differences window by window and prompt by prompt.

One record per (task, bucket or cell, variant pair) goes to ``comparisons.jsonl`` in the study folder
(:func:`study_comparisons`, :func:`write_comparisons`), each with the fields::

    task       text-lm, text-passkey or text-multikey
    bucket     [lo, hi] of the positions (perplexity), or
    length, depth   the prompt length and the needle's depth ("all": every depth of the length)
    a, b       the two variants (rows of the table, in the study's order)
    metric     "nll" (perplexity; lower is better) or "exact_match" (retrieval; higher is better)
    test       "paired_t" (perplexity: the per-window mean NLLs of the bucket) or
               "mcnemar_exact" (retrieval: each prompt's right/wrong)
    n          windows or prompts
    mean_diff  a - b: mean NLL difference, or accuracy difference
    interval   its 95% interval (paired t, or Agresti and Min's for paired proportions)
    p, p_holm  the two-sided p, and Holm's correction over the pairs of the same bucket or cell
    separated  p_holm < ALPHA: the test tells the two apart
    note       why there is no test ("cannot test: ..."), else empty

The values the tests read stay in ``results.jsonl`` beside them (``window_nll`` per perplexity bucket,
``outcomes`` and ``keys`` per retrieval cell), so anyone can recompute every test
(:mod:`posenc.experiments.results.stats` writes the tests out).

The verdict (:func:`ranked_order`) orders the variants at one bucket by their mean, best first, and
puts ``<`` between two neighbours only where every variant on the left is separated from every
variant on the right by its Holm-corrected test (``≈`` otherwise: the tests cannot tell).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..results.records import atomic_write_text, experiment_settings, load_config, read_results
from ..results.stats import PairedTest, holm, mcnemar_exact, paired_t
from .sweep import decided

__all__ = [
    "ALPHA",
    "COMPARISONS_FILE",
    "compare_variants",
    "is_study_folder",
    "perplexity_comparisons",
    "ranked_order",
    "retrieval_comparisons",
    "study_comparisons",
    "write_comparisons",
]

#: The family-wise error rate of one bucket's or cell's comparisons (Holm).
ALPHA = 0.05
#: The paired comparisons of a study folder, one JSON record per line.
COMPARISONS_FILE = "comparisons.jsonl"


def _comparison(family: dict[str, Any], a: str, b: str, metric: str, result: PairedTest) -> dict[str, Any]:
    return {
        **family,
        "a": a,
        "b": b,
        "metric": metric,
        "test": result.test,
        "n": result.n,
        "mean_diff": result.mean_diff,
        "interval": None if result.interval is None else list(result.interval),
        "p": result.p,
        "p_holm": None,
        "separated": False,
        "note": result.note,
    }


def _cannot(
    family: dict[str, Any], a: str, b: str, metric: str, test: str, n: int, why: str
) -> dict[str, Any]:
    return _comparison(family, a, b, metric, PairedTest(test, n, math.nan, None, None, f"cannot test: {why}"))


def _with_holm(family: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of one bucket or cell with ``p_holm`` and ``separated`` filled in."""
    for record, adjusted in zip(family, holm([r["p"] for r in family])):
        record["p_holm"] = adjusted
        record["separated"] = adjusted is not None and adjusted < ALPHA
    return family


def _labels(settings: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """The variants in the study's row order (then any other label the records hold)."""
    return list(dict.fromkeys([*settings.get("encodings", []), *(r["encoding"] for r in records)]))


def perplexity_comparisons(settings: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Paired t over the windows of each perplexity bucket, for every pair of variants that has it."""
    by_bucket: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for r in records:
        if r.get("metric") == "perplexity":
            by_bucket.setdefault(tuple(r["bucket"]), {})[r["encoding"]] = r
    labels = _labels(settings, records)
    out: list[dict[str, Any]] = []
    for bucket in sorted(by_bucket):
        rows = by_bucket[bucket]
        family = {"task": "text-lm", "bucket": list(bucket), "length": bucket[1]}
        present = [label for label in labels if label in rows]
        pairs = []
        for a, b in itertools.combinations(present, 2):
            ra, rb = rows[a], rows[b]
            wa, wb = ra.get("window_nll"), rb.get("window_nll")
            if wa is None or wb is None:
                why = "the records keep no per-window NLL (written before they did); rerun the unit"
                pairs.append(_cannot(family, a, b, "nll", "paired_t", 0, why))
            elif len(wa) != len(wb) or ra.get("window") != rb.get("window"):
                why = f"the windows differ ({len(wa)} of {ra.get('window')} tokens, {len(wb)} of {rb.get('window')})"
                pairs.append(_cannot(family, a, b, "nll", "paired_t", min(len(wa), len(wb)), why))
            else:
                pairs.append(_comparison(family, a, b, "nll", paired_t(wa, wb)))
        out += _with_holm(pairs)
    return out


def _cells(record: dict[str, Any]) -> dict[Any, dict[str, Any]]:
    """A needle record's cells by depth, and ``"all"``: every depth's prompts in one (without outcomes
    when a cell keeps none)."""
    cells: dict[Any, dict[str, Any]] = {cell["depth"][0]: cell for cell in record.get("by_depth", [])}
    ordered = [cells[d] for d in sorted(cells)]
    every: dict[str, Any] = {"depths": sorted(cells)}
    if all("outcomes" in c for c in ordered):
        every["outcomes"] = [o for c in ordered for o in c["outcomes"]]
        every["keys"] = [k for c in ordered for k in c.get("keys", [None] * len(c["outcomes"]))]
    if cells:
        cells["all"] = every
    return cells


def _mcnemar_pair(
    family: dict[str, Any], a: str, b: str, ca: dict[str, Any], cb: dict[str, Any]
) -> dict[str, Any]:
    if "outcomes" not in ca or "outcomes" not in cb:
        why = "the records keep no per-prompt outcomes (written before they did); rerun the unit"
        return _cannot(family, a, b, "exact_match", "mcnemar_exact", 0, why)
    if ca.get("keys") != cb.get("keys") or ca.get("depths") != cb.get("depths"):
        why = "the variants' prompts differ (other keys or depths); no paired test across them"
        return _cannot(family, a, b, "exact_match", "mcnemar_exact", len(ca["outcomes"]), why)
    return _comparison(family, a, b, "exact_match", mcnemar_exact(ca["outcomes"], cb["outcomes"]))


def retrieval_comparisons(settings: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """McNemar's exact test on the same prompts, per (task, length, depth) and per (task, length) over
    every depth, for every pair of variants that has the cell."""
    by_cell: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in records:
        if r.get("metric") == "exact_match" and r.get("by_depth"):
            by_cell.setdefault((r["task"], r["length"]), {})[r["encoding"]] = r
    labels = _labels(settings, records)
    out: list[dict[str, Any]] = []
    for task, length in sorted(by_cell):
        rows = {label: _cells(record) for label, record in by_cell[(task, length)].items()}
        depths = sorted({d for cells in rows.values() for d in cells if d != "all"})
        for depth in [*depths, "all"]:
            family = {"task": task, "length": length, "depth": depth}
            present = [label for label in labels if depth in rows.get(label, {})]
            pairs = [
                _mcnemar_pair(family, a, b, rows[a][depth], rows[b][depth])
                for a, b in itertools.combinations(present, 2)
            ]
            out += _with_holm(pairs)
    return out


def study_comparisons(settings: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every paired comparison of a study's records: perplexity buckets, then retrieval cells. With
    ``--tuning-windows``, on the held-out windows only, and of each grid only its chosen setting
    (:func:`.sweep.decided`)."""
    records, _ = decided(settings, records)
    return perplexity_comparisons(settings, records) + retrieval_comparisons(settings, records)


def write_comparisons(out: Path, settings: dict[str, Any], records: list[dict[str, Any]]) -> Path:
    """``out/comparisons.jsonl`` from the folder's records (written whole, atomically)."""
    path = Path(out) / COMPARISONS_FILE
    comparisons = study_comparisons(settings, records)
    atomic_write_text(path, "".join(json.dumps(c, allow_nan=True) + "\n" for c in comparisons))
    return path


def ranked_order(
    means: dict[str, float], family: Sequence[dict[str, Any]], lower_is_better: bool = True
) -> str:
    """The variants of one bucket or cell (``means``: label -> its mean), best first, joined by ``<``
    where every variant before the joint is separated from every variant after it (by ``family``'s
    Holm-corrected tests, in the right direction) and by ``≈`` where the tests cannot tell (``>``
    in place of ``<`` where higher is better: "A > B" reads "A retrieves more than B")."""
    sign = 1.0 if lower_is_better else -1.0
    ordered = sorted(means, key=lambda label: sign * means[label])
    tests = {(r["a"], r["b"]): r for r in family}

    def better(x: str, y: str) -> bool:
        """x is separated from y and better than it."""
        record, flip = (tests.get((x, y)), 1.0) if (x, y) in tests else (tests.get((y, x)), -1.0)
        return bool(record and record["separated"] and sign * flip * record["mean_diff"] < 0)

    joint = " < " if lower_is_better else " > "
    text = ordered[0] if ordered else ""
    for cut in range(1, len(ordered)):
        apart = all(better(x, y) for x in ordered[:cut] for y in ordered[cut:])
        text += (joint if apart else " ≈ ") + ordered[cut]
    return text


def _resolve(label: str, settings: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """A row of the study by its label (``smollm2-135m + yarn``) or its method's name (``yarn``)."""
    labels = _labels(settings, records)
    if label in labels:
        return label
    names = settings.get("variant_names") or {}
    matches = [row for row in labels if names.get(row) == label or row.split(" + ", 1)[-1] == label]
    if len(matches) == 1:
        return matches[0]
    raise ValueError(f"{label!r} is not a variant of this study; its rows: {', '.join(labels)}")


def is_study_folder(folder: str | Path) -> bool:
    """Whether ``folder``'s ``config.json`` is a context-extension study's (False without one)."""
    path = Path(folder) / "config.json"
    return path.is_file() and bool(experiment_settings(load_config(Path(folder))).get("study"))


def compare_variants(folder: str | Path, a: str, b: str) -> list[str]:
    """``posenc compare STUDY A B``: one line per bucket and retrieval cell where both variants were
    scored, with A − B, its 95% interval, ``p``, ``p_holm`` (Holm over the bucket's or cell's pairs
    of every variant) and the verdict, "A better", "B better" or "cannot tell"."""
    folder = Path(folder)
    records = read_results(folder)
    settings = experiment_settings(load_config(folder))
    if not settings.get("study"):
        raise ValueError(f"{folder} is not a study folder (its config.json names no study)")
    a, b = _resolve(a, settings, records), _resolve(b, settings, records)
    if a == b:
        raise ValueError(f"compare a variant with another one, not with itself ({a!r})")
    lines = [f"{a} (A) against {b} (B), paired on the same windows and prompts ({COMPARISONS_FILE}):"]
    for c in study_comparisons(settings, records):
        if {c["a"], c["b"]} != {a, b}:
            continue
        flip = 1.0 if c["a"] == a else -1.0
        where = (
            f"ppl ({c['bucket'][0]}, {c['bucket'][1]}]"
            if c["task"] == "text-lm"
            else f"{c['task'].removeprefix('text-')} {c['length']} depth {c['depth']}"
        )
        if c["p"] is None:
            lines.append(f"  {where}: {c['note']}")
            continue
        low, high = sorted(flip * v + 0.0 for v in c["interval"])  # + 0.0: no "-0.0000" for a zero
        diff = flip * c["mean_diff"] + 0.0
        better = (diff < 0) == (c["metric"] == "nll")
        verdict = ("A better" if better else "B better") if c["separated"] else "cannot tell"
        unit = " NLL" if c["metric"] == "nll" else " exact match"
        lines.append(
            f"  {where}: A − B {diff:+.4f}{unit} [{low:+.4f}, {high:+.4f}], n {c['n']}, "
            f"p {c['p']:.3g}, p_holm {c['p_holm']:.3g}: {verdict}"
        )
    if len(lines) == 1:
        lines.append("  no bucket or cell holds both variants")
    return lines
