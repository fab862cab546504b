"""RULER's variable tracking and HELMET's JSON key-value retrieval (posenc.experiments.tasks.haystack; issue
58, item 3): each prompt exactly its length, its statements or its JSON object read back from the decoded
text (the JSON parsed by the json module), the asked item where its depth says, the scoring rules as
the benchmarks state them, and ``--task text-retrieval`` running all four needles with per-prompt
outcomes that McNemar's test pairs."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from _tiny_hf import byte_level_tokenizer, save_tiny_llama  # noqa: E402
from posenc.experiments.study import hf_study  # noqa: E402
from posenc.experiments.tasks.haystack import (  # noqa: E402
    VT_HOPS,
    json_kv_prompt,
    json_kv_right,
    vt_prompt,
    vt_right,
    vt_trial,
)
from posenc.experiments.tasks.text import FILLER  # noqa: E402

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer(400)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("length", [300, 1000])
def test_a_variable_tracking_prompt_holds_the_chain_in_order_after_its_depth(tokenizer, depth, length):
    names, value = vt_trial(random.Random(f"{depth}-{length}"))
    assert len(names) == VT_HOPS + 1 == len(set(names)) and 10_000 <= value < 100_000
    ids, first = vt_prompt(tokenizer, length, depth, names, value)
    assert len(ids) == length
    text = tokenizer.decode(ids)
    chain = [f"VAR {names[0]} = {value}.", *(f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names))]
    places = [text.index(statement) for statement in chain]
    assert places == sorted(places)  # in chain order
    assert text.rstrip().endswith(f"{len(names)} variables are assigned the value {value}, they are:")
    # Before the first statement: the filler up to the sentence boundary nearest depth x the filler's length.
    prefix = len(tokenizer("", add_special_tokens=True)["input_ids"])
    encode = lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    question = text[text.index("Question:") - 1 :]
    filler = length - prefix - sum(encode(" " + c) for c in chain) - encode(question)
    longest = max(encode(" " + sentence) for sentence in FILLER)
    assert abs((first - prefix) - depth * filler) <= longest
    assert vt_right(" " + ", ".join(names), names) and not vt_right(", ".join(names[:-1]), names)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_a_json_prompt_is_a_parsable_object_with_the_asked_pair_at_its_depth(tokenizer, depth):
    ids, value = json_kv_prompt(tokenizer, 1200, depth, random.Random(f"json-{depth}"))
    assert len(ids) == 1200
    text = tokenizer.decode(ids)
    body = text[text.index("{") : text.rindex("}") + 1]
    pairs = json.loads(body)
    asked = re.search(rf'Key: "({UUID})"\nCorresponding value:$', text).group(1)
    assert pairs[asked] == value and len(pairs) >= 5
    assert all(re.fullmatch(UUID, k) and re.fullmatch(UUID, v) for k, v in pairs.items())
    position = list(pairs).index(asked)
    assert position == round(depth * (len(pairs) - 1))
    assert json_kv_right(f' "{value}"', value) and not json_kv_right(value[:-1], value)


def test_a_prompt_too_short_names_the_tokens_it_needs(tokenizer):
    names, value = vt_trial(random.Random(0))
    with pytest.raises(
        ValueError, match=r"a variable-tracking prompt needs at least \d+ tokens, got length 50"
    ):
        vt_prompt(tokenizer, 50, 0.5, names, value)
    with pytest.raises(ValueError, match=r"a JSON key-value prompt needs at least \d+ tokens, got length 50"):
        json_kv_prompt(tokenizer, 50, 0.5, random.Random(0))


def test_the_retrieval_task_runs_every_needle_with_paired_outcomes(tmp_path, monkeypatch):
    """A model that answers from the prompt: right on every needle for the model as trained, wrong on
    the JSON task for the yarn row; McNemar's exact test sees 2 discordant prompts there."""
    scipy_stats = pytest.importorskip("scipy.stats")
    from posenc.experiments.study.paired import study_comparisons

    model_dir = save_tiny_llama(tmp_path / "tiny-llama", 64)
    _, tokenizer = hf_study.load_model(model_dir)[:2]
    calls = []

    def answer(model, ids, steps, stop=None):
        text = tokenizer.decode(ids[0].tolist())
        calls.append(1)
        if "Corresponding value:" in text:
            key = re.search(rf'Key: "({UUID})"', text).group(1)
            value = json.loads(text[text.index("{") : text.rindex("}") + 1])[key]
            wrong = len(calls) > 16  # the second variant's (16 prompts a variant: 4 needles x 2 depths x 2)
            reply = f' "{value[::-1] if wrong else value}"'
        elif "Find all variables" in text:
            value = re.search(r"assigned the value (\d+)", text).group(1)
            names = re.findall(r"VAR ([A-Z]{5}) = ", text)
            reply = " " + ", ".join(dict.fromkeys(names))
            assert value
        elif "special magic number for" in text:
            key = re.search(r"special magic number for (\w+) mentioned", text).group(1)
            reply = " " + re.search(rf"magic numbers for {key} is: (\d+)", text).group(1) + "."
        else:
            reply = " " + re.search(r"pass key is (\d+)", text).group(1) + "."
        return tokenizer(reply, add_special_tokens=False)["input_ids"]

    monkeypatch.setattr(hf_study, "greedy_answer", answer)
    records, settings = hf_study.run_study(
        model_dir, tmp_path / "out", task="text-retrieval", lengths=[600], eval_len=600, depths="0,1", eval_examples=1,
        variants=["none", "yarn:2"], trials=2,
    )  # fmt: skip
    tasks = {(r["encoding"], r["task"]): r for r in records}
    label, yarn = settings["encodings"]
    for task in ("text-passkey", "text-multikey", "text-vt", "text-jsonkv"):
        assert tasks[label, task]["hits"] == 4 and tasks[label, task]["examples"] == 4
    assert tasks[yarn, "text-jsonkv"]["hits"] == 0 and tasks[yarn, "text-vt"]["hits"] == 4
    every = next(
        c for c in study_comparisons(settings, records) if c["task"] == "text-jsonkv" and c["depth"] == "all"
    )
    assert every["n"] == 4 and every["p"] == pytest.approx(scipy_stats.binomtest(4, 4, 0.5).pvalue)
