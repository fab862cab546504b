"""The study's paired verdicts (posenc.experiments.study.paired, posenc.experiments.results.stats; issue 58,
item 2) against independent computations: scipy's paired t (``ttest_rel``, its t quantile) and exact
binomial test (``binomtest``), Agresti and Min's interval and Holm's step-down written out here, on
fixed records; the verdict orders only what the tests separate; the committed SmolLM2 study's
``comparisons.jsonl`` equals scipy's tests on the per-window values beside it."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from posenc.experiments.results.stats import holm, mcnemar_exact, paired_t
from posenc.experiments.study.paired import (
    ALPHA,
    COMPARISONS_FILE,
    compare_variants,
    ranked_order,
    study_comparisons,
    write_comparisons,
)
from posenc.experiments.study.reading import verdict_table

scipy_stats = pytest.importorskip("scipy.stats")

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = ROOT / "benchmarks" / "studies" / "smollm2-past-context"
Z = 1.959964


def _holm_written_out(p_values):
    """Holm (1979): sort ascending, multiply the i-th smallest (0-based) by m - i, cap at 1, and make
    the sequence non-decreasing."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def _scipy_paired(a, b):
    result = scipy_stats.ttest_rel(a, b)
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = scipy_stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return float(result.pvalue), (mean - half, mean + half), mean


# ---------------------------------------------------------------------------- the tests themselves


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.5, 6.0), st.floats(-0.5, 0.5)),
        min_size=2,
        max_size=12,
    )
)
def test_the_paired_t_equals_scipy(pairs):
    a = [x for x, _ in pairs]
    b = [x + d for x, d in pairs]
    diffs = [x - y for x, y in zip(a, b)]
    if max(diffs) - min(diffs) < 1e-9:  # no spread: scipy's t is not defined
        return
    p, interval, mean = _scipy_paired(a, b)
    test = paired_t(a, b)
    assert test.test == "paired_t" and test.n == len(a)
    assert test.mean_diff == pytest.approx(mean, abs=1e-12)
    assert test.p == pytest.approx(p, rel=1e-7, abs=1e-14)
    assert test.interval == pytest.approx(interval, rel=1e-7, abs=1e-12)


def test_the_paired_t_says_when_it_cannot_test():
    one = paired_t([2.0], [1.0])
    assert one.p is None and one.interval is None and one.note.startswith("cannot test: 1 pair")
    assert paired_t([1.0, math.nan], [1.0, 2.0]).p is None
    assert paired_t([1.0, 2.0], [1.0, 2.0]).p == 1.0  # nothing differs
    assert paired_t([2.0, 3.0], [1.0, 2.0]).p == 0.0  # every pair by the same amount
    with pytest.raises(ValueError, match="a and b must pair up, got 2 and 1"):
        paired_t([1.0, 2.0], [1.0])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=60))
def test_mcnemar_exact_equals_scipys_binomial_test_and_agresti_min(outcomes):
    a = [x for x, _ in outcomes]
    b = [y for _, y in outcomes]
    n10 = sum(1 for x, y in outcomes if x and not y)
    n01 = sum(1 for x, y in outcomes if y and not x)
    n = len(outcomes)
    test = mcnemar_exact(a, b)
    expected = 1.0 if n10 + n01 == 0 else scipy_stats.binomtest(n10, n10 + n01, 0.5).pvalue
    assert test.p == pytest.approx(expected, rel=1e-9)
    assert test.mean_diff == pytest.approx(sum(a) / n - sum(b) / n, abs=1e-12)
    # Agresti & Min (2005): 0.5 added to each cell of the 2x2 table, then the Wald interval.
    c10, c01, total = n10 + 0.5, n01 + 0.5, n + 2
    centre = (c10 - c01) / total
    half = Z * math.sqrt((c10 + c01) - (c10 - c01) ** 2 / total) / total
    assert test.interval == pytest.approx((max(-1, centre - half), min(1, centre + half)), abs=1e-12)


