"""RULER's multi-key needle (``niah_multikey_1``) beside the passkey (``--task text-multikey``;
posenc.experiments.tasks.text.multikey_prompt, posenc.experiments.study.hf_study; issue 45, item 4):
the prompt's length and needles, the exact match of the asked key's value, each cell's count and its
Wilson interval from the formula written out here."""

from __future__ import annotations

import math
import random
import re

import pytest

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from _tiny_hf import byte_level_tokenizer, save_tiny_llama  # noqa: E402
from posenc.experiments.study import hf_study  # noqa: E402
from posenc.experiments.tasks.text import MULTIKEY_KEYS, MULTIKEY_QUESTION, multikey_prompt, multikey_trial  # noqa: E402

CONTEXT = 64
Z = 1.959964  # the 97.5% normal quantile


def wilson(k: int, n: int) -> tuple[float, float]:
    """Wilson (1927): (p + z²/2n ± z √(p(1-p)/n + z²/4n²)) / (1 + z²/n)."""
    p = k / n
    centre, half = p + Z**2 / (2 * n), Z * math.sqrt(p * (1 - p) / n + Z**2 / (4 * n**2))
    return max(0.0, (centre - half) / (1 + Z**2 / n)), min(1.0, (centre + half) / (1 + Z**2 / n))


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer(400)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_the_prompt_has_its_length_every_needle_and_asks_the_first_key(tokenizer, depth):
    needles, distractor_depths = multikey_trial(random.Random(3))
    assert len(needles) == MULTIKEY_KEYS == 4 and len({k for k, _ in needles}) == 4
    assert all(10**6 <= v < 10**7 for _, v in needles)
    ids, asked = multikey_prompt(tokenizer, 500, depth, needles, distractor_depths)
    assert len(ids) == 500
    text = tokenizer.decode(ids)
    for key, value in needles:
        assert text.count(f"One of the special magic numbers for {key} is: {value}.") == 1
    key, value = needles[0]
    assert text.endswith(
        f"What is the special magic number for {key} mentioned in the provided text? "
        f"The special magic number for {key} mentioned in the provided text is"
    )
    assert tokenizer.decode(ids[asked:]).lstrip().startswith(f"One of the special magic numbers for {key} is")

    # The asked needle sits at the depth: the filler before it is about depth of all the filler.
    def count(text):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    sizes = {k: count(f" One of the special magic numbers for {k} is: {v}.") for k, v in needles}
    question = count(" " + MULTIKEY_QUESTION.format(key=key))
    filler = 500 - sum(sizes.values()) - question  # the tiny tokenizer adds no special tokens
    before = tokenizer.decode(ids[:asked])
    filler_before = asked - sum(sizes[k] for k, _ in needles[1:] if f"numbers for {k} is" in before)
    assert abs(filler_before - depth * filler) <= 8  # the nearest sentence boundary


def test_a_prompt_too_short_for_its_needles_names_the_tokens_it_needs(tokenizer):
    needles, depths = multikey_trial(random.Random(0))
    with pytest.raises(ValueError, match=r"a multi-key prompt needs at least \d+ tokens, got length 20"):
        multikey_prompt(tokenizer, 20, 0.5, needles, depths)


def _reader(tokenizer, right):
    """A model that reads the asked key's value from the prompt (``right``), or the value of the
    first needle in the text, whichever key it has (a reader the distractors fool)."""

    def answer(model, ids, steps, stop=None):
        text = tokenizer.decode(ids[0].tolist())
        if "special magic number for" not in text:  # the passkey prompt beside it: always right
            value = re.search(r"pass key is (\d+)", text).group(1)
        elif right:
            key = re.search(r"magic number for (\w+) mentioned in the provided text\?", text).group(1)
            value = re.search(rf"numbers for {key} is: (\d+)", text).group(1)
        else:
            value = re.search(r"numbers for \w+ is: (\d+)", text).group(1)
        return tokenizer(f" {value}.", add_special_tokens=False)["input_ids"]

    return answer


@pytest.mark.parametrize("right", [True, False])
def test_the_multikey_task_scores_the_asked_value_with_counts_and_wilson_intervals(
    tmp_path, monkeypatch, right
):
    model_dir = save_tiny_llama(tmp_path / "tiny-llama", CONTEXT)
    _, tok = hf_study.load_model(model_dir)[:2]
    monkeypatch.setattr(hf_study, "greedy_answer", _reader(tok, right))
    records, settings = hf_study.run_study(
        model_dir,
        tmp_path / "out",
        task="text-multikey",
        eval_len=400,
        lengths=[400],
        depths="0,1",
        eval_examples=3,
    )
    multi = next(r for r in records if r["task"] == "text-multikey")
    passkey = next(r for r in records if r["task"] == "text-passkey")
    assert passkey["hits"] == 6 and passkey["examples"] == 6
    # The wrong reader is right exactly when the asked needle comes first in the text: depth 0.
    expected = [3, 3] if right else [3, sum(_first_is_asked(tok, 400, 1.0, t) for t in range(3))]
    assert [c["hits"] for c in multi["by_depth"]] == expected
    for cell, hits in zip(multi["by_depth"], expected, strict=True):
        assert cell["examples"] == 3 and cell["interval"] == pytest.approx(list(wilson(hits, 3)), abs=1e-9)
    assert multi["hits"] == sum(expected) and multi["interval"] == pytest.approx(
        list(wilson(sum(expected), 6))
    )
    table = hf_study.study_summary(settings, records)
    assert table.columns == ["variant", "passkey 400", "passkey all", "multikey 400", "multikey all"]
    low, high = wilson(sum(expected), 6)
    assert table.rows[0][3] == f"{sum(expected)}/6 [{low:.2f}, {high:.2f}]"
    assert table.rows[0][1] == f"6/6 [{wilson(6, 6)[0]:.2f}, 1.00]"


def _first_is_asked(tokenizer, length, depth, trial):
    rng = random.Random(f"multikey-0-{length}-{depth}-{trial}")
    needles, depths = multikey_trial(rng)
    ids, _ = multikey_prompt(tokenizer, length, depth, needles, depths)
    text = tokenizer.decode(ids)
    return re.search(r"numbers for (\w+) is", text).group(1) == needles[0][0]
