"""The two text tasks of the context-extension study (:mod:`posenc.experiments.study.hf_study`), as
pure pieces on a model and its tokenizer.

* Perplexity by position: :func:`window_starts` places the evaluation windows over the text,
  :func:`position_nll` scores every token of a window given the ones before it (the vocabulary
  projection in chunks), and :func:`position_buckets` pools positions into the buckets ``(lo, hi]``
  the study reports (eight inside the context ``c``, then steps of ``c/2``).
* Passkey: :func:`passkey_prompt` builds the prompt of exactly ``length`` tokens (filler sentences,
  the needle at a depth, the question), :func:`greedy_answer` decodes the model's answer with its
  KV cache, and :func:`answer_is_right` is the exact match on the answer's first run of digits.
* Multi-key needle (RULER's ``niah_multikey_1``, Hsieh et al. 2024): :func:`multikey_prompt` hides
  :data:`MULTIKEY_KEYS` needles "One of the special magic numbers for KEY is: VALUE." (KEY a word,
  VALUE seven digits) in the same filler, the asked key's at a depth and the distractors' at other
  sentence boundaries, then asks for the asked key's value; scored by :func:`answer_is_right`.
  RULER's ``niah_multikey_1`` hides them in essays; here the filler is the passkey's (RULER's
  ``noise`` haystack), so the two needles differ only in the distractors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "FILLER",
    "KEY_DIGITS",
    "MULTIKEY_KEYS",
    "MULTIKEY_NEEDLE",
    "MULTIKEY_QUESTION",
    "MULTIKEY_WORDS",
    "NEEDLE",
    "QUESTION",
    "VALUE_DIGITS",
    "answer_is_right",
    "filler_tokens",
    "greedy_answer",
    "multikey_prompt",
    "multikey_trial",
    "passkey_prompt",
    "position_buckets",
    "position_nll",
    "window_starts",
]

#: The filler sentences of the passkey prompt (repeated).
FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
#: Digits of the pass key.
KEY_DIGITS = 5

#: RULER's multi-key needle and question (``niah_multikey_1``: 4 keys, one asked; 7-digit values).
MULTIKEY_NEEDLE = "One of the special magic numbers for {key} is: {value}."
MULTIKEY_QUESTION = (
    "What is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
MULTIKEY_KEYS = 4
VALUE_DIGITS = 7
#: The words the keys are drawn from (RULER draws English words too).
MULTIKEY_WORDS = (
    "apple", "river", "candle", "garden", "mirror", "pencil", "rocket", "silver", "thunder", "violin",
    "window", "forest", "harbor", "lantern", "meadow", "orange", "planet", "saddle", "tunnel", "walnut",
)  # fmt: skip


# ---------------------------------------------------------------------------- perplexity by position


def position_buckets(context: int, eval_len: int) -> list[tuple[int, int]]:
    """The buckets ``(lo, hi]`` of 1-based positions: eight of width ``context/8`` inside the
    context, then steps of ``context/2`` up to ``eval_len`` (the last one ends at ``eval_len``)."""
    step = max(1, context // 8)
    bounds = [min(k * step, context) for k in range(1, 9)]
    bounds[-1] = context
    position = context
    while position < eval_len:
        position = min(position + max(1, context // 2), eval_len)
        bounds.append(position)
    bounds = [b for b in dict.fromkeys(bounds) if b <= eval_len]
    if not bounds or bounds[-1] != eval_len:
        bounds.append(eval_len)
    return list(zip([0, *bounds[:-1]], bounds))


def position_nll(model: nn.Module, ids: Tensor, chunk: int = 1024) -> Tensor:
    """The NLL of every token of ``ids [B, T]`` but the first: ``[B, T - 1]``, entry ``i`` that of
    token ``i + 1`` given tokens ``0..i``. The vocabulary projection runs ``chunk`` positions at a
    time (a 16k-token window's full logits would take gigabytes)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = getattr(model, "model", None)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    with torch.no_grad():
        if head is None or body is None:
            logits = model(input_ids=ids).logits.float()[:, :-1]
            return -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        hidden = body(input_ids=ids).last_hidden_state
        parts = []
        for start in range(0, ids.shape[1] - 1, chunk):
            stop = min(start + chunk, ids.shape[1] - 1)
            logits = head(hidden[:, start:stop]).float()
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            parts.append(
                -torch.log_softmax(logits, -1).gather(-1, ids[:, start + 1 : stop + 1, None])[..., 0]
            )
        return torch.cat(parts, dim=1)


def window_starts(tokens: int, eval_len: int, examples: int) -> list[int]:
    """Offsets of the ``examples`` windows, evenly spaced over ``tokens`` tokens of text."""
    room = tokens - eval_len
    return [(k * room) // max(1, examples - 1) if examples > 1 else 0 for k in range(examples)]


# ---------------------------------------------------------------------------- passkey


def passkey_prompt(tokenizer: Any, length: int, depth: float, key: int) -> tuple[list[int], int]:
    """``(ids, needle start)``: a prompt of exactly ``length`` tokens with the needle at ``depth``."""

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    prefix = list(tokenizer("", add_special_tokens=True)["input_ids"])
    needle = encode(" " + NEEDLE.format(key=key))
    question = encode(" " + QUESTION)
    filler_len = length - len(prefix) - len(needle) - len(question)
    if filler_len < 0:
        raise ValueError(f"a passkey prompt needs at least {length - filler_len} tokens, got length {length}")
    filler, boundaries = filler_tokens(tokenizer, filler_len)
    at = min(boundaries, key=lambda b: (abs(b - depth * filler_len), b))
    ids = prefix + filler[:at] + needle + filler[at:] + question
    return ids, len(prefix) + at


def greedy_answer(
    model: nn.Module, ids: Tensor, steps: int, stop: Callable[[list[int]], bool] | None = None
) -> list[int]:
    """The tokens (at most ``steps``) the model decodes greedily after ``ids [1, T]`` (KV cache);
    decoding ends early once ``stop(tokens so far)`` is true."""
    import inspect

    # transformers 5.x names the KV cache ``cache``; earlier versions ``past_key_values``.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    answer: list[int] = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        for step in range(steps):
            token = out.logits[:, -1].argmax(-1)
            answer.append(int(token))
            if step + 1 == steps or (stop is not None and stop(answer)):
                break
            out = model(input_ids=token[:, None], use_cache=True, **{name: getattr(out, name)})
    return answer


def answer_is_right(text: str, key: int) -> bool:
    """Exact match: the first run of digits in the answer equals the key."""
    found = re.search(r"\d+", text)
    return found is not None and found.group() == str(key)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def filler_tokens(tokenizer: Any, count: int) -> tuple[list[int], list[int]]:
    """``count`` tokens of the :data:`FILLER` sentences, repeated in order and cut at ``count``, and
    the sentence boundaries within them (0 included): where a needle may be placed."""
    sentences = [_encode(tokenizer, " " + s) for s in FILLER]
    filler: list[int] = []
    boundaries = [0]
    while len(filler) < count:
        filler += sentences[(len(boundaries) - 1) % len(sentences)]
        boundaries.append(len(filler))
    return filler[:count], [b for b in boundaries if b <= count]


def multikey_prompt(
    tokenizer: Any, length: int, depth: float, needles: list[tuple[str, int]], distractor_depths: list[float]
) -> tuple[list[int], int]:
    """``(ids, asked needle start)``: a prompt of exactly ``length`` tokens: filler with the needle of
    ``needles[0]`` (the asked key and its value) at ``depth`` and each other needle at its
    ``distractor_depths`` entry (sentence boundaries nearest the fraction, each boundary once), then
    the question for ``needles[0]``'s key."""
    prefix = list(tokenizer("", add_special_tokens=True)["input_ids"])
    texts = [_encode(tokenizer, " " + MULTIKEY_NEEDLE.format(key=k, value=v)) for k, v in needles]
    question = _encode(tokenizer, " " + MULTIKEY_QUESTION.format(key=needles[0][0]))
    filler_len = length - len(prefix) - sum(map(len, texts)) - len(question)
    if filler_len < 0:
        raise ValueError(
            f"a multi-key prompt needs at least {length - filler_len} tokens, got length {length}"
        )
    filler, free = filler_tokens(tokenizer, filler_len)
    places = []
    for fraction in [depth, *distractor_depths]:
        at = min(free, key=lambda b: (abs(b - fraction * filler_len), b)) if free else filler_len
        places.append(at)
        free = [b for b in free if b != at] or free
    order = sorted(range(len(needles)), key=lambda n: (places[n], n))
    ids, start, asked = list(prefix), 0, 0
    for n in order:
        ids += filler[start : places[n]]
        if n == 0:
            asked = len(ids)
        ids += texts[n]
        start = places[n]
    return ids + filler[start:] + question, asked


def multikey_trial(rng: Any) -> tuple[list[tuple[str, int]], list[float]]:
    """One trial's needles (:data:`MULTIKEY_KEYS` distinct words, each with a seven-digit value; the
    first is asked) and the distractors' depths, drawn from ``rng`` (a :class:`random.Random`)."""
    words = rng.sample(MULTIKEY_WORDS, MULTIKEY_KEYS)
    needles = [(word, rng.randrange(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS)) for word in words]
    return needles, [rng.random() for _ in range(MULTIKEY_KEYS - 1)]
