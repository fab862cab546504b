"""Every backend serves the kinds it promises, and agrees with the ``eager`` reference there.

Generated from the registry: :data:`EXPECTED_KINDS` is the hand-written promise of each backend
(the kinds of encoding it must serve). For every registered encoding of such a kind and every
scenario (one token, 37 causal tokens with grouped-query heads, 37 tokens with key padding, 113 x
203 cross-attention, a user mask with rows that see no key) the backend must state **no** reason
for the request, and its output and the gradients of q, k, v and of every parameter (encoding
tables, per-layer projections) must equal eager's, in float64. Pairs that cannot exist (a causal-only
encoding in cross-attention, a table shorter than the scenario) are left out at collection, so a
backend that starts refusing what it promised fails instead of skipping.

FlexAttention on CPU has no backward pass and no float64 (:data:`CPU_LIMITS`): there it is checked
forward-only in float32, through FlexAttention's uncompiled reference (cheap, and it still calls
the encoding's ``bias_at`` pointwise, as the compiled kernel does); the compiled kernel is ``slow``.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from _backend_scenarios import (
    HEADS,
    SCENARIOS,
    TOLERANCE,
    _example,
    _layer,
    _request,
    _run,
    _scenario_fits,
)
from posenc.backends import available_backends, backend_limits, get_backend
from posenc.encodings.base import Kind

#: The kinds each backend promises to serve (eager serves every kind: it is the reference).
EXPECTED_KINDS: dict[str, set[Kind]] = {
    "eager": set(Kind),
    "sdpa": {Kind.ABSOLUTE, Kind.ROTARY, Kind.BIAS},
    "blocked": {Kind.ABSOLUTE, Kind.ROTARY, Kind.BIAS},
    "segments": {Kind.ABSOLUTE, Kind.ROTARY},
    # The near/far and clipped splits serve what an encoding declares (a far constant or separable
    # terms; clipped tables), on square self-attention only: tests/backends/test_near_far.py and
    # tests/backends/test_clipped.py check every declaring encoding against eager.
    "near_far": set(),
    "clipped": set(),
    "relative": {Kind.CONTENT},
    "flex": {Kind.BIAS},
    # PaTH's chunkwise form serves PaTH only, under a causal mask: tests/encodings/test_path.py checks it.
    "householder": set(),
    # The piecewise-RoPE tiles serve the families that declare part_tiles(), square causal
    # self-attention only: tests/backends/test_piecewise.py checks every such family against eager.
    "piecewise": set(),
}

#: Backends that on CPU serve only float32 without gradients (stated as reasons otherwise).
CPU_LIMITS = {"flex"}

#: The kinds each backend promises to serve with attention sinks (sdpa runs them through the CPU
#: flash kernel, which gives a bias no gradient; flex does not take sinks).
SINK_KINDS: dict[str, set[Kind]] = {
    "sdpa": {Kind.ABSOLUTE, Kind.ROTARY},
    "blocked": {Kind.ABSOLUTE, Kind.ROTARY, Kind.BIAS},
    "segments": {Kind.ABSOLUTE, Kind.ROTARY},
    # The near/far and clipped splits serve what an encoding declares (a far constant or separable
    # terms; clipped tables), on square self-attention only: tests/backends/test_near_far.py and
    # tests/backends/test_clipped.py check every declaring encoding against eager.
    "near_far": set(),
    "clipped": set(),
    "relative": {Kind.CONTENT},
}


def _promised(name: str, backend: str) -> bool:
    """An input-dependent encoding (FoX, PaTH) is promised only by the backends of its kind that
    evaluate token states."""
    cls = posenc.get_class(name)
    if cls.input_dependent and not get_backend(backend).serves_input_bias:
        return False
    return cls.kind in EXPECTED_KINDS[backend]


#: Uncompiled FlexAttention still traces with dynamo (about 1 s a case on CPU), so flex meets every
#: scenario with one encoding and every encoding in two scenarios: its mask translation is shared by
#: all encodings, and each encoding's ``bias_at`` is what the others add (a user mask with empty rows
#: and grouped-query heads, where a broadcasting slip in ``bias_at`` shows).
FLEX_EVERY_SCENARIO = "alibi"
FLEX_SCENARIOS = ("causal37_gqa", "masked29")


def _scenarios(name: str, backend: str):
    if backend == "flex" and name != FLEX_EVERY_SCENARIO:
        return FLEX_SCENARIOS
    return tuple(SCENARIOS)


def _cases():
    for name in posenc.available():
        kind = posenc.get_class(name).kind
        for backend in EXPECTED_KINDS:
            if backend == "eager" or not _promised(name, backend):
                continue
            for scenario in _scenarios(name, backend):
                if SCENARIOS[scenario][6] == "sinks" and kind not in SINK_KINDS.get(backend, set()):
                    continue
                if _scenario_fits(name, scenario):
                    yield pytest.param(name, backend, scenario, id=f"{name}-{backend}-{scenario}")


def _check(name: str, backend: str, scenario: str, monkeypatch, compiled: bool = False) -> None:
    causal, kv_heads = SCENARIOS[scenario][3:5]
    # The compiled-shape budget is process-wide state: start from an empty one.
    monkeypatch.setattr("posenc.backends.flex._SEEN_SHAPES", set())
    if _example(name, causal) is None:
        causal = True  # causal-only encodings run the self-attention scenarios causally
    cpu_limited = backend in CPU_LIMITS
    dtype, grads = (torch.float32, False) if cpu_limited else (torch.float64, True)
    layer = _layer(name, causal, kv_heads, dtype)
    req = _request(layer, scenario, causal, dtype, grads)
    context = torch.enable_grad() if grads else torch.no_grad()
    with context:
        # backend_limits, as dispatch asks: it adds the limits every backend shares (an input bias).
        assert backend_limits(get_backend(backend), req) == [], f"{backend} promised to serve {name}"
        out, got = _run(backend, req, layer, grads, compiled)
        ref, want = _run("eager", req, layer, grads)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, **tolerance)
    names = ["q", "k", "v"] + [n for n, p in layer.named_parameters() if p.requires_grad] + ["sinks"]
    for label, g, w in zip(names, got, want):
        # Biases are float32 by contract, so their parameters' gradients carry float32 rounding.
        grad_tolerance = {"rtol": max(1e-5, tolerance["rtol"]), "atol": max(1e-6, tolerance["atol"])}
        torch.testing.assert_close(g, w, **grad_tolerance, msg=lambda m, label=label: f"grad of {label}: {m}")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name,backend,scenario", list(_cases()))
def test_backend_serves_its_kinds_and_matches_eager(name, backend, scenario, monkeypatch):
    _check(name, backend, scenario, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in posenc.available() if posenc.get_class(n).kind is Kind.BIAS])
def test_compiled_flex_matches_eager(name, monkeypatch):
    _check(name, "flex", "causal37_gqa", monkeypatch, compiled=True)


def test_every_backend_states_its_promise():
    """A registered backend missing from EXPECTED_KINDS would go untested: name its kinds above."""
    assert set(available_backends()) == set(EXPECTED_KINDS)
    for device in ("cpu", "cuda"):
        assert set(available_backends(device)) == set(EXPECTED_KINDS)


def test_rows_without_keys_are_zero_on_every_backend():
    """One rule: a query row that sees no key outputs zeros (never a uniform average over future keys)."""
    layer = _layer("alibi", True, HEADS, torch.float64)
    req = _request(layer, "masked29", True, torch.float64, grad=False)
    empty = req.mask.empty_rows()
    assert empty is not None and bool(empty[0, 1, 4, 0]) and bool(empty[1, :, 11].all())
    for backend in ("eager", "sdpa", "blocked"):
        out, _ = get_backend(backend).run(req)
        assert (out[0, 1, 4] == 0).all() and (out[1, :, 11] == 0).all(), backend
        assert bool(out.abs().sum(-1)[~empty[..., 0].expand(2, HEADS, 29)].gt(0).all()), backend