def test_holm_equals_the_step_down_written_out_and_by_hand():
    # By hand: 0.005 x4 = 0.02; 0.01 x3 = 0.03; 0.03 x2 = 0.06; 0.04 x1 = 0.04 -> raised to 0.06.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    rng = random.Random(3)
    for _ in range(50):
        p = [rng.random() ** 3 for _ in range(rng.randint(1, 12))]
        assert holm(p) == pytest.approx(_holm_written_out(p))
    # An untested pair does not count in the family.
    assert holm([0.01, None, 0.04]) == pytest.approx([0.02, None, 0.04])
    with pytest.raises(ValueError, match=r"holm: p values must be in \[0, 1\]"):
        holm([1.5])


# ---------------------------------------------------------------------------- fixed records


CONTEXT = 64
LABELS = ["m", "m + yarn", "m + dca", "m + rerope"]


def _ppl(label, bucket, window_nll, window=128):
    lo, hi = bucket
    nll = sum(window_nll) / len(window_nll)
    return {
        "run": f"hf__text__{label}__{window}",
        "encoding": label,
        "task": "text-lm",
        "metric": "perplexity",
        "bucket": [lo, hi],
        "length": hi,
        "value": math.exp(nll),
        "nll": nll,
        "tokens": (hi - lo) * len(window_nll),
        "window": window,
        "examples": len(window_nll),
        "window_nll": list(window_nll),
    }


def _needle(label, length, cells, task="text-passkey"):
    by_depth = [
        {
            "bucket": i,
            "depth": [d, d],
            "outcomes": list(o),
            "keys": list(k),
            "hits": sum(o),
            "examples": len(o),
        }
        for i, (d, o, k) in enumerate(cells)
    ]
    hits = sum(c["hits"] for c in by_depth)
    count = sum(c["examples"] for c in by_depth)
    return {
        "run": f"hf__text__{label}__{length}",
        "encoding": label,
        "task": task,
        "metric": "exact_match",
        "length": length,
        "value": hits / count,
        "examples": count,
        "hits": hits,
        "by_depth": by_depth,
    }


def _settings(windows=5):
    return {
        "study": True,
        "hf_model": "m",
        "train_len": CONTEXT,
        "encodings": LABELS,
        "variant_names": {"m": "none", "m + yarn": "yarn", "m + dca": "dca", "m + rerope": "rerope"},
        "eval_examples": windows,
    }


def _fixed_records():
    rng = random.Random(11)
    base = [rng.uniform(2.0, 3.0) for _ in range(5)]
    shift = {"m": 1.5, "m + yarn": 0.0, "m + dca": 0.02, "m + rerope": 0.3}
    records = []
    for label in LABELS:
        records.append(_ppl(label, (32, 64), [v + rng.gauss(0, 0.01) for v in base]))
        records.append(_ppl(label, (64, 96), [v + shift[label] + rng.gauss(0, 0.02) for v in base]))
    keys = [[rng.randrange(10**4) for _ in range(20)] for _ in range(2)]
    right = {"m": 0.1, "m + yarn": 0.9, "m + dca": 0.85, "m + rerope": 0.5}
    for label in LABELS:
        cells = [
            (d, [int(rng.random() < right[label]) for _ in range(20)], k) for d, k in zip((0.0, 1.0), keys)
        ]
        records.append(_needle(label, 128, cells))
    return records


def _outcomes(cells, depth):
    """The outcomes of one depth's cell, or of every depth in depth order ("all")."""
    if depth == "all":
        return [o for cell in sorted(cells, key=lambda c: c["depth"][0]) for o in cell["outcomes"]]
    return next(cell["outcomes"] for cell in cells if cell["depth"][0] == depth)


