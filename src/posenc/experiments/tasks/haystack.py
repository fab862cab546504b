"""Two more retrieval tasks of the study, generated offline and seeded, each prompt exactly ``length``
tokens in the model's own tokenizer:

* **variable tracking** (RULER's ``vt``, Hsieh et al. 2024, ``variable_tracking.py``): one chain of
  :data:`VT_HOPS` + 1 assignments, ``VAR ABCDE = 12345`` then ``VAR FGHIJ = VAR ABCDE`` and so on,
  hidden in the passkey's filler from ``depth`` on (in chain order, evenly spread over the rest), then
  RULER's question and answer prefix. Right when the greedy answer names every variable of the chain
  (RULER's ``string_match_all`` at 1.0: a prompt is right or wrong, as McNemar's test pairs them).
* **JSON key-value retrieval** (HELMET's ``json_kv``, Yen et al. 2025, after Liu et al.'s "Lost in
  the middle"): a JSON object of random UUID keys and values, the asked pair at ``depth`` among the
  pairs, then the question; right when the asked value appears in the greedy answer (HELMET's
  substring exact match). As many pairs as the length holds; the tokens left over are the passkey's
  filler sentences before the object.

Neither task reads a file or the network: every key, value and name is drawn from the trial's
:class:`random.Random`.
"""

from __future__ import annotations

import itertools
import json
import random
import string
import uuid
from typing import Any

from .text import _encode, filler_tokens

__all__ = [
    "JSON_QUESTION",
    "VT_HOPS",
    "VT_QUESTION",
    "json_kv_prompt",
    "json_kv_right",
    "vt_prompt",
    "vt_right",
    "vt_trial",
]

#: Assignments after the first in the chain (RULER's default ``num_hops``).
VT_HOPS = 4
VT_QUESTION = (
    "Question: Find all variables that are assigned the value {value} in the text above. Answer: According to "
    "the chain(s) of variable assignment in the text above, {count} variables are assigned the value {value}, "
    "they are:"
)
JSON_PREAMBLE = "Extract the value corresponding to the specified key in the JSON object below."
JSON_QUESTION = 'Key: "{key}"\nCorresponding value:'


def _prefix(tokenizer: Any) -> list[int]:
    return list(tokenizer("", add_special_tokens=True)["input_ids"])


# ---------------------------------------------------------------------------- variable tracking


def vt_trial(rng: random.Random) -> tuple[list[str], int]:
    """One chain's variable names (five upper-case letters each, distinct) and its value (five digits)."""
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    return names, rng.randrange(10_000, 100_000)


def vt_prompt(
    tokenizer: Any, length: int, depth: float, names: list[str], value: int
) -> tuple[list[int], int]:
    """``(ids, first assignment's start)``: ``length`` tokens of filler with the chain's assignments
    at sentence boundaries from ``depth`` on, in order, then the question."""
    chain = [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
    statements = [f"VAR {names[0]} = {value}.", *chain]
    texts = [_encode(tokenizer, " " + s) for s in statements]
    question = _encode(tokenizer, " " + VT_QUESTION.format(value=value, count=len(names)))
    prefix = _prefix(tokenizer)
    room = length - len(prefix) - sum(map(len, texts)) - len(question)
    if room < 0:
        raise ValueError(
            f"a variable-tracking prompt needs at least {length - room} tokens, got length {length}"
        )
    filler, boundaries = filler_tokens(tokenizer, room)
    fractions = [depth + (1.0 - depth) * i / len(texts) for i in range(len(texts))]
    places = []
    for fraction in fractions:  # each at the boundary nearest its fraction, never before the previous one
        later = [b for b in boundaries if not places or b >= places[-1]] or [room]
        places.append(min(later, key=lambda b: (abs(b - fraction * room), b)))
    ids, start, first = list(prefix), 0, 0
    for n, (place, text) in enumerate(zip(places, texts)):
        ids += filler[start:place]
        first = len(ids) if n == 0 else first
        ids += text
        start = place
    return ids + filler[start:] + question, first


def vt_right(answer: str, names: list[str]) -> bool:
    """Every variable of the chain is named in the answer (RULER's ``string_match_all`` at 1.0)."""
    return all(name in answer for name in names)


# ---------------------------------------------------------------------------- JSON key-value


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _object_text(pairs: list[tuple[str, str]]) -> str:
    return json.dumps(dict(pairs), indent=0)


def json_kv_prompt(tokenizer: Any, length: int, depth: float, rng: random.Random) -> tuple[list[int], str]:
    """``(ids, the asked value)``: ``length`` tokens: filler, the preamble, a JSON object of UUID pairs
    (as many as fit; the asked one at ``depth`` among them), then the question for the asked key."""
    prefix = _prefix(tokenizer)
    pairs: list[tuple[str, str]] = [(_uuid(rng), _uuid(rng))]
    key_question = _encode(tokenizer, "\n" + JSON_QUESTION.format(key=pairs[0][0]))
    preamble = _encode(tokenizer, " " + JSON_PREAMBLE + "\n")

    def size(candidate: list[tuple[str, str]]) -> int:
        return (
            len(prefix) + len(preamble) + len(_encode(tokenizer, _object_text(candidate))) + len(key_question)
        )

    if size(pairs) > length:
        raise ValueError(f"a JSON key-value prompt needs at least {size(pairs)} tokens, got length {length}")
    while True:  # one more pair while it still fits (each pair is the same size in tokens, about)
        candidate = [*pairs, (_uuid(rng), _uuid(rng))]
        if size(candidate) > length:
            break
        pairs = candidate
    asked, others = pairs[0], pairs[1:]
    while True:  # the order can tokenize a token longer at a joint: drop a pair until it fits
        at = round(depth * len(others))
        body = _encode(tokenizer, _object_text([*others[:at], asked, *others[at:]]))
        rest = length - len(prefix) - len(preamble) - len(body) - len(key_question)
        if rest >= 0 or not others:
            break
        others = others[:-1]
    filler, _ = filler_tokens(tokenizer, max(rest, 0))
    return prefix + filler + preamble + body + key_question, asked[1]


def json_kv_right(answer: str, value: str) -> bool:
    """The asked value appears in the answer (HELMET's substring exact match)."""
    return value in answer
