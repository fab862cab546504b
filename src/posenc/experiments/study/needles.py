"""The study's needle tasks (:data:`NEEDLES`): how each makes one trial's prompt, how long its answer
may be, when greedy decoding stops and what counts as right. Passkey, multi-key (NIAH), RULER's
variable tracking and HELMET's JSON key-value retrieval; the prompts are :mod:`posenc.experiments.tasks`'.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Imported by name, so _run_unit looks them up here (a test replaces hf_study.greedy_answer).
from ..tasks.haystack import VT_HOPS, json_kv_prompt, json_kv_right, vt_prompt, vt_right, vt_trial
from ..tasks.text import (
    KEY_DIGITS,
    VALUE_DIGITS,
    answer_is_right,
    multikey_prompt,
    multikey_trial,
    passkey_prompt,
)

__all__ = ["NEEDLES", "Needle"]


@dataclass(frozen=True)
class Needle:
    """One needle task of the study: its records' ``task``, how one trial's prompt is made
    (``prompt(tokenizer, length, depth, rng) -> (ids, the number the answer must give)``) and how
    many tokens the answer may take."""

    task: str
    prompt: Callable[[Any, int, float, random.Random], tuple[list[int], Any]]
    steps: int
    #: The trial's random stream is named ``f"{salt}{seed}-{length}-{depth}-{trial}"``.
    salt: str = ""
    #: ``right(answer text, expected) -> bool``: the passkey's exact match of the first digits by default.
    right: Callable[[str, Any], bool] = answer_is_right
    #: Greedy decoding stops once the answer so far matches this: a run of digits and one more
    #: character for the number needles; a line break after some text for the others.
    stop_at: str = r"\d+\D"


def _passkey_trial(tokenizer: Any, length: int, depth: float, rng: random.Random) -> tuple[list[int], int]:
    key = rng.randrange(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS)
    return passkey_prompt(tokenizer, length, depth, key)[0], key


def _multikey_trial(tokenizer: Any, length: int, depth: float, rng: random.Random) -> tuple[list[int], int]:
    needles, distractor_depths = multikey_trial(rng)
    return multikey_prompt(tokenizer, length, depth, needles, distractor_depths)[0], needles[0][1]


def _vt_trial(tokenizer: Any, length: int, depth: float, rng: random.Random) -> tuple[list[int], list[str]]:
    names, value = vt_trial(rng)
    return vt_prompt(tokenizer, length, depth, names, value)[0], names


def _json_trial(tokenizer: Any, length: int, depth: float, rng: random.Random) -> tuple[list[int], str]:
    return json_kv_prompt(tokenizer, length, depth, rng)


#: The needle tasks by :data:`.plan.TASK_PARTS` name.
NEEDLES: dict[str, Needle] = {
    "passkey": Needle("text-passkey", _passkey_trial, KEY_DIGITS + 2),
    "multikey": Needle("text-multikey", _multikey_trial, VALUE_DIGITS + 3, salt="multikey-"),
    "vt": Needle("text-vt", _vt_trial, 8 * (VT_HOPS + 1), salt="vt-", right=vt_right, stop_at=r"\S[^\n]*\n"),
    "jsonkv": Needle(
        "text-jsonkv", _json_trial, 40, salt="jsonkv-", right=json_kv_right, stop_at=r"\S[^\n]*\n"
    ),
}
