"""``--preset alibi-paper``: Press et al. 2022 (ICLR), language-model perplexity at 2x, 4x and 8x the
training length over perplexity at L (ours: the byte-level LM on the embedded corpus, L = 64)."""

from __future__ import annotations

import math
from collections import defaultdict
from statistics import mean
from typing import Any

from ..results.agreement import kendall_tau, seed_bootstrap
from .base import Agreement, Preset, Table, citation_line, format_value, per_seed_curves, published

__all__ = ["ALIBI_PAPER", "alibi_agreement", "perplexity_fits", "perplexity_ratios", "window_perplexity"]


#: alibi-paper: a run fits its training length when its perplexity on windows of L is at most this
#: factor above the best encoding's of the same seed (Table 3 has all four within 3.6% at L).
PPL_FIT_MARGIN = 1.10


def window_perplexity(curve: dict[int, float], length: int) -> float | None:
    """Perplexity of a window of ``length`` tokens from per-position perplexities ``{position: ppl}``
    (positions 1..length): ``exp`` of the mean log perplexity, as a non-overlapping evaluation
    scores every token of each window. None when a position is missing."""
    if any(position not in curve for position in range(1, length + 1)):
        return None
    return math.exp(mean(math.log(curve[position]) for position in range(1, length + 1)))


def perplexity_ratios(
    records: list[dict[str, Any]], encoding: str, train_len: int, factors: list[int]
) -> dict[int, float | None]:
    """``{k: window perplexity at k x train_len / at train_len}`` for ``encoding``, mean over seeds."""
    per_seed: dict[int, dict[int, float]] = defaultdict(dict)
    for record in records:
        wanted = record.get("metric") == "perplexity" and record.get("encoding") == encoding
        if wanted and not record.get("variant"):
            per_seed[int(record.get("seed", 0))][int(record["length"])] = float(record["value"])
    ratios: dict[int, float | None] = {}
    for factor in factors:
        values = []
        for curve in per_seed.values():
            base, longer = window_perplexity(curve, train_len), window_perplexity(curve, factor * train_len)
            if base is not None and longer is not None:
                values.append(longer / base)
        ratios[factor] = mean(values) if values else None
    return ratios


def _perplexity_curves(records: list[dict[str, Any]]) -> dict[str, dict[int, dict[int, float]]]:
    """``{encoding: {seed: {position: perplexity}}}`` (no variants)."""
    return per_seed_curves(records, "perplexity", sorted({r["encoding"] for r in records}))


def perplexity_fits(
    records: list[dict[str, Any]], encodings: list[str], train_len: int, margin: float = PPL_FIT_MARGIN
) -> dict[str, dict[int, bool]]:
    """``{encoding: {seed: fits}}``: a run fits when its window perplexity at ``train_len`` is at most
    ``margin`` times the lowest of the encodings of the same seed (:data:`PPL_FIT_MARGIN`)."""
    curves = _perplexity_curves(records)
    at_l = {
        e: {seed: window_perplexity(curve, train_len) for seed, curve in curves.get(e, {}).items()}
        for e in encodings
    }
    fits: dict[str, dict[int, bool]] = {e: {} for e in encodings}
    for seed in sorted({seed for by_seed in at_l.values() for seed in by_seed}):
        values = [v for by_seed in at_l.values() if (v := by_seed.get(seed)) is not None]
        best = min(values) if values else None
        for e in encodings:
            value = at_l[e].get(seed)
            if seed in at_l[e]:
                fits[e][seed] = value is not None and best is not None and value <= margin * best
    return fits


def alibi_agreement(
    records: list[dict[str, Any]], ranked: list[str], paper: dict[str, float], train_len: int, factor: int
) -> Agreement:
    """Kendall's τ of our perplexity ratio at ``factor`` x L (mean over seeds) against the paper's
    (``paper``: ``{encoding: ratio}``) over ``ranked``, with its interval over seed resamples."""
    curves = _perplexity_curves(records)
    ratios: dict[str, dict[int, float]] = {}
    for e in ranked:
        ratios[e] = {}
        for seed, curve in curves.get(e, {}).items():
            base, longer = window_perplexity(curve, train_len), window_perplexity(curve, factor * train_len)
            if base is not None and longer is not None:
                ratios[e][seed] = longer / base
    ranked = [e for e in ranked if ratios[e]]
    what = f"perplexity ratio at {factor}x L"
    if len(ranked) < 2:
        return Agreement(what, ranked, None, None)
    seeds = sorted(set.intersection(*(set(ratios[e]) for e in ranked)))

    def tau_of(resample: dict[str, dict[int, int]]) -> float | None:
        counts = resample["lm"]
        ours = [sum(ratios[e][s] * c for s, c in counts.items()) / sum(counts.values()) for e in ranked]
        return kendall_tau(ours, [paper[e] for e in ranked])

    tau = tau_of({"lm": dict.fromkeys(seeds, 1)})
    interval = seed_bootstrap({"lm": seeds}, tau_of) if tau is not None else None
    return Agreement(what, ranked, tau, interval)


