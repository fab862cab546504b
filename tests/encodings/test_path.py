"""PaTH (Yang et al. 2025): the functions and the layer against the formula written as explicit matrices.

The reference builds, for every query ``i`` and key ``j <= i``, the matrix ``H_i H_{i-1} ⋯ H_{j+1}``
with ``H_t = I − β_t w_t w_tᵀ`` as a product of ``D x D`` matrices (float64), and the logit
``q_iᵀ (that product) k_j · scale``; nothing of posenc's chunked or carried forms is reused.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.encodings.base import TokenStates
from posenc.encodings.path import (
    PaTH,
    path_attention_blocked,
    path_carry_keys,
    path_householders,
    path_logits,
)

F64 = torch.float64


def _inputs(batch=2, heads=2, length=11, dim=5, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=g, dtype=F64) for _ in range(3))
    w = torch.randn(batch, heads, length, dim, generator=g, dtype=F64)
    w = w / w.norm(dim=-1, keepdim=True)
    beta = 2 * torch.rand(batch, heads, length, generator=g, dtype=F64)
    tensors = [q, k, v, w, beta]
    return [t.requires_grad_(requires_grad) for t in tensors]


def reference_transform(w, beta, i, j):
    """``H_i H_{i-1} ⋯ H_{j+1}`` ``[B, H, D, D]`` as explicit matrices (identity when ``j = i``)."""
    batch, heads, _, dim = w.shape
    eye = torch.eye(dim, dtype=w.dtype).expand(batch, heads, dim, dim)
    product = eye
    for t in range(i, j, -1):  # H_i first on the left, H_{j+1} last
        householder = eye - beta[:, :, t, None, None] * w[:, :, t, :, None] * w[:, :, t, None, :]
        product = product @ householder
    return product


def reference_logits(q, k, w, beta):
    """``q_iᵀ H_i ⋯ H_{j+1} k_j`` for ``j <= i`` and ``-inf`` above the diagonal ``[B, H, T, T]``."""
    length = q.shape[2]
    rows = []
    for i in range(length):
        row = []
        for j in range(length):
            if j > i:
                row.append(torch.full(q.shape[:2], float("-inf"), dtype=q.dtype))
            else:
                m = reference_transform(w, beta, i, j)
                row.append((q[:, :, i, None, :] @ m @ k[:, :, j, :, None])[..., 0, 0])
        rows.append(torch.stack(row, dim=-1))
    return torch.stack(rows, dim=-2)


def reference_attention(q, k, v, w, beta, scale):
    return torch.softmax(reference_logits(q, k, w, beta) * scale, dim=-1) @ v


def _grads(out, tensors, seed=1):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), tensors)


def test_logits_equal_the_explicit_matrix_product():
    q, k, _, w, beta = _inputs()
    got = path_logits(q, k, w, beta)
    want = reference_logits(q, k, w, beta)
    lower = torch.ones(11, 11, dtype=torch.bool).tril()
    torch.testing.assert_close(got[..., lower], want[..., lower], rtol=1e-12, atol=1e-12)
    # the diagonal has no transform between key and query
    torch.testing.assert_close(got.diagonal(dim1=-2, dim2=-1), (q * k).sum(-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_blocked_and_eager_equal_the_reference_forward_and_gradients(chunk):
    tensors = _inputs(requires_grad=True)
    q, k, v, w, beta = tensors
    scale = 5**-0.5
    want = reference_attention(q, k, v, w, beta, scale)
    future = torch.ones(11, 11, dtype=torch.bool).triu(1)
    eager = torch.softmax((path_logits(q, k, w, beta) * scale).masked_fill(future, float("-inf")), -1) @ v
    blocked = path_attention_blocked(q, k, v, w, beta, scale, chunk=chunk)
    want_grads = _grads(want, tensors)
    for got in (eager, blocked):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
        for g, r in zip(_grads(got, tensors), want_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10)


def test_carried_keys_and_a_step_after_them_equal_the_reference():
    """The cache invariant: keys carried to the last cached token, then a step of new tokens."""
    q, k, v, w, beta = _inputs(length=13, seed=3)
    past = 6
    carried = path_carry_keys(k[:, :, :past], w[:, :, :past], beta[:, :, :past], chunk=4)
    for j in range(past):
        m = reference_transform(w, beta, past - 1, j)
        torch.testing.assert_close(
            carried[:, :, j], (m @ k[:, :, j, :, None])[..., 0], rtol=1e-12, atol=1e-12
        )
    keys = torch.cat([carried, k[:, :, past:]], dim=2)
    want = reference_attention(q, k, v, w, beta, 0.5)[:, :, past:]
    got = path_attention_blocked(q[:, :, past:], keys, v, w[:, :, past:], beta[:, :, past:], 0.5, chunk=3)
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
    logits = path_logits(q[:, :, past:], keys, w[:, :, past:], beta[:, :, past:])
    lower = torch.ones(13, 13, dtype=torch.bool).tril()[past:]
    ref = reference_logits(q, k, w, beta)[:, :, past:]
    torch.testing.assert_close(logits[..., lower], ref[..., lower], rtol=1e-12, atol=1e-12)


def _layer(num_kv_heads=None, seed=0, spec="path"):
    torch.manual_seed(seed)
    layer = posenc.MultiheadAttention(32, 4, spec, causal=True, num_kv_heads=num_kv_heads)
    return layer.to(F64)


@pytest.mark.parametrize(("num_kv_heads", "spec"), [(None, "path"), (2, "path:num_kv_heads=2"), (1, "path")])
def test_layer_blocked_equals_eager_forward_and_gradients(num_kv_heads, spec):
    layer = _layer(num_kv_heads, spec=spec).train()
    x = torch.randn(2, 150, 32, dtype=F64)  # three chunks of 64, the last one padded
    results = {}
    for backend in ("eager", "householder"):
        layer.zero_grad()
        x_in = x.clone().requires_grad_(True)
        with posenc.use_backend(backend):
            out = layer(x_in)
        assert layer.last_backend == backend
        out.pow(2).sum().backward()
        results[backend] = (out.detach(), [x_in.grad] + [p.grad for p in layer.parameters()])
    torch.testing.assert_close(results["householder"][0], results["eager"][0], rtol=1e-10, atol=1e-10)
    for got, want in zip(results["householder"][1], results["eager"][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("max_length", [None, 96])
@pytest.mark.parametrize("backend", ["eager", "householder", "auto"])
def test_cached_decoding_equals_the_full_pass(backend, max_length):
    layer = _layer(2, spec="path:num_kv_heads=2").eval()
    x = torch.randn(2, 80, 32, dtype=F64)
    with posenc.use_backend(backend), torch.no_grad():
        full = layer(x)
        cache, pieces, start = posenc.KVCache(max_length=max_length), [], 0
        for size in (5, 1, 66, 1, 7):
            pieces.append(layer(x[:, start : start + size], cache=cache))
            start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-10)
    # the cache holds every key carried to the last token: k~_j = H_79 ⋯ H_(j+1) k_j
    states = TokenStates.same_sequence(layer.encoding.token_states(x))
    w, beta = path_householders(states.k, 2, 8)
    keys = layer._heads(layer.k_proj(x), 2)
    want = torch.stack(
        [(reference_transform(w, beta, 79, j) @ keys[:, :, j, :, None])[..., 0] for j in (0, 40, 78, 79)], 2
    )
    torch.testing.assert_close(cache.get(0).k[:, :, [0, 40, 78, 79]], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("max_length", [None, 96])
@pytest.mark.parametrize("backend", ["eager", "auto"])
def test_windowed_cached_decoding_equals_the_full_pass(backend, max_length):
    # the cache trims a windowed entry as it appends; the carried keys must then overwrite the kept
    # tail without touching the keys this step attends to (views of the same buffer)
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(32, 4, "path", causal=True, window=12).to(F64).eval()
    x = torch.randn(2, 60, 32, dtype=F64)
    with posenc.use_backend(backend), torch.no_grad():
        full = layer(x)
        cache, pieces, start = posenc.KVCache(max_length=max_length), [], 0
        for size in (5, 1, 1, 20, 1, 1, 31):
            pieces.append(layer(x[:, start : start + size], cache=cache))
            start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-10)
    assert cache.get(0).k.shape[2] == 11


def test_auto_runs_the_blocked_form_and_eager_where_masks_need_it():
    layer = _layer()
    x = torch.randn(1, 20, 32, dtype=F64)
    layer(x)
    assert layer.last_backend == "householder"
    pad = torch.zeros(1, 20, dtype=torch.bool)
    pad[:, 15:] = True
    layer(x, key_padding_mask=pad)
    assert layer.last_backend == "eager"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("length", [1, 9, 70])
def test_beta_zero_is_nope(seed, length):
    """Property: with every β = 0 (gate logits at -1e4) each H_t is the identity and PaTH is NoPE."""
    layer = _layer(seed=seed)
    nope = posenc.MultiheadAttention(32, 4, None, causal=True).to(F64)
    nope.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("encoding.")})
    with torch.no_grad():
        layer.encoding.to_beta.weight.zero_()
        layer.encoding.to_beta.bias.fill_(-1e4)
    x = torch.randn(2, length, 32, dtype=F64, generator=torch.Generator().manual_seed(seed))
    want = nope(x)
    for backend in ("eager", "householder"):
        with posenc.use_backend(backend):
            torch.testing.assert_close(layer(x), want, rtol=1e-12, atol=1e-12)
    # and a β that is not zero changes the output: the test can fail
    with torch.no_grad():
        layer.encoding.to_beta.bias.fill_(0.0)
    if length > 1:
        assert not torch.allclose(layer(x), want)


def test_nan_propagates_through_the_blocked_form():
    q, k, v, w, beta = _inputs()
    q = q.clone()
    q[0, 1, 4, 2] = float("nan")
    out = path_attention_blocked(q, k, v, w, beta, 0.5, chunk=4)
    assert torch.isnan(out[0, 1, 4]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, 0]).all()


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="num_kv_heads"):
        PaTH(num_heads=4, head_dim=8, dim=32, num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim"):
        PaTH(num_heads=4, head_dim=8.0, dim=32)
    layer = posenc.MultiheadAttention(32, 4, "path:num_kv_heads=2", causal=True)  # 4 key heads
    with pytest.raises(ValueError, match="num_kv_heads=2 is not a multiple"):
        layer(torch.randn(1, 5, 32))
    with pytest.raises(ValueError, match="causal"):
        posenc.MultiheadAttention(32, 4, "path", causal=False)
    layer = _layer()
    with pytest.raises(ValueError, match="cross-attention"):
        layer(torch.randn(1, 5, 32, dtype=F64), context=torch.randn(1, 6, 32, dtype=F64))
    with pytest.raises(ValueError, match="recent_tokens"):
        layer(torch.randn(1, 5, 32, dtype=F64), cache=posenc.KVCache(recent_tokens=4))
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match="token_states"):
        layer.encoding.logits(q, q, torch.arange(5)[None], torch.arange(5)[None], scale=1.0)
    with pytest.raises(ValueError, match="channels"):
        path_householders(torch.zeros(1, 7, 5), 4, 8)


def test_grouped_query_layer_with_per_query_head_transforms_decodes_exactly():
    """A layer with 1 key head and PaTH's default 4 transform heads: keys repeated to 4, then cached."""
    layer = _layer(1).eval()
    x = torch.randn(2, 20, 32, dtype=F64)
    full = layer(x)
    cache = posenc.KVCache()
    pieces = [layer(x[:, :7], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-10)
    assert cache.get(0).k.shape[1] == 4


def fla_naive_path_attn(q, k, v, w, beta, scale, chunk_size=4):
    """flash-linear-attention ``fla/ops/path_attn/naive.py::naive_path_attn`` (MIT), transcribed with
    ``[B, H, T, D]`` inputs, no forget gate and ``einops.rearrange`` written as reshapes."""
    b, h, length, d = q.shape
    bt = chunk_size
    if length % bt != 0:
        pad = bt - length % bt
        q, k, w = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, w))
        beta = torch.nn.functional.pad(beta, (0, pad))
    seq_len = q.shape[2]
    w_beta = w * beta[..., None]

    def chunks(x):
        return x.reshape(b, h, seq_len // bt, bt, d)

    q, k, w, w_beta = map(chunks, (q, k, w, w_beta))
    mask = torch.triu(torch.ones(bt, bt, dtype=torch.bool), diagonal=0)
    t_mat = -(w_beta @ w.transpose(-1, -2)).masked_fill(mask, 0)
    for i in range(1, bt):
        t_mat[..., i, :i] = t_mat[..., i, :i].clone() + (
            t_mat[..., i, :, None].clone() * t_mat[..., :, :i].clone()
        ).sum(-2)
    t_mat = t_mat + torch.eye(bt, dtype=q.dtype)
    twbk = t_mat @ (w_beta @ k.transpose(-1, -2)).masked_fill(mask, 0)
    qw = (q @ w.transpose(-1, -2)).tril()
    twb = t_mat @ w_beta
    a_local = (q @ k.transpose(-1, -2)).tril() - qw @ twbk
    q = q - qw @ twb
    k = k - twbk.transpose(-1, -2) @ w
    h_mat = w.transpose(-1, -2) @ twb
    a = torch.zeros(b, h, seq_len, seq_len, dtype=q.dtype)
    q, k = q.reshape(b, h, seq_len, d), k.reshape(b, h, seq_len, d)
    for i in range(0, seq_len, bt):
        q_i = q[:, :, i : i + bt].clone()
        for j in range(i - bt, -bt, -bt):
            a[:, :, i : i + bt, j : j + bt] = q_i @ k[:, :, j : j + bt].transpose(-1, -2)
            q_i = q_i - q_i @ h_mat[:, :, j // bt]
    for i in range(0, seq_len // bt):
        a[:, :, i * bt : i * bt + bt, i * bt : i * bt + bt] = a_local[:, :, i]
    a = a.masked_fill_(~torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool)), float("-inf"))
    a = a[:, :, :length, :length]
    return (a * scale).softmax(-1) @ v


@pytest.mark.parametrize("chunk_size", [1, 4])
def test_equals_flash_linear_attention_naive_reference(chunk_size):
    """The order and indices of fla's reference: the same output as its chunked naive form."""
    q, k, v, w, beta = _inputs(length=10, seed=7)
    want = fla_naive_path_attn(q, k, v, w, beta, 0.4, chunk_size)
    torch.testing.assert_close(
        path_attention_blocked(q, k, v, w, beta, 0.4, chunk=3), want, rtol=1e-11, atol=1e-11
    )
    torch.testing.assert_close(reference_attention(q, k, v, w, beta, 0.4), want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("past", [0, 5])
def test_checkpointed_query_groups_equal_the_reference_with_gradients(monkeypatch, past):
    """Under autograd the blocked form runs query groups (here 2 chunks of 3), each checkpointed."""
    monkeypatch.setattr("posenc.encodings.path.GROUP_TOKENS", 6)
    tensors = _inputs(length=17, seed=11, requires_grad=True)
    q, k, v, w, beta = tensors
    want = reference_attention(q, k, v, w, beta, 0.3)[:, :, past:]
    keys = torch.cat([path_carry_keys(k[:, :, :past], w[:, :, :past], beta[:, :, :past]), k[:, :, past:]], 2)
    got = path_attention_blocked(q[:, :, past:], keys, v, w[:, :, past:], beta[:, :, past:], 0.3, chunk=3)
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
    for g, r in zip(_grads(got, tensors), _grads(want, tensors), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10)