def test_every_comparison_equals_scipy_on_the_values_beside_it():
    records = _fixed_records()
    comparisons = study_comparisons(_settings(), records)
    ppl = [c for c in comparisons if c["test"] == "paired_t"]
    assert len(ppl) == 2 * 6  # two buckets, every pair of four variants
    rows = {(r["encoding"], tuple(r["bucket"])): r for r in records if r["metric"] == "perplexity"}
    for bucket in ((32, 64), (64, 96)):
        family = [c for c in ppl if tuple(c["bucket"]) == bucket]
        assert [(c["a"], c["b"]) for c in family] == list(itertools.combinations(LABELS, 2))
        expected_p = []
        for c in family:
            p, interval, mean = _scipy_paired(
                rows[c["a"], bucket]["window_nll"], rows[c["b"], bucket]["window_nll"]
            )
            assert c["p"] == pytest.approx(p, rel=1e-7) and c["interval"] == pytest.approx(interval, rel=1e-7)
            assert c["mean_diff"] == pytest.approx(mean) and c["n"] == 5 and c["metric"] == "nll"
            expected_p.append(p)
        for c, adjusted in zip(family, _holm_written_out(expected_p)):
            assert c["p_holm"] == pytest.approx(adjusted, rel=1e-7)
            assert c["separated"] == (adjusted < ALPHA)
    needles = {(r["encoding"]): r for r in records if r["metric"] == "exact_match"}
    for depth in (0.0, 1.0, "all"):
        family = [c for c in comparisons if c["test"] == "mcnemar_exact" and c["depth"] == depth]
        assert len(family) == 6
        expected_p = []
        for c in family:
            cells_a, cells_b = needles[c["a"]]["by_depth"], needles[c["b"]]["by_depth"]
            a, b = _outcomes(cells_a, depth), _outcomes(cells_b, depth)
            n10 = sum(1 for x, y in zip(a, b) if x and not y)
            n01 = sum(1 for x, y in zip(a, b) if y and not x)
            p = 1.0 if n10 + n01 == 0 else scipy_stats.binomtest(n10, n10 + n01, 0.5).pvalue
            assert c["p"] == pytest.approx(p, rel=1e-9) and c["n"] == len(a)
            assert c["mean_diff"] == pytest.approx((sum(a) - sum(b)) / len(a))
            expected_p.append(p)
        for c, adjusted in zip(family, _holm_written_out(expected_p)):
            assert c["p_holm"] == pytest.approx(adjusted, rel=1e-9)


def test_the_verdict_orders_only_what_the_tests_separate():
    records = _fixed_records()
    table = verdict_table(_settings(), records)
    rows = {row[0]: row for row in table.rows}
    ppl = rows["ppl 1.5x (64, 96]"]
    # yarn and dca differ by 0.02 NLL at 0.02 noise over 5 windows: not separated; rerope and m are.
    assert ppl[1] in ("yarn ≈ dca < rerope < m", "dca ≈ yarn < rerope < m")
    assert "rerope − m" not in ppl[2] and "m − rerope" in ppl[2]
    assert rows["passkey 128"][1].endswith("> m")
    assert any("reads to" in note for note in table.notes)
    # Chained by hand: a < b separated, b ≈ c, a ≈ c: no joint may claim "<".
    family = [
        {"a": "a", "b": "b", "mean_diff": -1.0, "separated": True},
        {"a": "b", "b": "c", "mean_diff": -0.1, "separated": False},
        {"a": "a", "b": "c", "mean_diff": -1.1, "separated": False},
    ]
    assert ranked_order({"a": 1.0, "b": 2.0, "c": 2.1}, family) == "a ≈ b ≈ c"
    family[2]["separated"] = True
    assert ranked_order({"a": 1.0, "b": 2.0, "c": 2.1}, family) == "a < b ≈ c"
    # A separated pair in the wrong direction (its mean says otherwise) orders nothing.
    assert (
        ranked_order({"a": 1.0, "b": 2.0}, [{"a": "a", "b": "b", "mean_diff": 1.0, "separated": True}])
        == "a ≈ b"
    )
    assert ranked_order({"a": 0.9, "b": 0.2}, [family[0]], lower_is_better=False) == "a ≈ b"


def test_what_cannot_be_tested_says_so_instead_of_a_p():
    one = [_ppl(label, (64, 96), [2.0 + i]) for i, label in enumerate(LABELS)]
    comparisons = study_comparisons(_settings(windows=1), one)
    assert comparisons and all(
        c["p"] is None and c["p_holm"] is None and not c["separated"] for c in comparisons
    )
    assert all(c["note"].startswith("cannot test: 1 pair") for c in comparisons)
    table = verdict_table(_settings(windows=1), one)
    assert "cannot test" in table.rows[0][2]
    assert any("one window: cannot test" in note for note in table.notes)
    # Windows of another length: not the same windows.
    other = [_ppl("m", (64, 96), [2.0, 2.1]), _ppl("m + yarn", (64, 96), [2.0, 2.1], window=256)]
    assert study_comparisons(_settings(), other)[0]["note"].startswith("cannot test: the windows differ")
    # Prompts with other keys: no McNemar across them.
    a = _needle("m", 128, [(0.5, [1, 0], [11, 12])])
    b = _needle("m + yarn", 128, [(0.5, [1, 1], [11, 13])])
    notes = {c["depth"]: c["note"] for c in study_comparisons(_settings(), [a, b])}
    assert notes[0.5].startswith("cannot test: the variants' prompts differ") and notes["all"] == notes[0.5]
    # Records from before the outcomes were kept.
    for cell in a["by_depth"] + b["by_depth"]:
        del cell["outcomes"], cell["keys"]
    notes = {c["depth"]: c["note"] for c in study_comparisons(_settings(), [a, b])}
    assert all(
        note.startswith("cannot test: the records keep no per-prompt outcomes") for note in notes.values()
    )


