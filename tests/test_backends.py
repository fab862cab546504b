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
from posenc.backends import AttentionRequest, available_backends, backend_limits, get_backend, segments
from posenc.backends.flex import flex_bias_attention
from posenc.backends.segments import segment_attention
from posenc.encodings.base import Kind, TokenStates
from posenc.examples import build_example
from posenc.masks.attention_mask import AttentionMask

HEADS, HEAD_DIM = 2, 8

#: The kinds each backend promises to serve (eager serves every kind: it is the reference).
EXPECTED_KINDS: dict[str, set[Kind]] = {
    "eager": set(Kind),
    "sdpa": {Kind.ABSOLUTE, Kind.ROTARY, Kind.BIAS},
    "blocked": {Kind.ABSOLUTE, Kind.ROTARY, Kind.BIAS},
    "segments": {Kind.ABSOLUTE, Kind.ROTARY},
    # The near/far and clipped splits serve what an encoding declares (a far constant or separable
    # terms; clipped tables), on square self-attention only: tests/test_split.py and
    # tests/test_clipped.py check every declaring encoding against eager.
    "near_far": set(),
    "clipped": set(),
    "relative": {Kind.CONTENT},
    "flex": {Kind.BIAS},
    # PaTH's chunkwise form serves PaTH only, under a causal mask: tests/test_path.py checks it.
    "householder": set(),
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
    # terms; clipped tables), on square self-attention only: tests/test_split.py and
    # tests/test_clipped.py check every declaring encoding against eager.
    "near_far": set(),
    "clipped": set(),
    "relative": {Kind.CONTENT},
}

SCENARIOS = {
    # name: (batch, q_len, k_len, causal, kv_heads, padded, mask); causal-only encodings run the
    # self-attention scenarios causally (padded37 then has query rows that see no key).
    "single": (2, 1, 1, True, HEADS, False, None),
    "causal37_gqa": (2, 37, 37, True, 1, False, None),
    "padded37": (2, 37, 37, False, HEADS, True, None),
    "cross113x203": (2, 113, 203, False, HEADS, False, None),
    "masked29": (2, 29, 29, True, HEADS, False, "bool_and_minus_inf"),
    "sinks_gqa29": (2, 29, 29, True, 1, True, "sinks"),
    # A sliding window and packed documents (blocked skips keys outside each block's range).
    "window_documents41": (2, 41, 41, True, HEADS, False, "window_documents"),
    # Issue 36's masks: a bidirectional window over a left-padded batch, Gemma 3's image groups
    # under a sliding window, Llama 4's chunks counted from each row's first real token.
    "band_padded37": (2, 37, 37, False, HEADS, True, "band"),
    "groups_window29": (2, 29, 29, True, HEADS, True, "groups_window"),
    "chunks_padded33": (2, 33, 33, True, 1, True, "chunks"),
}

#: The group ids of the ``groups_window`` scenario: two images in the first row, one in the second.
_GROUPS = torch.tensor([[-1] * 3 + [0] * 6 + [-1] * 4 + [1] * 9 + [-1] * 7, [-1] * 12 + [0] * 11 + [-1] * 6])


def _example(name: str, causal: bool):
    """The example encoding for a layer of the test's size, or None where the layer refuses it."""
    enc = build_example(name, num_heads=HEADS, head_dim=HEAD_DIM)
    return None if enc.causal_only and not causal else enc


def _scenario_fits(name: str, scenario: str) -> bool:
    _, q_len, k_len, causal, *_ = SCENARIOS[scenario]
    enc = _example(name, causal) or (_example(name, True) if q_len == k_len else None)
    if enc is not None and enc.self_attention_only and scenario.startswith("cross"):
        return False
    return enc is not None and (enc.max_positions is None or max(q_len, k_len) <= enc.max_positions)


def _promised(name: str, backend: str) -> bool:
    """An input-dependent encoding (FoX, PaTH) is promised only by the backends of its kind that
    evaluate token states."""
    cls = posenc.get_class(name)
    if cls.input_dependent and not get_backend(backend).serves_input_bias:
        return False
    return cls.kind in EXPECTED_KINDS[backend]


