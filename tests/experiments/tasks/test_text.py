"""Text tasks on a pretrained model (posenc.experiments.tasks.text) with a tiny random Llama and a small
trained BPE tokenizer: per-position NLL equals HF's log-softmax, position buckets partition the positions,
the passkey prompt has the needle at its depth, the greedy answer is the argmax continuation."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")

tokenizers = pytest.importorskip("tokenizers")

from _tiny_hf import save_tiny_llama  # noqa: E402
from posenc.experiments.study import hf_study  # noqa: E402
from posenc.experiments.study.hf_study import (  # noqa: E402
    NEEDLE,
    passkey_prompt,
    position_buckets,
    position_nll,
)

CONTEXT = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", CONTEXT)


def _load(model_dir):
    from posenc.pretrained.loading import load

    return load(model_dir)


def test_position_nll_equals_log_softmax_of_hf_logits(model_dir):
    model, _ = _load(model_dir)
    ids = torch.randint(0, 420, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    direct = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    for chunk in (7, 1024):  # the chunked vocabulary projection changes nothing
        torch.testing.assert_close(position_nll(model, ids, chunk=chunk), direct, rtol=1e-5, atol=1e-5)


def test_buckets_partition_the_positions():
    buckets = position_buckets(64, 128)
    assert buckets[:8] == [(8 * k, 8 * (k + 1)) for k in range(8)]
    assert buckets[8:] == [(64, 96), (96, 128)]  # 1.5x and 2x
    for context, eval_len in ((8192, 16384), (100, 250), (64, 64), (7, 20), (8192, 600)):
        buckets = position_buckets(context, eval_len)
        covered = [p for lo, hi in buckets for p in range(lo + 1, hi + 1)]
        assert covered == list(range(1, eval_len + 1)), (context, eval_len)
        assert min(context, eval_len) in {hi for _, hi in buckets}


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_the_passkey_prompt_has_the_needle_at_the_depth(model_dir, depth):
    _, tokenizer = _load(model_dir)
    ids, at = passkey_prompt(tokenizer, 120, depth, 54321)
    assert len(ids) == 120
    needle = tokenizer(" " + NEEDLE.format(key=54321), add_special_tokens=False)["input_ids"]
    question = tokenizer(" " + hf_study.QUESTION, add_special_tokens=False)["input_ids"]
    assert ids[at : at + len(needle)] == needle and ids[-len(question) :] == question
    filler = 120 - len(needle) - len(question)
    sentence = max(len(tokenizer(" " + s, add_special_tokens=False)["input_ids"]) for s in hf_study.FILLER)
    assert abs(at - depth * filler) <= sentence / 2 + 1
    assert "The pass key is 54321" in tokenizer.decode(ids)


def test_greedy_answer_is_the_argmax_continuation(model_dir):
    model, _ = _load(model_dir)
    ids = torch.randint(0, 420, (1, 30), generator=torch.Generator().manual_seed(2))
    got = hf_study.greedy_answer(model, ids, 4)
    sequence = ids
    for _ in range(4):
        with torch.no_grad():
            nxt = model(input_ids=sequence).logits[:, -1].argmax(-1)
        sequence = torch.cat([sequence, nxt[:, None]], 1)
    assert got == sequence[0, 30:].tolist()
    assert hf_study.greedy_answer(model, ids, 4, stop=lambda tokens: len(tokens) == 2) == got[:2]
    assert hf_study.answer_is_right(" 12345.", 12345) and not hf_study.answer_is_right(" 1234", 12345)
