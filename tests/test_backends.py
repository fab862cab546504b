"""Every (registered encoding, backend) pair that can run agrees with the ``eager`` reference.

Generated from the registry and the backend list, so new encodings and backends are covered
without editing this file. For each pair and each scenario (one token, 37 causal tokens with
grouped-query heads, 37 tokens with key padding, 113 x 203 cross-attention) the backend's output
and the gradients of q, k, v and of every parameter (encoding tables, per-layer projections)
must equal eager's, in float64. A pair whose backend states reasons is skipped with those reasons;
a backend that can only run without gradients (flex on CPU) is checked forward-only. Compiled
flex pairs are slow (one compilation each) and marked ``slow``.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.backends import AttentionRequest, available_backends, get_backend
from posenc.examples import build_example

HEADS, HEAD_DIM = 2, 8
SCENARIOS = {
    # name: (batch, q_len, k_len, causal, kv_heads, padded); causal-only encodings run the
    # self-attention scenarios causally (padded37 then has fully masked query rows).
    "single": (2, 1, 1, True, HEADS, False),
    "causal37_gqa": (2, 37, 37, True, 1, False),
    "padded37": (2, 37, 37, False, HEADS, True),
    "cross113x203": (2, 113, 203, False, HEADS, False),
}
SLOW_BACKENDS = {"flex"}  # each case compiles


def _cases():
    for name in posenc.available():
        for backend in available_backends():
            if backend == "eager":
                continue
            marks = [pytest.mark.slow] if backend in SLOW_BACKENDS else []
            for scenario in SCENARIOS:
                yield pytest.param(name, backend, scenario, marks=marks, id=f"{name}-{backend}-{scenario}")


def _layer(name: str, causal: bool, kv_heads: int) -> posenc.MultiheadAttention:
    enc = build_example(name, num_heads=HEADS, head_dim=HEAD_DIM)
    layer = posenc.MultiheadAttention(
        HEADS * HEAD_DIM, HEADS, encoding=enc, causal=causal, num_kv_heads=kv_heads
    )
    with torch.no_grad():  # zero-initialised tables would hide position terms
        for param in layer.encoding.parameters():
            if param.numel() and bool((param == 0).all()):
                param.normal_(0.0, 0.5)
    return layer.double()


def _request(layer, scenario: str, causal: bool, dtype: torch.dtype = torch.float64) -> AttentionRequest:
    batch, q_len, k_len, _, kv_heads, padded = SCENARIOS[scenario]
    enc = layer.encoding
    if causal and q_len != k_len:
        pytest.skip("causal cross-attention is not a scenario")
    if enc.max_positions is not None and max(q_len, k_len) > enc.max_positions:
        pytest.skip(f"{enc.name} has max_positions={enc.max_positions}")
    q = torch.randn(batch, HEADS, q_len, HEAD_DIM, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, k_len, HEAD_DIM, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, k_len, HEAD_DIM, dtype=dtype, requires_grad=True)
    padding = None
    if padded:
        padding = torch.zeros(batch, k_len, dtype=torch.bool)
        padding[1, :5] = True  # left padding of the second sequence
    return AttentionRequest(
        q=q,
        k=k,
        v=v,
        encoding=enc,
        q_pos=torch.arange(q_len)[None],
        k_pos=torch.arange(k_len)[None],
        scale=layer.scale,
        causal=causal,
        key_padding_mask=padding,
        layer=layer,
    )


TOLERANCE = {torch.float64: {"rtol": 1e-6, "atol": 1e-8}, torch.float32: {"rtol": 1e-4, "atol": 1e-5}}


def _runnable_request(runner, layer, scenario: str, causal: bool):
    """The request in float64 if the backend allows it, else float32; with gradients if allowed.

    Skips (with the backend's reasons) when it can run neither.
    """
    first_reasons = None
    for dtype in (torch.float64, torch.float32):
        layer.to(dtype)
        req = _request(layer, scenario, causal, dtype)
        reasons = runner.reasons(req)
        if not reasons:
            return req, True, TOLERANCE[dtype]
        with torch.no_grad():
            if not runner.reasons(req):
                return req, False, TOLERANCE[dtype]  # e.g. flex on CPU: forward only
        first_reasons = first_reasons or reasons
    pytest.skip(f"{runner.name} cannot run {layer.encoding.name}: " + "; ".join(first_reasons))


def _run(backend: str, req: AttentionRequest, layer, grads: bool):
    out, _ = get_backend(backend).run(req)
    if not grads:
        return out.detach(), []
    inputs = [req.q, req.k, req.v] + [p for p in layer.parameters() if p.requires_grad]
    weight = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view_as(out)
    found = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    return out.detach(), [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, found)]


@pytest.mark.parametrize("name,backend,scenario", list(_cases()))
def test_backend_matches_eager(name, backend, scenario):
    _batch, q_len, k_len, causal, kv_heads, _padded = SCENARIOS[scenario]
    try:
        layer = _layer(name, causal, kv_heads)
    except ValueError as err:  # causal-only encodings (alibi mode='causal', kerple, ...)
        if q_len != k_len:
            pytest.skip(f"{name} refuses this layer: {err}")
        causal = True
        layer = _layer(name, causal, kv_heads)
    req, grads, tolerance = _runnable_request(get_backend(backend), layer, scenario, causal)
    context = torch.enable_grad() if grads else torch.no_grad()
    with context:
        out, got = _run(backend, req, layer, grads)
        ref, want = _run("eager", req, layer, grads)
    torch.testing.assert_close(out, ref, **tolerance)
    names = ["q", "k", "v"] + [n for n, p in layer.named_parameters() if p.requires_grad]
    for label, g, w in zip(names, got, want):
        # Biases are float32 by contract, so their parameters' gradients carry float32 rounding.
        grad_tolerance = {"rtol": max(1e-5, tolerance["rtol"]), "atol": max(1e-6, tolerance["atol"])}
        torch.testing.assert_close(g, w, **grad_tolerance, msg=lambda m, label=label: f"grad of {label}: {m}")


def test_every_backend_is_exercised():
    """The generator sees every backend; a new one without cases would be a silent gap."""
    seen = {param.values[1] for param in _cases()}
    assert seen == set(available_backends()) - {"eager"}
