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

from posenc.backends import _memo, get_backend, register_backend, select_backend, use_backend
from posenc.backends.dispatch import PRIORITY, set_priority
from posenc.masks import AttentionMask
from test_dispatch_grid import EXPECTED, build

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

    _memo.bump()
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
    _memo.bump()  # forget what earlier tests asked
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
