"""``select_backend`` remembers its choice per request signature (issue 23, item 2).

The memo must never change which backend is chosen: a grid of requests, each asked with finite
values and with nan (in both orders), with and without grad, compares the remembered choice with a
fresh full selection. ``set_priority``, ``register_backend`` and ``use_backend`` change the answer
at once, and a repeated signature asks no backend again (counted, not timed).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _dispatch_grid import EXPECTED, build
from posenc.backends import get_backend, memo, register_backend, select_backend, use_backend
from posenc.backends.dispatch import PRIORITY, set_priority
from posenc.encodings.base import Kind as posenc_kind
from posenc.masks.attention_mask import AttentionMask

DECODE = "rope|1|causal|offset=255"

CASES = [
    *EXPECTED,
    "rope|700|causal|nan",
    "rope|700|causal|offset=20",
    "rope|300|causal|sinks",
    "rope|300|causal|sinks|dropout",
    "rope|300|dropout",
    "rope|128|causal|bfloat16",
    "nope|700|causal",
    DECODE,
    f"{DECODE}|sinks",
    f"{DECODE}|dropout",
    f"{DECODE}|float64",
    "nope|1|causal|offset=600",
    "alibi|1|causal|offset=255",
    "shaw:k=16|1|causal|offset=255",
]


def variant(case: str, nan: bool, grad: bool, weights: bool = False, float_mask: bool = False):
    """``build(case)`` with nan in q or not, q requiring grad or not, need_weights, a float mask."""
    req = build(case.replace("|nan", ""))
    q = req.q.detach().clone()
    if nan:
        q[0, 0, -1, 0] = float("nan")
    changes: dict = {"q": q.requires_grad_(grad), "mask": None if float_mask else req.mask}
    changes["need_weights"] = weights
    if float_mask:
        b, h, tq, tk = req.q.shape[0], req.q.shape[1], req.q_len, req.k_len
        offset = req.mask.causal_offset  # None: no causal component (every key visible), as built
        changes["mask"] = AttentionMask.build(
            q_len=tq,
            k_len=tk,
            batch=b,
            heads=h,
            causal=offset is not None,
            causal_offset=offset or 0,
            attn_mask=torch.zeros(b, h, tq, tk, requires_grad=grad),
        )
    return dataclasses.replace(req, **changes)


def fresh_choice(make) -> str:
    from posenc.backends import _select, requested_backend

    return _select(make(), requested_backend("auto")).name


def remembered_choice(make) -> str:
    return select_backend(make()).name


def ask(make) -> None:
    with torch.set_grad_enabled(make.grad):
        assert remembered_choice(make) == fresh_choice(make), make.label


class Maker:
    def __init__(self, case, nan, grad, **options):
        self.case, self.nan, self.grad, self.options = case, nan, grad, options
        self.label = f"{case} nan={nan} grad={grad} {options}"

    def __call__(self):
        return variant(self.case, self.nan, self.grad, **self.options)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("first_nan", [False, True])
def test_remembered_choice_equals_a_full_selection(case, first_nan):

    memo.bump()
    order = [first_nan, not first_nan, first_nan]
    for grad in (False, True):
        for nan in order:
            ask(Maker(case, nan, grad))
        for options in ({"weights": True}, {"float_mask": True}):
            for nan in order:
                ask(Maker(case, nan, grad, **options))


def test_use_backend_set_priority_and_register_backend_change_the_choice():
    make = Maker(DECODE, nan=False, grad=False)
    with torch.no_grad():
        assert select_backend(make()).name == "sdpa"
        with use_backend("eager"):
            assert select_backend(make()).name == "eager"
        assert select_backend(make()).name == "sdpa"
        before = PRIORITY["cpu"]
        try:
            set_priority("cpu", ("eager", *(n for n in before if n != "eager")))
            assert select_backend(make()).name == "eager"
        finally:
            set_priority("cpu", before)
        assert select_backend(make()).name == "sdpa"
        sdpa = get_backend("sdpa")

        class Refusing:
            name = "sdpa"

            def reasons(self, request):
                return ["refuses everything"]

            def declines(self, request):
                return []

            def run(self, request):
                raise AssertionError("never runs")

        try:
            register_backend(Refusing())
            assert select_backend(make()).name == "eager"
        finally:
            register_backend(sdpa)
        assert select_backend(make()).name == "sdpa"


@pytest.mark.parametrize("edit", ["tuple", "list"])
def test_a_direct_edit_of_priority_changes_the_remembered_choice(monkeypatch, edit):
    """``PRIORITY`` edited in place (no set_priority, so no bump) after a choice was remembered: the
    memo answers as a fresh full selection does, and again once the edit is undone."""
    make = Maker(DECODE, nan=False, grad=False)
    before = PRIORITY["cpu"]
    eager_first = ("eager", *(n for n in before if n != "eager"))
    with torch.no_grad():
        assert remembered_choice(make) == fresh_choice(make) == "sdpa"
        monkeypatch.setitem(PRIORITY, "cpu", eager_first if edit == "tuple" else list(eager_first))
        assert fresh_choice(make) == "eager"
        assert remembered_choice(make) == "eager"
        monkeypatch.setitem(PRIORITY, "cpu", before)
        assert remembered_choice(make) == fresh_choice(make) == "sdpa"


def test_a_repeated_signature_asks_no_backend_again(monkeypatch):
    calls = []
    from posenc.backends import available_backends

    for name in available_backends("cpu"):
        backend = get_backend(name)
        for method in ("reasons", "declines"):
            original = getattr(backend, method)

            def counted(request, _original=original, _name=f"{name}.{method}"):
                calls.append(_name)
                return _original(request)

            monkeypatch.setattr(backend, method, counted)
    memo.bump()  # forget what earlier tests asked
    with torch.no_grad():
        first = select_backend(build(DECODE))
        assert calls, "the first request of a signature asks the backends"
        calls.clear()
        for _ in range(5):
            assert select_backend(build(DECODE)) is first
        assert calls == []
        nan = build(DECODE)
        nan.q[0, 0, 0, 0] = float("nan")
        assert select_backend(nan).name == "eager"  # nan on CPU: the full selection, not the memo


GROWING = [
    "rope|1|causal",
    "nope|1|causal",
    "sinusoidal|1|causal",
    "rope|1",
    "rope|1|causal|sinks",
    "rope|1|causal|float64",
    "rope|37|causal",
    "rope|300|causal",
    "nope|300",
]


@pytest.mark.parametrize("case", GROWING)
def test_the_memo_answers_as_a_full_selection_while_the_keys_grow(case, monkeypatch):
    """A decode step's keys grow by one each token; small CPU requests are remembered whatever their
    key count (posenc.backends.memo): across key counts on both sides of the size threshold where the
    query-block backends stop declining, and with nan on one step, the memo answers as a full selection."""
    from posenc.backends.parts import query_blocks as _query_blocks

    monkeypatch.setattr(_query_blocks, "MIN_AUTO_LOGITS", 64 * 64)  # the threshold within reach
    spec, length, *options = case.split("|")
    memo.bump()
    offsets = [*range(0, 40, 3), *range(4096 // int(length) - int(length) - 3, 4096 // int(length) + 5)]
    with torch.no_grad():
        for offset in sorted({o for o in offsets if o >= 0}):
            for nan in (False, True, False) if offset == 9 else (False,):
                step = "|".join([spec, length, *options, f"offset={offset}"] + (["nan"] if nan else []))
                make = Maker(step, nan=nan, grad=False)
                assert remembered_choice(make) == fresh_choice(make), make.label


def test_a_growing_decode_asks_no_backend_after_its_first_step(monkeypatch):
    calls = []
    from posenc.backends import available_backends

    for name in available_backends("cpu"):
        backend = get_backend(name)
        original = backend.reasons

        def counted(request, _original=original, _name=name):
            calls.append(_name)
            return _original(request)

        monkeypatch.setattr(backend, "reasons", counted)
    memo.bump()
    with torch.no_grad():
        first = select_backend(build("rope|1|causal|offset=10"))
        assert calls
        calls.clear()
        for offset in range(11, 30):
            assert select_backend(build(f"rope|1|causal|offset={offset}")) is first
        assert calls == []


# ---------------------------------------------------------------------------- declared reads

READ_CASES = [
    *CASES,
    "self_extend:group_size=2,neighbor_window=4|600|causal",
    "self_extend:group_size=2,neighbor_window=4|1|causal|offset=30",
    "string_shift:shift=8,window=2|700|causal|bfloat16",
    "rerope:window=8|600|causal|sinks",
]


class _Recording:
    """A request that notes each field a backend reads (the real request answers)."""

    def __init__(self, request, seen: set[str]) -> None:
        object.__setattr__(self, "_request", request)
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, field: str):
        self._seen.add(field)
        return getattr(self._request, field)


def _requests(case: str):
    for grad in (False, True):
        for options in ({}, {"weights": True}, {"float_mask": True}):
            yield grad, Maker(case, nan=False, grad=grad, **options)


@pytest.mark.parametrize("case", READ_CASES)
def test_every_backend_reads_only_what_it_declares(case):
    """The memo keys on the declared reads (posenc.backends.memo): a backend that reads a field it
    did not declare could be answered from the memo for a request that differs in that field."""
    from posenc.backends import available_backends

    for name in available_backends("cpu"):
        backend = get_backend(name)
        for grad, make in _requests(case):
            with torch.set_grad_enabled(grad):
                request = make()
                if request.kind not in backend.kinds:
                    # the fact agrees with the backend's own limits: it refuses that kind itself
                    assert backend.reasons(request), f"{name} serves {request.kind} but does not declare it"
                    continue
                seen: set[str] = set()
                proxy = _Recording(request, seen)
                backend.reasons(proxy)
                backend.declines(proxy)
                unknown = sorted(seen - set(memo.FIELDS))
                assert unknown == [], f"{name} reads {unknown}: add them to posenc.backends.memo.FIELDS"
                undeclared = sorted({memo.FIELDS[f] for f in seen} - backend.reads)
                assert undeclared == [], (
                    f"{name} reads {undeclared} of {make.label} but declares {sorted(backend.reads)}"
                )


class _Reading:
    """A user backend serving rotary encodings, first in line, refusing odd positions: it reads positions."""

    name = "reads_positions"
    kinds = frozenset({posenc_kind.ROTARY})

    def __init__(self, reads):
        self.reads = reads

    def reasons(self, request):
        return [] if int(request.q_pos[0, 0]) % 2 == 0 else ["odd first position"]

    def declines(self, request):
        return []

    def run(self, request):
        raise AssertionError("not run here")


@pytest.mark.parametrize("reads", [frozenset({"tensors", "positions"}), None])
def test_a_backend_that_reads_positions_or_declares_nothing_turns_the_memo_off(reads):
    from posenc.backends import _BACKENDS, _select, requested_backend

    before = PRIORITY["cpu"]
    try:
        register_backend(_Reading(reads))
        set_priority("cpu", ("reads_positions", *before))
        with torch.no_grad():
            even, odd = build("rope|1|causal|offset=10"), build("rope|1|causal|offset=11")
            assert memo.signature(even, "auto", _BACKENDS) is None
            assert select_backend(even).name == "reads_positions"
            assert select_backend(odd).name == _select(odd, requested_backend("auto")).name == "sdpa"
            assert memo.signature(build("alibi|300|causal"), "auto", _BACKENDS) is None  # bias: positions
            assert memo.signature(build("rope|700|causal"), "auto", _BACKENDS) is None  # its kind
    finally:
        _BACKENDS.pop("reads_positions", None)
        set_priority("cpu", before)
        memo.bump()
    assert memo.signature(build("rope|1|causal|offset=10"), "auto", _BACKENDS) is not None


def test_a_backend_s_declarations_are_checked_when_it_registers():
    bad = _Reading(frozenset({"tensors", "the moon"}))
    with pytest.raises(ValueError, match=r"reads \['the moon'\] are not among tensors"):
        register_backend(bad)
    bad = _Reading(["tensors"])
    with pytest.raises(TypeError, match="reads must be a frozenset"):
        register_backend(bad)
    bad = _Reading(frozenset({"tensors"}))
    bad.kinds = {"rotary"}
    with pytest.raises(TypeError, match="kinds must be a frozenset of Kind"):
        register_backend(bad)


def test_a_kind_a_backend_does_not_serve_gets_one_reason_naming_the_kinds_it_does():
    from posenc.backends import backend_limits

    request = build("shaw:k=16|300|causal")
    assert backend_limits(get_backend("segments"), request) == [
        "serves absolute, rotary encodings only; shaw is content"
    ]
