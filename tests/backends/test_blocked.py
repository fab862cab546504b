"""The ``blocked`` (BIAS) and ``relative`` (CONTENT) backends and the fused RoPE kernel.

References are independent: the attention formula written in the test (``_bias_fixtures``) with
the bias from each test encoding's own closed form, eager attention for the CONTENT blocks, and HF
``apply_rotary_pos_emb`` for RoPE. Block sizes are tiny so that every case spans several blocks.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import posenc
from _bias_fixtures import ClippedTableBias, QueryNormalisedBias, reference_attention
from posenc.backends import AttentionRequest, backend_limits, blocked, get_backend, use_backend
from posenc.backends.blocked import blocked_bias_attention

H, D = 2, 8


def _qkv(batch, q_len, k_len, kv_heads=H, dtype=torch.float64):
    make = lambda heads, length: torch.randn(batch, heads, length, D, dtype=dtype, requires_grad=True)  # noqa: E731
    return make(H, q_len), make(kv_heads, k_len), make(kv_heads, k_len)


CASES = {
    # name: (q_len, k_len, causal, offset, positions, padding, mask, kv_heads)
    "causal": (37, 37, True, 0, "arange", False, None, H),
    "causal_cache_offset": (5, 41, True, 36, "arange", False, None, H),
    "causal_gqa": (37, 37, True, 0, "arange", False, None, 1),
    "padding_fully_masked_rows": (37, 37, True, 0, "arange", True, None, H),
    "cross_explicit_positions": (13, 29, False, 0, "random", True, None, H),
    "sparse_positions": (11, 11, False, 0, "sparse", False, None, H),
    "bool_mask": (19, 23, False, 0, "arange", False, "bool", H),
    "float_mask": (19, 23, False, 0, "random", False, "float", H),
}


def _positions(kind, batch, q_len, k_len, offset):
    if kind == "arange":
        return torch.arange(offset, offset + q_len)[None], torch.arange(k_len)[None]
    if kind == "sparse":  # too spread out for a distance table: bias_at per block
        k_pos = (torch.arange(k_len) * 1000)[None].expand(batch, -1)
        return k_pos[:, :q_len], k_pos
    k_pos = torch.sort(torch.randint(0, 60, (batch, k_len)), dim=1).values
    return torch.sort(torch.randint(0, 60, (batch, q_len)), dim=1).values, k_pos


@pytest.mark.parametrize("encoding_cls", [ClippedTableBias, QueryNormalisedBias])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_blocked_matches_formula(encoding_cls, case, frozen):
    q_len, k_len, causal, offset, pos_kind, padded, mask_kind, kv_heads = CASES[case]
    batch = 2
    enc = encoding_cls(num_heads=H).double().requires_grad_(not frozen)
    q, k, v = _qkv(batch, q_len, k_len, kv_heads)
    q_pos, k_pos = _positions(pos_kind, batch, q_len, k_len, offset)
    padding = None
    if padded:
        padding = torch.zeros(batch, k_len, dtype=torch.bool)
        padding[1, :4] = True
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(batch, H, q_len, k_len) > 0.4
        mask[..., 0, :] = False  # a query row with no key
    elif mask_kind == "float":
        mask = torch.randn(1, 1, q_len, k_len, dtype=torch.float64)
    req = AttentionRequest.from_keywords(
        q=q,
        k=k,
        v=v,
        encoding=enc,
        q_pos=q_pos,
        k_pos=k_pos,
        scale=0.4,
        causal=causal,
        causal_offset=offset,
        key_padding_mask=padding,
        attn_mask=mask,
    )
    out = blocked_bias_attention(req, block=4)
    ref = reference_attention(
        q, k, v, enc.formula(q_pos, k_pos), 0.4, causal=causal, offset=offset, padding=padding, attn_mask=mask
    )
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    inputs = [q, k, v] + [p for p in enc.parameters() if p.requires_grad]
    weight = torch.randn_like(out)
    got = torch.autograd.grad((out * weight).sum(), inputs)
    want = torch.autograd.grad((ref * weight).sum(), inputs)
    for g, w in zip(got, want):
        # bias_at is float32 by contract (the table test encoding), so allow float32 rounding.
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["causal_cache_offset", "padding_fully_masked_rows", "bool_mask"])
def test_blocked_without_the_cpu_flash_kernel(case, monkeypatch):
    """The explicit-softmax path (other devices, or a torch without the CPU flash op)."""
    monkeypatch.setattr("posenc.backends.parts.flash.cpu_flash_available", lambda: False)

    def kernel(*args, **kwargs):
        raise AssertionError("the CPU flash kernel ran: the explicit path is the one under test")

    monkeypatch.setattr(blocked, "flash_forward", kernel)
    monkeypatch.setattr(blocked, "flash_backward", kernel)
    test_blocked_matches_formula(ClippedTableBias, case, frozen=False)
    test_blocked_matches_formula(QueryNormalisedBias, case, frozen=True)


def test_blocked_gradients_reach_parameters_under_functional_call():
    """torch.func.functional_call swaps the parameters only during the call; backward must still
    differentiate with respect to the swapped-in tensors."""
    layer = posenc.MultiheadAttention(H * D, H, QueryNormalisedBias(num_heads=H), causal=True).double()
    x = torch.randn(1, 9, H * D, dtype=torch.float64)
    slope = torch.tensor([0.7, 1.3], dtype=torch.float64, requires_grad=True)
    grads = {}
    for backend in ("blocked", "eager"):
        with use_backend(backend):
            out = functional_call(layer, {"encoding.slope": slope}, (x,))
        grads[backend] = torch.autograd.grad(out.sum(), slope)[0]
    assert grads["eager"].abs().sum() > 0
    torch.testing.assert_close(grads["blocked"], grads["eager"], rtol=1e-6, atol=1e-9)


def test_auto_picks_blocked_for_bias_and_states_reasons():
    enc = ClippedTableBias(num_heads=H)
    q, k, v = _qkv(1, 8, 8, dtype=torch.float32)
    pos = torch.arange(8)[None]
    req = AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.3, causal=True, dropout_p=0.1
    )
    reasons = backend_limits(get_backend("blocked"), req)  # dropout: a fact the dispatcher checks
    assert any("dropout" in r for r in reasons)
    layer = posenc.MultiheadAttention(H * D, H, enc, causal=True)
    layer(torch.randn(1, 300, H * D))  # auto leaves problems below 256x256 to sdpa
    assert layer.last_backend == "blocked"
    nope = AttentionRequest(q=q, k=k, v=v, encoding=posenc.build("nope"), q_pos=pos, k_pos=pos, scale=0.3)
    # Kinds without a bias: served (masks only), but auto leaves them to sdpa unless the mask hides
    # most keys; CONTENT kinds compute their own logits and are refused.
    assert get_backend("blocked").reasons(nope) == []
    assert any("sdpa is cheaper" in r for r in get_backend("blocked").declines(nope))
    shaw = AttentionRequest(
        q=q, k=k, v=v, encoding=posenc.build("shaw", num_heads=H, head_dim=D), q_pos=pos, k_pos=pos, scale=0.3
    )
    assert any("content" in r for r in get_backend("blocked").reasons(shaw))


def test_blocked_bfloat16_close_to_float32():
    enc = ClippedTableBias(num_heads=H)
    q, k, v = (t.detach().float() for t in _qkv(1, 33, 33))
    pos = torch.arange(33)[None]

    def req(a, b, c):
        return AttentionRequest.from_keywords(
            q=a, k=b, v=c, encoding=enc, q_pos=pos, k_pos=pos, scale=0.3, causal=True
        )

    full = blocked_bias_attention(req(q, k, v), block=8)
    half = blocked_bias_attention(req(q.bfloat16(), k.bfloat16(), v.bfloat16()), block=8)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full, rtol=0.05, atol=0.05)


# ---------------------------------------------------------------------------- relative (CONTENT)

#: CONTENT encodings of positions and content (an input-dependent transform, PaTH, runs on eager and
#: its own backend: tests/encodings/test_path.py).
CONTENT = [
    name
    for name in posenc.available()
    if posenc.get_class(name).kind is posenc.Kind.CONTENT and not posenc.get_class(name).input_dependent
]
