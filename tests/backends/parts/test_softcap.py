"""Logit soft-capping (Gemma 2): ``s <- c * tanh(s / c)`` on ``q·k·scale`` before the bias, the masks
and the softmax, on every backend that forms each logit (eager, blocked, relative, flex), forward and
backward, in cached decoding; the others (sdpa and the exact splits) state why not.

The reference is the formula written out here in float64 (HF Gemma 2's model is compared in
tests/hf/test_attention.py).
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.backends import SOFTCAP_REASON, AttentionRequest, backend_limits, get_backend, use_backend
from posenc.backends.flex import flex_bias_attention
from posenc.backends.run import attend
from posenc.examples import build_example
from posenc.masks.attention_mask import AttentionMask

HEADS, KV_HEADS, HEAD_DIM, CAP = 4, 2, 8, 0.7


def _reference(q, k, v, scale, cap, bias=None, allowed=None, sinks=None):
    """``softmax(c·tanh(q·kᵀ·scale / c) + bias, hidden keys dropped) v`` in float64, written out."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    s = cap * torch.tanh(s / cap)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        column = sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        p = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return torch.nan_to_num(p, nan=0.0) @ v  # a row that sees no key outputs zeros


def _tensors(batch, q_len, k_len, grad=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(heads: int, n: int) -> torch.Tensor:
        return (3 * torch.randn(batch, heads, n, HEAD_DIM, generator=g, dtype=dtype)).requires_grad_(grad)

    return make(HEADS, q_len), make(KV_HEADS, k_len), make(KV_HEADS, k_len)


def _grads(out, inputs):
    weight = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view_as(out)
    found = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, found)]


TIGHT = {"rtol": 1e-9, "atol": 1e-10}


@pytest.mark.parametrize("encoding", ["nope", "alibi", "t5"])
@pytest.mark.parametrize("backend", ["eager", "blocked"])
@pytest.mark.parametrize("pattern", ["causal", "padded_window", "cross", "sinks"])
def test_capped_attention_equals_the_formula(encoding, backend, pattern):
    """The cap acts on ``q·k·scale`` only; the bias (ALiBi, T5's trained table) and the masks come
    after it. Blocked runs 300 queries (several blocks); its gradients reach the table too."""
    batch, q_len = 2, 300 if backend == "blocked" else 23
    k_len = q_len + 7 if pattern == "cross" else q_len
    causal = pattern != "cross"
    enc = posenc.build(encoding, num_heads=HEADS) if encoding != "nope" else posenc.build("nope")
    if encoding == "t5":
        enc = posenc.build("t5:bidirectional=false", num_heads=HEADS) if causal else enc
        with torch.no_grad():
            enc.table.weight.normal_(0.0, 1.0)
    enc = enc.double()
    q, k, v = _tensors(batch, q_len, k_len)
    q_pos, k_pos = torch.arange(q_len)[None], torch.arange(k_len)[None]
    padding = torch.zeros(batch, k_len, dtype=torch.bool)
    padding[1, :5] = True
    sinks = torch.randn(HEADS, dtype=torch.float64, requires_grad=True) if pattern == "sinks" else None
    mask = AttentionMask.build(
        q_len=q_len, k_len=k_len, batch=batch, heads=HEADS, causal=causal,
        key_padding_mask=padding if pattern in ("padded_window", "sinks") else None,
        window=9 if pattern == "padded_window" else None,
    )  # fmt: skip
    request = AttentionRequest(
        q=q, k=k, v=v, encoding=enc, q_pos=q_pos, k_pos=k_pos, scale=0.4, mask=mask, sinks=sinks, softcap=CAP
    )  # fmt: skip
    assert backend_limits(get_backend(backend), request) == []
    out, _ = get_backend(backend).run(request)
    bias = enc.bias_for_positions(q_pos, k_pos).double() if encoding != "nope" else None
    allowed = mask.dense()
    want = _reference(q, k, v, 0.4, CAP, bias, allowed, sinks)
    inputs = [q, k, v, *[p for p in enc.parameters()], *([sinks] if sinks is not None else [])]
    torch.testing.assert_close(out, want, **TIGHT)
    for got, expected in zip(_grads(out, inputs), _grads(want, inputs), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-8)
    # the cap bites: without it the output is far from this one
    uncapped = _reference(q, k, v, 0.4, 1e6, bias, allowed, sinks)
    assert (uncapped - want).abs().max() > 0.1


