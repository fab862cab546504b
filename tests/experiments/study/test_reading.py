"""Perplexity by position over several windows with a 95% interval across them, and the verdict
(posenc.experiments.study.reading; issue 45, item 4): the interval from the t formula written out
here (t_{0.975, 2} = 4.302652729911275, hand-checked in a table), how far a variant reads and which
variants cannot be ranked, on hand-made records and on a tiny random Llama."""

from __future__ import annotations

import math

import pytest
import torch

from posenc.experiments.study.reading import READ_MARGIN, rank_groups, reads_to, verdict_notes

T_975_2 = 4.302652729911275  # Student's t, 97.5% quantile, 2 degrees of freedom
CONTEXT = 64


def _bucket(lo, hi, value, interval=None, nll=None, tokens=32, label="m"):
    return {
        "encoding": label,
        "metric": "perplexity",
        "bucket": [lo, hi],
        "length": hi,
        "value": value,
        "nll": math.log(value) if nll is None else nll,
        "tokens": tokens,
        "interval": interval,
    }


def test_reads_to_is_the_last_bucket_within_the_margin_of_the_in_context_perplexity():
    assert READ_MARGIN == 0.10
    records = [
        _bucket(32, 64, 10.0),
        _bucket(64, 96, 10.5, [10.0, 10.9]),  # upper 10.9 <= 11
        _bucket(96, 128, 10.6, [10.0, 11.2]),  # upper 11.2 > 11: not read, though its mean is
        _bucket(128, 160, 10.0, [9.9, 10.1]),  # within again, but past a bucket that is not
    ]
    assert reads_to(records, 10.0, CONTEXT) == 96
    assert reads_to(records, 9.0, CONTEXT) == CONTEXT  # the first bucket past c already too high
    assert reads_to(records, 10.5, CONTEXT) == 160
    # One window: the value itself is the bound.
    assert reads_to([_bucket(64, 96, 10.9), _bucket(96, 128, 11.1)], 10.0, CONTEXT) == 96


def test_variants_whose_intervals_overlap_are_not_ranked():
    rows = {
        "c": _bucket(96, 128, 4.5, [4.0, 5.0]),
        "a": _bucket(96, 128, 1.5, [1.0, 2.0]),
        "b": _bucket(96, 128, 2.5, [1.9, 3.0]),  # overlaps a
        "d": _bucket(96, 128, 4.9, [4.8, 5.2]),  # overlaps c
        "e": _bucket(96, 128, 9.0, None),
    }
    assert rank_groups(rows) == [["a", "b"], ["c", "d"], ["e"]]


def test_the_verdict_names_each_variants_reach_and_the_unranked():
    settings = {
        "train_len": CONTEXT,
        "encodings": ["m", "m + yarn"],
        "variant_names": {"m": "none", "m + yarn": "yarn"},
        "eval_examples": 3,
    }
    records = [
        _bucket(32, 64, 10.0, label="m"),
        _bucket(64, 96, 30.0, [25.0, 35.0], label="m"),
        _bucket(32, 64, 12.0, label="m + yarn"),  # its own in-context ppl is not the reference
        _bucket(64, 96, 10.8, [10.5, 10.95], label="m + yarn"),
    ]
    notes = " ".join(verdict_notes(settings, records))
    assert "m reads to 64 (1x)" in notes and "m + yarn reads to 96 (1.5x)" in notes
    assert "m + yarn < m" in notes
    overlapping = [*records[:3], _bucket(64, 96, 26.0, [24.0, 28.0], label="m + yarn")]
    assert "m + yarn ≈ m" in " ".join(verdict_notes(settings, overlapping))


def test_the_verdict_says_why_it_cannot_tell_a_reach():
    """No records for a variant (not run yet), and a run whose buckets all lie inside the context
    (eval-len <= c): the verdict says so instead of claiming a reach of c."""
    settings = {
        "train_len": CONTEXT,
        "encodings": ["m", "m + dca"],
        "variant_names": {"m": "none", "m + dca": "dca"},
        "eval_examples": 2,
    }
    inside = [_bucket(0, 32, 9.0, label="m"), _bucket(32, 64, 10.0, label="m")]
    notes = " ".join(verdict_notes(settings, inside))
    assert "m + dca: no perplexity records" in notes
    assert f"m: no position past the context {CONTEXT} was evaluated" in notes
    assert "reads to 64" not in notes
    assert reads_to(inside, 10.0, CONTEXT) is None


@pytest.mark.hf
def test_the_study_interval_is_the_t_interval_of_the_window_means(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from _tiny_hf import TEXT, save_tiny_llama
    from posenc.experiments.study import hf_study
    from posenc.pretrained.loading import load

    model_dir = save_tiny_llama(tmp_path / "tiny-llama", CONTEXT)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 40)
    records, settings = hf_study.run_study(
        model_dir, tmp_path / "out", task="text-lm", eval_examples=3, corpus=str(corpus)
    )
    model, tokenizer = load(model_dir)
    ids = torch.tensor(tokenizer(TEXT * 40, add_special_tokens=False)["input_ids"])
    starts = hf_study.window_starts(len(ids), 2 * CONTEXT, 3)
    assert len(set(starts)) == 3  # three places of the corpus
    windows = torch.stack([ids[s : s + 2 * CONTEXT] for s in starts])
    with torch.no_grad():
        logits = model(input_ids=windows).logits.double()
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, windows[:, 1:, None])[..., 0]
    record = next(r for r in records if r["bucket"] == [96, 128])
    means = nll[:, 95:127].mean(dim=1)  # positions 97..128 of each window
    mean, sd = float(means.mean()), float(means.std(unbiased=True))
    half = T_975_2 * sd / math.sqrt(3)
    assert record["value"] == pytest.approx(math.exp(mean), rel=1e-5)
    assert record["interval"] == pytest.approx([math.exp(mean - half), math.exp(mean + half)], rel=1e-5)
    assert record["window_nll"] == pytest.approx(means.tolist(), rel=1e-5)
    table = hf_study.study_summary(settings, records)
    assert f"[{math.exp(mean - half):.2f}, {math.exp(mean + half):.2f}]" in table.rows[0][-1]
    assert any("reads to" in note for note in table.notes)