def _cases():
    for name in posenc.available():
        kind = posenc.get_class(name).kind
        for backend in EXPECTED_KINDS:
            if backend == "eager" or not _promised(name, backend):
                continue
            for scenario in SCENARIOS:
                if SCENARIOS[scenario][6] == "sinks" and kind not in SINK_KINDS.get(backend, set()):
                    continue
                if _scenario_fits(name, scenario):
                    yield pytest.param(name, backend, scenario, id=f"{name}-{backend}-{scenario}")


def _layer(name: str, causal: bool, kv_heads: int, dtype: torch.dtype) -> posenc.MultiheadAttention:
    enc = build_example(name, num_heads=HEADS, head_dim=HEAD_DIM)
    layer = posenc.MultiheadAttention(
        HEADS * HEAD_DIM, HEADS, encoding=enc, causal=causal, num_kv_heads=kv_heads
    )
    with torch.no_grad():  # zero-initialised tables would hide position terms
        for param in layer.encoding.parameters():
            if param.numel() and bool((param == 0).all()):
                param.normal_(0.0, 0.5)
    return layer.to(dtype)


def _user_mask(batch: int, q_len: int, k_len: int, dtype: torch.dtype) -> torch.Tensor:
    """A float mask with random values, keys hidden by -inf, and rows that see no key."""
    mask = torch.randn(batch, HEADS, q_len, k_len, dtype=dtype)
    mask[torch.rand(batch, HEADS, q_len, k_len) > 0.7] = float("-inf")
    mask[0, 1, 4] = float("-inf")  # a whole row hidden
    mask[1, :, 11] = float("-inf")
    return mask


def _request(layer, scenario: str, causal: bool, dtype: torch.dtype, grad: bool) -> AttentionRequest:
    batch, q_len, k_len, _, kv_heads, padded, mask = SCENARIOS[scenario]
    q = torch.randn(batch, HEADS, q_len, HEAD_DIM, dtype=dtype, requires_grad=grad)
    k = torch.randn(batch, kv_heads, k_len, HEAD_DIM, dtype=dtype, requires_grad=grad)
    v = torch.randn(batch, kv_heads, k_len, HEAD_DIM, dtype=dtype, requires_grad=grad)
    padding = None
    if padded:
        padding = torch.zeros(batch, k_len, dtype=torch.bool)
        padding[1, :5] = True  # left padding of the second sequence
    pattern = {}
    if mask == "window_documents":
        docs = torch.tensor([[0] * 17 + [1] * 24, [0] * 3 + [2] * 30 + [5] * 8])
        pattern = {"mask": AttentionMask.build(
            q_len=q_len, k_len=k_len, batch=batch, heads=HEADS, causal=causal, window=6,
            q_document_ids=docs, k_document_ids=docs,
        )}  # fmt: skip
    pattern_masks = {
        "band": {"window": 4},
        "groups_window": {"window": 5, "group_ids": _GROUPS},
        "chunks": {"chunk": 6},
    }
    if mask in pattern_masks:
        pattern = {"mask": AttentionMask.build(
            q_len=q_len, k_len=k_len, batch=batch, heads=HEADS, causal=causal, key_padding_mask=padding,
            **pattern_masks[mask],
        )}  # fmt: skip
    if layer.encoding.input_dependent:  # FoX: the states of one sequence's layer input
        x = torch.randn(batch, q_len, HEADS * HEAD_DIM, dtype=dtype)
        pattern["token_states"] = TokenStates.same_sequence(layer.encoding.token_states(x))
    if "mask" not in pattern:  # a built mask, or the keywords that describe one
        pattern["key_padding_mask"] = padding
        pattern["attn_mask"] = (
            _user_mask(batch, q_len, k_len, dtype) if mask == "bool_and_minus_inf" else None
        )
        pattern["causal"] = causal
    make = AttentionRequest if "mask" in pattern else AttentionRequest.from_keywords
    return make(
        **pattern,
        q=q,
        k=k,
        v=v,
        encoding=layer.encoding,
        q_pos=torch.arange(q_len)[None],
        k_pos=torch.arange(k_len)[None],
        scale=layer.scale,
        layer=layer,
        sinks=torch.randn(HEADS, dtype=dtype, requires_grad=grad) if mask == "sinks" else None,
    )


TOLERANCE = {torch.float64: {"rtol": 1e-6, "atol": 1e-8}, torch.float32: {"rtol": 1e-4, "atol": 1e-5}}