@pytest.mark.parametrize("name", ["shaw", "deberta", "cope"])
def test_content_encodings_cap_their_whole_logits_on_relative_and_eager(name):
    """A CONTENT encoding's logits (content and position terms together) are capped; relative equals eager."""
    layer = posenc.MultiheadAttention(HEADS * HEAD_DIM, HEADS, name, causal=True, softcap=CAP).double()
    x = torch.randn(2, 40, HEADS * HEAD_DIM, dtype=torch.float64) * 3
    params = [p for p in layer.parameters() if p.requires_grad]
    results = {}
    for backend in ("eager", "relative"):
        with use_backend(backend):
            out = layer(x)
        assert layer.last_backend == backend
        results[backend] = (out, _grads(out, params))
    torch.testing.assert_close(results["relative"][0], results["eager"][0], **TIGHT)
    for got, want in zip(results["relative"][1], results["eager"][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    # eager caps exactly the encoding's logits: the formula on them
    enc, scale = layer.encoding, layer.scale
    q = layer._heads(layer.q_proj(x), HEADS)
    k = layer._heads(layer.k_proj(x), HEADS)
    v = layer._heads(layer.v_proj(x), HEADS)
    pos = torch.arange(40)[None]
    s = enc.logits(q, k, pos, pos, scale=scale, layer=layer)
    s = (CAP * torch.tanh(s / CAP)).masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), -math.inf)
    want = layer.out_proj(enc.attend(torch.softmax(s, -1), v, pos, pos).transpose(1, 2).reshape(2, 40, -1))
    torch.testing.assert_close(results["eager"][0], want, **TIGHT)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("encoding", ["nope", "rope", "alibi"])
def test_flex_score_mod_caps_before_the_bias(encoding):
    """FlexAttention (its uncompiled reference on CPU, forward only: no CPU backward) serves capped
    requests of any kind but CONTENT, and equals eager."""
    enc = build_example(encoding, num_heads=HEADS, head_dim=HEAD_DIM)
    q, k, v = _tensors(2, 33, 33, grad=False, dtype=torch.float32)
    pos = torch.arange(33)[None]
    padding = torch.zeros(2, 33, dtype=torch.bool)
    padding[0, :3] = True
    request = AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.4, causal=True, key_padding_mask=padding,
        softcap=CAP,
    )  # fmt: skip
    with torch.no_grad():
        assert get_backend("flex").reasons(request) == []
        assert backend_limits(get_backend("flex"), request) == []
        got = flex_bias_attention(request, compiled=False)
        want, _ = get_backend("eager").run(request)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    uncapped = AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.4, causal=True
    )
    if encoding != "alibi":  # without the cap flex serves BIAS kinds only (sdpa serves the others)
        assert get_backend("flex").reasons(uncapped)


@pytest.mark.parametrize("encoding", ["rope", "alibi", "t5"])
def test_fused_backends_refuse_with_the_reason_and_auto_picks_blocked(encoding):
    layer = posenc.MultiheadAttention(HEADS * HEAD_DIM, HEADS, encoding, causal=True, softcap=CAP)
    x = torch.randn(1, 1200, HEADS * HEAD_DIM)
    pos = torch.arange(1200)[None]
    q, k, v = _tensors(1, 1200, 1200, grad=False, dtype=torch.float32)
    request = AttentionRequest.from_keywords(
        q=q, k=k.repeat_interleave(2, 1), v=v.repeat_interleave(2, 1), encoding=layer.encoding,
        q_pos=pos, k_pos=pos, scale=layer.scale, causal=True, softcap=CAP,
    )  # fmt: skip
    for name in ("sdpa", "segments", "near_far", "clipped"):
        assert SOFTCAP_REASON in backend_limits(get_backend(name), request), name
    with pytest.raises(ValueError, match=r"soft-capping \(softcap\) needs each logit"), use_backend("sdpa"):
        layer(x[:, :20])
    with torch.no_grad():
        layer(x)
    assert layer.last_backend == "blocked"
    with torch.no_grad():
        layer(x[:, :20])  # small: blocked still, sdpa cannot cap
    assert layer.last_backend == "blocked"