def _compare_alibi(preset: Preset, runs: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]) -> Table:
    entry = published(preset.name)
    factors = sorted(int(k) for k in entry["eval_lengths"])
    paper_l = str(entry["train_length"])
    settings, records = runs.get("lm", ({}, []))
    train_len = preset.settings["train_len"]
    encodings = list(preset.settings["encodings"])
    columns = ["encoding"] + [f"{who} {k}x" for k in factors for who in ("paper", "ours")]
    columns += ["ours ppl at L", "fit"]
    fits = perplexity_fits(records, encodings, train_len)
    ranked = [e for e in encodings if fits[e] and all(fits[e].values())]
    curves = _perplexity_curves(records)
    paper_ratios = {
        factor: {
            e: entry["perplexity"][e][str(entry["eval_lengths"][str(factor)])]
            / entry["perplexity"][e][paper_l]
            for e in encodings
        }
        for factor in factors
    }
    rows = []
    for encoding in encodings:
        ours = perplexity_ratios(records, encoding, train_len, factors)
        cells = [f"{encoding} ({entry['paper_names'][encoding]})"]
        for factor in factors:
            cells.append(f"{paper_ratios[factor][encoding]:.2f}")
            cells.append(format_value(ours[factor], "{:.2f}"))
        at_l = [window_perplexity(curve, train_len) for curve in curves.get(encoding, {}).values()]
        at_l = [value for value in at_l if value is not None]
        cells.append(format_value(mean(at_l) if at_l else None, "{:.2f}"))
        cells.append(f"{sum(fits[encoding].values())}/{len(fits[encoding])}")
        rows.append(cells)
    agreements = {f: alibi_agreement(records, ranked, paper_ratios[f], train_len, f) for f in factors}
    lengths = ", ".join(f"{entry['eval_lengths'][str(k)]}" for k in factors)
    unfit = [e for e in encodings if e not in ranked]
    notes = [
        f"paper: {citation_line(entry)}; {entry['source']}; WikiText-103 perplexity at {lengths} tokens over "
        f"perplexity at L = {paper_l} (those lengths are 1.98x, 3.93x, 7.84x L)",
        f"ours: byte-level LM on {settings.get('corpus') or 'the embedded corpus (stdlib argparse source)'}, "
        f"L = {train_len} bytes, perplexity of windows of k x L bytes over windows of L, d_model "
        f"{settings.get('d_model')}, {settings.get('num_layers')} layer(s), {settings.get('steps')} steps, "
        f"mean over seeds {sorted({int(r.get('seed', 0)) for r in records}) or '-'}",
        "a ratio below 1 means the longer context helped; far above 1, the encoding broke down past L",
        f"fit: a run fits its training length when its perplexity on windows of L is at most {PPL_FIT_MARGIN:.2f}x "
        "the best encoding's of the same seed (Table 3 has all four within 4% at L); only encodings whose every "
        "seed fits enter τ" + (f"; did not fit: {', '.join(unfit)}" if unfit else ""),
    ]
    for factor, agreement in agreements.items():
        notes.append(f"at {factor}x L, " + agreement.note(entry["paper_names"]).replace("agreement: ", "", 1))
    return Table(
        f"{preset.name}: perplexity ratio at k x the training length, published beside ours; "
        f"Kendall's τ vs Table 3's order (lower ratio first): "
        + "; ".join(f"{f}x {_tau_text(a)}" for f, a in agreements.items()),
        columns,
        rows,
        tuple(notes),
    )


def _tau_text(agreement: Agreement) -> str:
    if agreement.tau is None:
        return "-"
    if agreement.interval is None:
        return f"{agreement.tau:+.2f}"
    return f"{agreement.tau:+.2f} [{agreement.interval.low:+.2f}, {agreement.interval.high:+.2f}]"


ALIBI_PAPER = Preset(
    name="alibi-paper",
    summary="Press et al. 2022: LM perplexity at 2x, 4x, 8x the training length (byte-level, L = 64)",
    tasks=("lm",),
    settings={"encodings": ["sinusoidal", "rope", "t5", "alibi"], "train_len": 64, "eval_len": 512},
    fixed=("encodings", "train_len", "eval_len"),
    compare=_compare_alibi,
)
