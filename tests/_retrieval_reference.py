"""Independent readers of the retrieval tasks' examples, written from the format in the docs only.

Alphabets (as documented in posenc.experiments.tasks.retrieval): symbol ids start at 4; the first symbol
is the marker; passkey and niah then have ``ceil((num_symbols - 1) / 2)`` answer symbols and the
rest is filler; mqar has keys in the first half of the symbols and values in the second.
"""

from __future__ import annotations

FIRST = 4
MARK = FIRST


def answer_symbols(num_symbols: int) -> range:
    """Keys and values of passkey and niah (the filler comes after them)."""
    rest = num_symbols - 1
    return range(FIRST + 1, FIRST + 1 + rest - rest // 2)


def passkey_parts(x: list[int], num_symbols: int) -> tuple[list[int], int, int]:
    """``(key, depth, filler count)`` of a passkey input ``x``."""
    assert x.count(MARK) == 2 and x[-1] == MARK, "one needle marker and the question marker"
    start = x.index(MARK)
    answers = answer_symbols(num_symbols)
    key = []
    for symbol in x[start + 1 : -1]:
        if symbol not in answers:
            break
        key.append(symbol)
    filler = [s for s in x[:start] + x[start + 1 + len(key) : -1]]
    assert all(FIRST + num_symbols > s >= answers.stop for s in filler), "filler from its own alphabet"
    return key, start, len(filler)


def expected_answer(name: str, x: list[int], num_symbols: int) -> list[int]:
    """The right ``y`` for input ``x`` of retrieval task ``name``."""
    if name == "passkey":
        return passkey_parts(x, num_symbols)[0]
    if name == "mqar":
        half = num_symbols // 2
        is_value = lambda s: FIRST + half <= s < FIRST + 2 * half  # noqa: E731
        pairs, i = {}, 0
        while i + 1 < len(x) and is_value(x[i + 1]):
            assert x[i] not in pairs, "keys are distinct"
            pairs[x[i]] = x[i + 1]
            i += 2
        queries = x[i:]
        assert len(set(queries)) == len(queries), "each key is asked at most once"
        return [pairs[q] for q in queries]
    if name == "niah":
        marks = [i for i, s in enumerate(x) if s == MARK]
        needles = {x[i + 1]: x[i + 2] for i in marks[:-1]}
        assert len(needles) == len(marks) - 1, "needle keys are distinct"
        return [needles[q] for q in x[marks[-1] + 1 :]]
    raise AssertionError(name)
