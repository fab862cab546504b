"""The report's verdict table (posenc.viz.report.verdict): fit flags, intervals and variants."""

from __future__ import annotations

from _study import _curve, _write_folder

# ---------------------------------------------------------------------------- 7. report


def test_report_shows_fit_flags_intervals_and_variants(tmp_path):
    from posenc.viz.report import render_report

    records = []
    for seed in (0, 1):
        records += _curve("rope", seed, (0.4 + 0.4 * seed, 0.4 + 0.4 * seed))
        records += [{**r, "encoding": "rope + yarn", "run": f"y{seed}", "variant": "yarn", "trained_encoding": "rope"}
                    for r in _curve("rope", seed, (0.9, 0.9))]  # fmt: skip
        records += _curve("nope", seed, (0.0, 0.0), inside=0.04)
    _write_folder(tmp_path, records, encodings=["rope", "nope"], eval_variants=["yarn"])
    text = render_report(tmp_path)
    section = text[
        text.index('<table id="summary">') : text.index("</table>", text.index('<table id="summary">'))
    ]
    rows = section.split("<tr")[2:]
    # In the order of the ranking beyond L (the variant first), the row that did not fit last.
    assert [row.split("<code>")[1].split("</code>")[0] for row in rows] == ["rope + yarn", "rope", "nope"]
    # Beyond L rope scores 0.4 and 0.8: 0.6 ± t(0.975, 1)·0.2 = 0.6 ± 2.54, kept inside [0%, 100%].
    assert "100.0%, 2/2" in rows[1] and "60.0% [0.0%, 100.0%]" in rows[1]
    assert "95% Student&#x27;s t interval of the mean across the n seeds" in text
    assert 'class="unfit"' in rows[2] and "not ranked (did not fit: iid 4.0%)" in rows[2]
    assert 'class="fit"' in rows[0] and "90.0%" in rows[0]
    assert "<b>2 seeds</b>" in text and "No figure for <code>rope + yarn" not in text