def _run(backend: str, req: AttentionRequest, layer, grads: bool, compiled: bool = True):
    if backend == "flex" and not compiled:
        out = flex_bias_attention(req, compiled=False)
    else:
        out, _ = get_backend(backend).run(req)
    if not grads:
        return out.detach(), []
    inputs = [req.q, req.k, req.v] + [p for p in layer.parameters() if p.requires_grad]
    if req.sinks is not None:
        inputs.append(req.sinks)
    weight = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view_as(out)
    # retain_graph: the request's token states (FoX) feed both runs through one graph.
    found = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True, retain_graph=True)
    return out.detach(), [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, found)]


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


def _segment_cases():
    for name in posenc.available():
        if posenc.get_class(name).kind in (Kind.ABSOLUTE, Kind.ROTARY):
            for scenario in SCENARIOS:
                if _scenario_fits(name, scenario):
                    yield pytest.param(name, scenario, id=f"{name}-{scenario}")


@pytest.mark.parametrize("mode", ["bands", "segments"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name,scenario", list(_segment_cases()))
def test_blocked_split_by_mask_segments_matches_eager(name, scenario, dtype, mode, monkeypatch):
    """The blocked backend's split mode for kinds without a bias (each block's keys as one masked band,
    or as anticausal / full / causal segments; merged by log-sum-exp) on every scenario, blocks of 8
    so each has several segments."""
    monkeypatch.setattr(segments, "SEGMENT_MODE", mode)
    causal, kv_heads = SCENARIOS[scenario][3:5]
    causal = causal or _example(name, causal) is None  # causal-only encodings run causally, as above
    layer = _layer(name, causal, kv_heads, dtype)
    req = _request(layer, scenario, causal, dtype, grad=True)
    out, got = _run_fn(lambda r: segment_attention(r, block=8), req, layer)
    ref, want = _run("eager", req, layer, grads=True)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, **tolerance)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tolerance)


@pytest.mark.parametrize("mode", ["bands", "segments"])
@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if _scenario_fits("rope", s)])
def test_segment_groups_in_pieces_match_eager(scenario, mode, monkeypatch):
    """In the backward, a group of blocks larger than MAX_CALL_BYTES runs as several kernel calls (here
    one block per call); forward and gradients stay those of eager. Bands cover each row once and
    skip the forward's merge."""
    monkeypatch.setattr(segments, "SEGMENT_MODE", mode)
    monkeypatch.setattr(segments, "MAX_CALL_BYTES", 1)
    calls = []
    real = segments.flash_backward
    monkeypatch.setattr(
        segments, "flash_backward", lambda *a, **kw: calls.append(a[1].shape[0]) or real(*a, **kw)
    )
    causal, kv_heads = SCENARIOS[scenario][3:5]
    layer = _layer("rope", causal, kv_heads, torch.float64)
    req = _request(layer, scenario, causal, torch.float64, grad=True)
    out, got = _run_fn(lambda r: segment_attention(r, block=8), req, layer)
    ref, want = _run("eager", req, layer, grads=True)
    assert calls and max(calls) == 1  # every call is one block
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.float64])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOLERANCE[torch.float64])


def test_window_bands_cover_each_row_once():
    """A window's bands give each query row one part (no merge); the segments mode gives it several."""
    mask = AttentionMask.build(q_len=64, k_len=64, batch=1, heads=1, causal=True, window=12)
    bands = segments.segment_groups(mask, 1, block=8)
    assert segments._each_row_once(bands, 1, 64)
    mask = AttentionMask.build(q_len=64, k_len=64, batch=1, heads=1, causal=True, window=12)
    previous, segments.SEGMENT_MODE = segments.SEGMENT_MODE, "segments"
    try:
        parts = segments.segment_groups(mask, 1, block=8)
    finally:
        segments.SEGMENT_MODE = previous
    assert not segments._each_row_once(parts, 1, 64)


def _run_fn(fn, req: AttentionRequest, layer):
    out = fn(req)
    inputs = [req.q, req.k, req.v] + [p for p in layer.parameters() if p.requires_grad]
    if req.sinks is not None:
        inputs.append(req.sinks)
    weight = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view_as(out)
    found = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    return out.detach(), [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, found)]


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
