"""Length curves (posenc.viz.curves): a linear length axis over the evaluated range with L marked, small
multiples past six encodings; bands are Wilson with one seed and a seed t-interval with several; encodings
that did not fit are marked."""

from __future__ import annotations

import math

import pytest

from _study import _record


def _band_of(ax, index):
    vertices = ax.collections[index].get_paths()[0].vertices
    return vertices[:, 1]


def test_plot_bands_are_wilson_with_one_seed_and_seed_t_interval_with_several():
    from posenc.experiments.results.records import Record
    from posenc.viz.curves import curve_figure

    one = [Record.from_dict(_record("rope", 0, n, v)) for n, v in ((1, 0.5), (2, 1.0))]
    fig = curve_figure(one, "copy", "exact_match", ["rope"], binomial=True)
    band = _band_of(fig.axes[0], 0)
    # 10/20 and 20/20 as Wilson intervals, written out: (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n).
    z, n = 1.959964, 20
    expected = []
    for p in (0.5, 1.0):
        centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        expected += [(centre - half) / (1 + z * z / n), min(1.0, (centre + half) / (1 + z * z / n))]
    assert min(band) == pytest.approx(min(expected)) and max(band) == pytest.approx(1.0)
    assert any(abs(y - expected[0]) < 1e-9 for y in band) and any(abs(y - expected[1]) < 1e-9 for y in band)
    # Three seeds: the Student's t interval of the mean, mean ± t(0.975, 2)·s/√3 with the tabulated
    # t(0.975, 2) = 4.302653, kept inside [0, 1]: at length 1 (0.5, 0.3, 0.4: mean 0.4, s = 0.1),
    # at length 2 (1.0, 0.6, 0.8: mean 0.8, s = 0.2, the top cut at 1).
    more = [((1, 0.3), (2, 0.6)), ((1, 0.4), (2, 0.8))]
    three = one + [Record.from_dict(_record("rope", s, n, v)) for s, ps in enumerate(more, 1) for n, v in ps]
    band = _band_of(curve_figure(three, "copy", "exact_match", ["rope"], binomial=True).axes[0], 0)
    half = 4.302653 / math.sqrt(3)
    expected = [0.4 - 0.1 * half, 0.4 + 0.1 * half, 0.8 - 0.2 * half, 1.0]
    assert sorted({round(float(y), 9) for y in band}) == pytest.approx(sorted(expected), abs=1e-6)


def test_plot_marks_encodings_that_did_not_fit():
    from posenc.experiments.results.records import Record
    from posenc.viz.curves import curve_figure

    records = [
        Record.from_dict(_record(e, 0, n, v)) for e in ("rope", "nope") for n, v in ((1, 0.04), (2, 0.04))
    ]
    fig = curve_figure(
        records, "copy", "exact_match", ["rope", "nope"], unfit={"nope": "did not fit: iid 4.0%"}
    )
    lines = {
        line.get_label(): line for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")
    }
    assert lines["rope"].get_linestyle() == "-"
    assert lines["nope (did not fit: iid 4.0%)"].get_linestyle() == "--"
    legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert "nope (did not fit: iid 4.0%)" in legend


# ----------------------------------------------------------------------------
# Figures: every ``posenc plot`` figure writes a real image whose pixels follow the encoding.


# ---------------------------------------------------------------------------- curves (issue 26)


def _curve_records(encodings: list[str], train_len: int = 16, eval_len: int = 48):
    from posenc.experiments.results.records import Record

    return [
        Record(e, "copy", n, "exact_match", float(n <= train_len + i), 0, train_len, 100)
        for i, e in enumerate(encodings)
        for n in range(1, eval_len + 1)
    ]


def test_curves_have_a_linear_length_axis_over_the_evaluated_range_with_l_marked():
    from posenc.viz.curves import curve_figure

    encodings = ["rope", "alibi", "t5"]
    fig = curve_figure(_curve_records(encodings), "copy", "exact_match", encodings, binomial=True)
    (ax,) = fig.axes
    assert ax.get_xscale() == "linear"
    low, high = ax.get_xlim()
    assert 0 <= low <= 1 and 48 <= high <= 49  # the evaluated lengths, nothing else
    assert any(list(line.get_xdata()) == [16, 16] for line in ax.get_lines())  # L
    assert any(text.get_text() == "L=16" for text in ax.texts)
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels == encodings
    # A base-2 axis stays available.
    log = curve_figure(_curve_records(encodings), "copy", "exact_match", encodings, log_lengths=True)
    assert log.axes[0].get_xscale() == "log"


def test_curves_past_six_encodings_are_small_multiples():
    from posenc.viz.curves import SMALL_MULTIPLES_ABOVE, curve_figure

    encodings = [f"alibi:slope_scale={i}" for i in range(SMALL_MULTIPLES_ABOVE + 1)]
    fig = curve_figure(_curve_records(encodings), "copy", "exact_match", encodings, binomial=True)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == encodings
    for ax, encoding in zip(panels, encodings):
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels.count(encoding) == 1  # this encoding in colour ...
        assert labels.count("_others") == len(encodings) - 1  # ... over the others in grey
        assert ax.get_xscale() == "linear"
    assert len(fig.axes) == 8  # a 4 x 2 grid, the last cell hidden
    six = curve_figure(_curve_records(encodings[:6]), "copy", "exact_match", encodings[:6])
    assert len(six.axes) == 1