def _study_folder(tmp_path, records, settings):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "config.json").write_text(json.dumps({"experiment": settings, "runtime": {}}))
    return tmp_path


def test_compare_takes_a_study_folder_and_two_variants(tmp_path):
    from posenc.cli.app import app, load_command_modules

    records = _fixed_records()
    folder = _study_folder(tmp_path / "study", records, _settings())
    lines = compare_variants(folder, "yarn", "m")
    assert lines[0].startswith("m + yarn (A) against m (B)")
    expected = next(
        c
        for c in study_comparisons(_settings(), records)
        if (c["a"], c["b"], c["task"]) == ("m", "m + yarn", "text-lm") and c["bucket"] == [64, 96]
    )
    line = next(line for line in lines if line.startswith("  ppl (64, 96]"))
    # m is a, yarn b in the records: the line turns the difference and the interval round.
    assert f"A − B {-expected['mean_diff']:+.4f} NLL" in line and line.endswith("A better")
    assert f"p_holm {expected['p_holm']:.3g}" in line
    assert any(line.startswith("  passkey 128 depth all") for line in lines)
    load_command_modules()
    result = CliRunner().invoke(app, ["compare", str(folder), "m + yarn", "m + dca"])
    assert result.exit_code == 0, result.output
    assert "ppl (64, 96]" in result.output and "cannot tell" in result.output
    refused = CliRunner().invoke(app, ["compare", str(folder), "yarn", "longrope"])
    assert refused.exit_code == 2 and "'longrope' is not a variant of this study" in refused.output
    assert "m + rerope" in refused.output


def test_write_comparisons_writes_every_record_and_replaces_an_older_file(tmp_path):
    records = _fixed_records()
    folder = _study_folder(tmp_path / "study", records, _settings())
    (folder / COMPARISONS_FILE).write_text('{"stale": true}\n')
    path = write_comparisons(folder, _settings(), records)
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert written == json.loads(json.dumps(study_comparisons(_settings(), records)))
    assert all("stale" not in r for r in written)


# ---------------------------------------------------------------------------- the committed study


@pytest.mark.parametrize("part", ["2x", "4x-passkey", "dtype-sign/float32", "dtype-sign/bfloat16"])
def test_the_committed_comparisons_equal_scipy_on_the_committed_records(part):
    folder = COMMITTED / part
    records = [
        json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()
    ]
    written = [
        json.loads(line) for line in (folder / COMPARISONS_FILE).read_text().splitlines() if line.strip()
    ]
    rows = {(r["encoding"], tuple(r["bucket"])): r for r in records if r["metric"] == "perplexity"}
    tested = [c for c in written if c["test"] == "paired_t" and c["p"] is not None]
    assert len(tested) == len([c for c in written if c["test"] == "paired_t"])
    for c in tested:
        bucket = tuple(c["bucket"])
        a, b = rows[c["a"], bucket]["window_nll"], rows[c["b"], bucket]["window_nll"]
        if a == b:  # the same numbers (a method exact inside its window): nothing differs, p = 1
            assert c["p"] == 1.0 and c["mean_diff"] == 0.0 and not c["separated"]
            continue
        p, interval, _ = _scipy_paired(a, b)
        assert c["p"] == pytest.approx(p, rel=1e-6) and c["interval"] == pytest.approx(interval, rel=1e-6)
    for c in written:
        if c["test"] == "mcnemar_exact":  # the 4x passkey kept no per-prompt outcomes: one prompt each
            assert c["p"] is None and c["note"].startswith("cannot test")