def test_the_dispatch_memo_keeps_capped_and_uncapped_requests_apart():
    """Same shapes, kind and mask: the memo's key must hold the cap, or the capped call would reuse sdpa."""
    plain = posenc.MultiheadAttention(HEADS * HEAD_DIM, HEADS, "rope", causal=True)
    capped = posenc.MultiheadAttention(HEADS * HEAD_DIM, HEADS, "rope", causal=True, softcap=CAP)
    capped.load_state_dict(plain.state_dict())
    x = torch.randn(2, 9, HEADS * HEAD_DIM) * 4
    with torch.no_grad():
        plain(x)
        assert plain.last_backend == "sdpa"
        out = capped(x)
        assert capped.last_backend != "sdpa"
        with use_backend("eager"):
            torch.testing.assert_close(out, capped(x))


@pytest.mark.parametrize("encoding", ["rope", "alibi", "shaw"])
def test_cached_decoding_equals_the_full_pass(encoding):
    layer = posenc.MultiheadAttention(
        HEADS * HEAD_DIM, HEADS, encoding, causal=True, num_kv_heads=KV_HEADS, softcap=CAP
    ).double()
    x = torch.randn(2, 14, HEADS * HEAD_DIM, dtype=torch.float64) * 3
    with torch.no_grad():
        full = layer(x)
        cache = posenc.KVCache()
        steps = [layer(x[:, :9], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(9, 14)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **TIGHT)


@pytest.mark.parametrize("encoding", ["rope", "alibi"])
def test_fixed_shape_steps_cap(encoding):
    layer = (
        posenc.MultiheadAttention(HEADS * HEAD_DIM, HEADS, encoding, causal=True, softcap=CAP).double().eval()
    )
    x = torch.randn(2, 12, HEADS * HEAD_DIM, dtype=torch.float64) * 3
    with torch.no_grad():
        full = layer(x)
        cache = posenc.KVCache(max_length=16)
        layer(x[:, :8], cache=cache)
        with cache.fixed_shapes():
            steps = [layer(x[:, t : t + 1], cache=cache) for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 8:], **TIGHT)


def test_nan_stays_nan():
    q, k, v = _tensors(1, 6, 6, grad=False)
    q[0, 1, 3, 0] = math.nan
    pos = torch.arange(6)[None]
    _, out, _ = attend(
        q, k, v, encoding=posenc.build("nope"), q_pos=pos, k_pos=pos, scale=0.5, causal=True, softcap=CAP
    )
    assert out[0, 1, 3].isnan().all()
    assert out[0, 0].isfinite().all()


@pytest.mark.parametrize("bad", [0, 0.0, -50.0, math.inf, -math.inf, math.nan, "50", True])
def test_a_cap_that_is_not_finite_and_positive_is_refused_naming_softcap(bad):
    with pytest.raises(ValueError, match="softcap"):
        posenc.MultiheadAttention(16, 2, "rope", causal=True, softcap=bad)
    q, k, v = _tensors(1, 3, 3, grad=False)
    pos = torch.arange(3)[None]
    with pytest.raises(ValueError, match=r"AttentionRequest\.softcap"):
        AttentionRequest(
            q=q, k=k, v=v, encoding=posenc.build("nope"), q_pos=pos, k_pos=pos, scale=1.0, softcap=bad
        )


def test_a_model_pattern_carries_the_cap_and_trains():
    """Gemma 2's recipe: local and global layers, every one capped; a training step gets gradients."""
    from posenc.layers.patterns import LayerSpec

    pattern = [LayerSpec("rope", window=4, softcap=CAP), LayerSpec("rope", softcap=CAP)]
    model = posenc.TransformerLM(20, 16, 2, 2, pattern=pattern)
    layers = [m for m in model.modules() if isinstance(m, posenc.MultiheadAttention)]
    assert [layer.softcap for layer in layers] == [CAP, CAP]
    ids = torch.randint(0, 20, (2, 9))
    model(ids).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="softcap"):
        posenc.MultiheadAttention(16, 2, "rope", causal=True, pattern=LayerSpec("rope", softcap=-1.0))
    with pytest.raises(ValueError, match="either pattern or"):
        posenc.MultiheadAttention(16, 2, "rope", causal=True, pattern=pattern[0], softcap=CAP)
