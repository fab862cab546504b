"""Perplexity by position over several windows with a 95% interval across them, and the verdict
(posenc.experiments.study.reading; issues 45 item 4 and 58 item 2): the interval from the t formula
written out here (t_{0.975, 2} = 4.302652729911275, hand-checked in a table), how far a variant reads
(the paired difference from the in-context NLL, window by window) on hand-made records and on a tiny
random Llama."""

from __future__ import annotations

import math

import pytest
import torch

from posenc.experiments.study.reading import READ_MARGIN, reads_to, verdict_notes, verdict_table

T_975_2 = 4.302652729911275  # Student's t, 97.5% quantile, 2 degrees of freedom
CONTEXT = 64


def _bucket(lo, hi, value, interval=None, nll=None, tokens=32, label="m", window_nll=None):
    record = {
        "encoding": label,
        "metric": "perplexity",
        "bucket": [lo, hi],
        "length": hi,
        "value": value,
        "nll": (math.log(value) if value > 0 else 0.0) if nll is None else nll,
        "tokens": tokens,
        "interval": interval,
    }
    if window_nll is not None:
        record.update(window_nll=list(window_nll), window=2 * CONTEXT, examples=len(window_nll))
        record["nll"] = sum(window_nll) / len(window_nll)
        record["value"] = math.exp(record["nll"])
    return record


def _upper(diffs):
    """The 95% upper end of the paired t interval over three windows, written out."""
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    return mean + T_975_2 * sd / math.sqrt(3)


def test_reads_to_is_the_last_bucket_whose_paired_difference_stays_within_the_margin():
    assert READ_MARGIN == 0.10
    limit = math.log(1.1)
    inside = [2.0, 2.4, 2.2]  # each window's in-context NLL
    near = [v + d for v, d in zip(inside, (0.02, 0.05, 0.03))]  # small, steady: read
    noisy = [v + d for v, d in zip(inside, (-0.05, 0.09, 0.01))]  # mean 0.017 but spread: upper > limit
    later = [v + 0.01 for v in inside]  # within again, but past a bucket that is not
    assert _upper([0.02, 0.05, 0.03]) <= limit < _upper([-0.05, 0.09, 0.01])
    records = [
        _bucket(32, 64, 0.0, window_nll=inside),
        _bucket(64, 96, 0.0, window_nll=near),
        _bucket(96, 128, 0.0, window_nll=noisy),
        _bucket(128, 160, 0.0, window_nll=later),
    ]
    reference = math.exp(sum(inside) / 3)
    assert reads_to(records, reference, CONTEXT, inside=inside) == 96
    # Without the noisy bucket it reads on to 160: its spread alone stopped it (its mean is within).
    assert reads_to([*records[:2], records[3]], reference, CONTEXT, inside=inside) == 160
    # The first bucket past c already too far: c itself.
    far = [_bucket(64, 96, 0.0, window_nll=[v + 0.2 for v in inside])]
    assert reads_to(far, reference, CONTEXT, inside=inside) == CONTEXT
    # One window: the difference itself is the bound.
    assert reads_to([_bucket(64, 96, 10.9), _bucket(96, 128, 11.1)], 10.0, CONTEXT) == 96


def test_the_verdict_names_each_variants_reach_and_orders_only_what_the_paired_test_separates():
    settings = {
        "train_len": CONTEXT,
        "hf_model": "m",
        "encodings": ["m", "m + yarn"],
        "variant_names": {"m": "none", "m + yarn": "yarn"},
        "eval_examples": 3,
    }
    inside = [2.0, 2.4, 2.2]
    records = [
        _bucket(32, 64, 0.0, label="m", window_nll=inside),
        _bucket(64, 96, 0.0, label="m", window_nll=[v + 1.0 + d for v, d in zip(inside, (0.0, 0.1, 0.05))]),
        # its own in-context NLL is not the reference
        _bucket(32, 64, 0.0, label="m + yarn", window_nll=[v + 0.3 for v in inside]),
        _bucket(
            64, 96, 0.0, label="m + yarn", window_nll=[v + d for v, d in zip(inside, (0.02, 0.04, 0.03))]
        ),
    ]
    notes = " ".join(verdict_notes(settings, records))
    assert "m reads to 64 (1x)" in notes and "m + yarn reads to 96 (1.5x)" in notes
    table = verdict_table(settings, records)
    assert table.rows[0][:2] == ["ppl 1.5x (64, 96]", "yarn < m"]
    # The same means with windows that disagree: the paired test cannot tell.
    noisy = [
        *records[:3],
        _bucket(64, 96, 0.0, label="m + yarn", window_nll=[v + d for v, d in zip(inside, (2.0, 0.1, 0.9))]),
    ]
    assert verdict_table(settings, noisy).rows[0][1] == "yarn ≈ m"


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
    verdict = verdict_table(settings, records)
    assert any("reads to" in note for note in verdict.notes)
