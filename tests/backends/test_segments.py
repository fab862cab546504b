"""The segments backend (posenc.backends.segments): each block's keys split by the mask into anticausal, full
and causal segments (or one masked band per block) and merged by log-sum-exp, against eager and the mask's
own rows."""

from __future__ import annotations

import pytest
import torch

import posenc
from _backend_scenarios import (
    SCENARIOS,
    TOLERANCE,
    _example,
    _layer,
    _request,
    _run,
    _run_fn,
    _scenario_fits,
)
from posenc.backends import AttentionRequest, get_backend, segments
from posenc.backends.segments import segment_attention
from posenc.encodings.base import Kind
from posenc.masks.attention_mask import AttentionMask


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


# ----------------------------------------------------------------------------
# Exact splits (the near_far and segments backends) against the eager reference, and the declarations they
# use.


HEADS, DIM = 2, 8


def test_segment_engine_is_chosen_for_windows_and_matches_eager():
    layer = posenc.MultiheadAttention(HEADS * DIM, HEADS, encoding="rope", causal=True, window=64).double()
    x = torch.randn(2, 700, HEADS * DIM, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    assert layer.last_backend == "segments"
    (grad,) = torch.autograd.grad(out.sum(), x)
    with posenc.use_backend("eager"):
        ref = layer(x)
        (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(out, ref, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-8, atol=1e-10)


def test_segment_engine_propagates_nothing_from_hidden_rows():
    """Rows that see no key are zeros and send no gradient (the one rule of every backend)."""
    enc = posenc.build("nope")
    q, k, v = (torch.randn(1, HEADS, 40, DIM, requires_grad=True) for _ in range(3))
    pad = torch.zeros(1, 40, dtype=torch.bool)
    pad[0, :6] = True
    pos = torch.arange(40)[None]
    req = AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.3, causal=True, key_padding_mask=pad
    )
    out = segment_attention(req, block=8)
    assert bool((out[0, :, :6] == 0).all())
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert bool((dq[0, :, :6] == 0).all())


def test_segment_analysis_is_shared_by_content_never_by_shape():
    """Masks with the same document ids reuse one analysis (every layer of a model); other ids of the
    same shape get their own (a cache keyed by shape alone would attend across documents)."""
    enc = posenc.build("nope")
    q, k, v = (torch.randn(1, HEADS, 96, DIM, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(96)[None]
    for cut in (40, 40, 57):
        docs = (torch.arange(96) >= cut).long()[None]
        mask = AttentionMask.build(
            q_len=96, k_len=96, batch=1, heads=HEADS, causal=True, q_document_ids=docs, k_document_ids=docs
        )
        req = AttentionRequest(q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.3, mask=mask)
        expected = get_backend("eager").run(req)[0]
        torch.testing.assert_close(segment_attention(req, block=16), expected, rtol=1e-10, atol=1e-12)
