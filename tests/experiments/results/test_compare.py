"""Comparing two encodings (posenc.experiments.results.compare): paired by seed, saying who wins; missing,
unfit and identical rows refused, one seed cannot tell; lower is better on perplexity."""

from __future__ import annotations

from statistics import mean

import pytest
from typer.testing import CliRunner

from _study import _app, _curve, _record, _write_folder
from posenc.experiments.results.compare import compare_rows


def test_compare_pairs_by_seed_and_says_who_wins(tmp_path):
    # Beyond L=2, per seed: a = 0.6, 0.7, 0.65; b = 0.4, 0.4, 0.45 -> differences 0.2, 0.3, 0.2.
    records = []
    for seed, (a, b) in enumerate(
        [((0.5, 0.7), (0.4, 0.4)), ((0.7, 0.7), (0.3, 0.5)), ((0.6, 0.7), (0.45, 0.45))]
    ):
        records += _curve("a", seed, a) + _curve("b", seed, b)
    records += [r for seed in (0, 1, 2) for r in _curve("c", seed, (0.4 + 0.1 * (seed == 1), 0.4))]
    _write_folder(tmp_path, records)
    result = compare_rows(tmp_path, "a", "b")
    assert result.differences == pytest.approx([0.2, 0.3, 0.2])
    assert result.mean == pytest.approx(0.7 / 3)
    # Paired t interval: mean 0.7/3, s = 0.1/√3 (deviations 1/30, 2/30, 1/30), so
    # 0.7/3 ± t(0.975, 2)·s/√3 = 0.7/3 ± 4.302653·0.1/3: [0.0899, 0.3768], which excludes 0.
    assert result.interval == pytest.approx(
        (0.7 / 3 - 4.302653 * 0.1 / 3, 0.7 / 3 + 4.302653 * 0.1 / 3), abs=1e-6
    )
    assert result.verdict == "a"
    assert result.lines()[-1].startswith("a beats b beyond L")
    assert compare_rows(tmp_path, "b", "a").verdict == "b"
    # b vs c: differences 0.0, -0.05, 0.05 (seed 1's c is 0.45 beyond): the interval contains 0.
    close = compare_rows(tmp_path, "b", "c")
    assert close.differences == pytest.approx([0.0, -0.05, 0.05]) and close.verdict == "cannot tell"
    assert close.lines()[-1] == "cannot tell: the interval contains 0"


def test_compare_refuses_missing_unfit_and_same_rows_and_one_seed_cannot_tell(tmp_path):
    records = _curve("rope", 0, (0.5, 0.5)) + _curve("nope", 0, (0.0, 0.0), inside=0.04)
    records += _curve("alibi", 0, (0.2, 0.2))
    _write_folder(tmp_path, records)
    with pytest.raises(ValueError, match=r"'t5' not in .* \(it has: rope, nope, alibi\)"):
        compare_rows(tmp_path, "rope", "t5")
    with pytest.raises(
        ValueError, match=r"'nope' \(in-distribution 4\.0%, 0/1 seeds reach 95\.0%\) did not fit"
    ):
        compare_rows(tmp_path, "rope", "nope")
    with pytest.raises(ValueError, match=r"same row"):
        compare_rows(tmp_path, "rope", "rope")
    single = compare_rows(tmp_path, "rope", "alibi")
    assert single.interval is None and single.verdict == "cannot tell"
    assert "one seed gives no interval" in single.lines()[-1]
    app = _app()
    result = CliRunner().invoke(app, ["compare", str(tmp_path), "rope", "nope"])
    assert result.exit_code == 2 and "did not fit" in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["compare", str(tmp_path), "rope", "alibi"])
    assert result.exit_code == 0 and "mean difference rope - alibi: +30.0%" in result.output


def test_compare_on_perplexity_lower_is_better(tmp_path):
    records = []
    for seed, (a, b) in enumerate([(3.0, 5.0), (3.5, 6.0), (3.2, 5.5)]):
        for encoding, value in (("a", a), ("b", b)):
            records += [
                _record(encoding, seed, n, value, metric="perplexity", task="lm") for n in (1, 2, 3, 4)
            ]
    _write_folder(tmp_path, records, task="lm")
    result = compare_rows(tmp_path, "a", "b")
    assert result.mean == pytest.approx(mean([-2.0, -2.5, -2.3])) and result.verdict == "a"
