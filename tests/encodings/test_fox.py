"""FoX (Forgetting Transformer): the bias against the paper's formula written as an explicit sum.

Reference: ``b_ij = Σ_{t=j+1..i} log sigmoid(w_h · x_t + b_h)`` (Lin et al. 2025, eq. for D_ij), and
for x-transformers' bidirectional variant ``Σ_{t=i+1..j} log sigmoid(w'_h · x_t + b'_h)`` for keys
after the query; the gate projection is ``Linear(dim, H or 2H)`` with its bias set to ``bias_init``.
The attention written here by hand (softmax of scaled logits plus bias, causal mask) is the layer's
reference, with the layer's own projection weights.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.backends import AttentionRequest, NoBackendError, backend_limits, get_backend
from posenc.backends.flex import flex_bias_attention
from posenc.encodings.base import InputBias, TokenStates
from posenc.encodings.fox import FoX

H, D = 3, 8

E = H * D


def _layer(mode="causal", causal=True, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(E, H, encoding=f"fox:mode={mode}", causal=causal, **kw)
    with torch.no_grad():  # gates far from the init so every head forgets at its own, varying rate
        layer.encoding.to_gates.weight.normal_(0.0, 0.5)
        layer.encoding.to_gates.bias.uniform_(-1.0, 3.0)
    return layer.to(dtype).eval()


def reference_bias(x, weight, bias, heads, bidirectional, scale=1.0):
    """``[B, H, T, T]`` by the explicit sums of log gates between query and key (no cumsum)."""
    log_gates = torch.nn.functional.logsigmoid(x @ weight.T + bias) * scale  # [B, T, S]
    batch, length, _ = x.shape
    out = torch.zeros(batch, heads, length, length, dtype=x.dtype)
    for i in range(length):
        for j in range(length):
            if j <= i:
                out[:, :, i, j] = log_gates[:, j + 1 : i + 1, :heads].sum(1)
            elif bidirectional:
                out[:, :, i, j] = log_gates[:, i + 1 : j + 1, heads:].sum(1)
            else:
                out[:, :, i, j] = -log_gates[:, i + 1 : j + 1, :heads].sum(1)  # c_i - c_j, masked
    return out


def reference_attention(layer, x, bias, causal):
    batch, length, _ = x.shape

    def heads(t):
        return t.view(batch, length, H, D).transpose(1, 2)

    q, k, v = heads(layer.q_proj(x)), heads(layer.k_proj(x)), heads(layer.v_proj(x))
    logits = q @ k.transpose(-1, -2) / math.sqrt(D) + bias
    if causal:
        future = torch.triu(torch.ones(length, length, dtype=torch.bool), 1)
        logits = logits.masked_fill(future, float("-inf"))
    out = torch.softmax(logits, -1) @ v
    return layer.out_proj(out.transpose(1, 2).reshape(batch, length, E))


@pytest.mark.parametrize("mode,causal", [("causal", True), ("bidirectional", False), ("bidirectional", True)])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_layer_equals_the_formula(mode, causal, backend):
    layer = _layer(mode, causal)
    x = torch.randn(2, 11, E, dtype=torch.float64)
    gates = layer.encoding.to_gates
    bias = reference_bias(x, gates.weight, gates.bias, H, mode == "bidirectional")
    with posenc.use_backend(backend):
        got = layer(x)
    torch.testing.assert_close(got, reference_attention(layer, x, bias, causal), rtol=1e-10, atol=1e-12)


def test_gate_projection_matches_the_reference_layout():
    """One Linear(dim, H) (causal) or Linear(dim, 2H) (bidirectional) whose bias starts at bias_init."""
    causal = posenc.build("fox", num_heads=4, dim=32)
    both = posenc.build("fox:mode=bidirectional,bias_init=2.5", num_heads=4, dim=32)
    assert causal.to_gates.weight.shape == (4, 32) and both.to_gates.weight.shape == (8, 32)
    assert (causal.to_gates.bias == 5.0).all() and (both.to_gates.bias == 2.5).all()


def test_post_log_scale_scales_the_log_gates():
    enc = posenc.build("fox:post_log_scale=0.25", num_heads=H, dim=E).double()
    x = torch.randn(1, 6, E, dtype=torch.float64)
    states = TokenStates.same_sequence(enc.token_states(x))
    want = reference_bias(x, enc.to_gates.weight, enc.to_gates.bias, H, False, scale=0.25)
    torch.testing.assert_close(enc.bias_from_states(states), want)


def test_zero_input_view_is_alibi_with_slope_log_sigmoid_b():
    """bias_at (plots only) is the bias at x = 0: every gate sigmoid(b_h), so -log sigmoid(b_h)·(i-j)."""
    enc = posenc.build("fox:mode=bidirectional", num_heads=2, dim=4).double()
    with torch.no_grad():
        enc.to_gates.bias.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    behind = torch.stack([math.log(1 / (1 + math.exp(-b))) * (i - j) for b in (1.0, 2.0)])
    ahead = torch.stack([math.log(1 / (1 + math.exp(-b))) * (j - i) for b in (3.0, 4.0)])
    want = torch.where(j > i, ahead, behind).double()
    torch.testing.assert_close(enc.bias(7, 7), want)
    states = TokenStates.same_sequence(enc.token_states(torch.zeros(1, 7, 4, dtype=torch.float64)))
    torch.testing.assert_close(enc.bias_from_states(states)[0], want)


@pytest.mark.parametrize("mode,causal", [("causal", True), ("bidirectional", True)])
def test_cached_decoding_continues_the_gates(mode, causal):
    layer = _layer(mode, causal)
    x = torch.randn(2, 10, E, dtype=torch.float64)
    full = layer(x)
    cache = posenc.KVCache()
    parts = [layer(x[:, a:b], cache=cache) for a, b in ((0, 4), (4, 5), (5, 10))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-12)


def test_windowed_layer_cache_trims_the_states_with_the_keys():
    layer = _layer(window=4)
    x = torch.randn(1, 9, E, dtype=torch.float64)
    full = layer(x)
    cache = posenc.KVCache()
    steps = torch.cat([layer(x[:, t : t + 1], cache=cache) for t in range(9)], 1)
    torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-12)
    assert cache.get(0).token_state.shape[-1] == cache.get(0).k.shape[2] == 3


@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
@pytest.mark.parametrize("window,max_length", [(1, 1), (3, 3), (4, 6), (5, 8)])
@pytest.mark.parametrize("chunks", [[9, 1, 1, 2, 1], [2, 1, 10, 1, 2]], ids=["long_prompt", "long_step"])
@pytest.mark.parametrize("padded", [False, True])
def test_preallocated_windowed_cache_trims_the_states_with_the_keys(mode, window, max_length, chunks, padded):
    """KVCache(max_length=N) after a prompt or a step longer than N keeps only the window's keys,
    and their token states with them: every step equals the full pass with the same window."""
    layer = _layer(mode, window=window)
    x = torch.randn(2, sum(chunks), E, dtype=torch.float64)
    padding = torch.zeros(2, sum(chunks), dtype=torch.bool)
    padding[1, :3] = padded  # left padding of the second sequence
    cache, outs, start = posenc.KVCache(max_length=max_length), [], 0
    with torch.no_grad():
        full = layer(x, key_padding_mask=padding)
        for size in chunks:
            mask = padding[:, : start + size]
            outs.append(layer(x[:, start : start + size], cache=cache, key_padding_mask=mask))
            start += size
    real = ~padding
    torch.testing.assert_close(torch.cat(outs, 1)[real], full[real], rtol=1e-10, atol=1e-12)
    entry = cache.get(0)
    assert entry.token_state.shape[-1] == entry.token_index.shape[0] == entry.k.shape[2] == window - 1


def test_padding_tokens_do_not_decay_so_padding_never_changes_real_tokens():
    layer = _layer()
    x = torch.randn(1, 6, E, dtype=torch.float64)
    alone = layer(x)
    padded = torch.cat([torch.randn(1, 3, E, dtype=torch.float64), x], 1)  # left padding
    pad = torch.zeros(1, 9, dtype=torch.bool)
    pad[:, :3] = True
    torch.testing.assert_close(layer(padded, key_padding_mask=pad)[:, 3:], alone, rtol=1e-10, atol=1e-12)
    # Padding in the middle (a decoding step after a right-padded prompt) adds no decay either.
    cache = posenc.KVCache()
    prompt = torch.cat([x[:, :4], torch.randn(1, 2, E, dtype=torch.float64)], 1)
    mid_pad = torch.zeros(1, 6, dtype=torch.bool)
    mid_pad[:, 4:] = True
    layer(prompt, key_padding_mask=mid_pad, cache=cache)
    step = layer(x[:, 4:6], key_padding_mask=torch.zeros(1, 2, dtype=torch.bool), cache=cache)
    torch.testing.assert_close(step, alone[:, 4:6], rtol=1e-10, atol=1e-12)


def test_packed_documents_equal_each_document_alone():
    layer = _layer()
    a, b = torch.randn(1, 5, E, dtype=torch.float64), torch.randn(1, 4, E, dtype=torch.float64)
    docs = torch.tensor([[0] * 5 + [1] * 4])
    packed = layer(torch.cat([a, b], 1), document_ids=docs)
    torch.testing.assert_close(packed, torch.cat([layer(a), layer(b)], 1), rtol=1e-10, atol=1e-12)


def test_streaming_cache_keeps_sink_and_window_states():
    layer = _layer()
    x = torch.randn(1, 8, E, dtype=torch.float64)
    cache = posenc.KVCache(recent_tokens=3, sink_tokens=1)
    for t in range(8):
        layer(x[:, t : t + 1], cache=cache)
    entry = cache.get(0)
    assert entry.token_index.tolist() == [0, 5, 6, 7]
    gates = layer.encoding.to_gates
    cumulative = torch.nn.functional.logsigmoid(x @ gates.weight.T + gates.bias).cumsum(1)[0].T  # [H, T]
    torch.testing.assert_close(entry.token_state[0], cumulative[:, [0, 5, 6, 7]])


def test_low_precision_model_keeps_float32_states():
    layer = _layer(dtype=torch.bfloat16)
    x = torch.randn(1, 5, E, dtype=torch.bfloat16)
    assert layer.encoding.token_states(x).dtype == torch.float32
    assert layer(x).dtype == torch.bfloat16


def test_cross_attention_is_refused():
    layer = _layer("bidirectional", causal=False)
    with pytest.raises(ValueError, match="self-attention"):
        layer(torch.randn(1, 3, E, dtype=torch.float64), context=torch.randn(1, 5, E, dtype=torch.float64))


@pytest.mark.parametrize("backend", ["blocked", "relative"])
def test_backends_that_read_positions_only_refuse_with_the_reason(backend):
    layer = _layer(dtype=torch.float32)
    with posenc.use_backend(backend), pytest.raises(NoBackendError, match="depends on the layer input"):
        layer(torch.randn(1, 300, E))


def _flex_request(enc, x, past, causal):
    """A request whose queries are the tokens of ``x`` after the first ``past`` (a decode step over
    the cache: query indices follow the cached keys'), with random q, k, v."""
    batch, length, _ = x.shape
    states, index = enc.token_states(x), torch.arange(length)
    token_states = TokenStates(q=states[..., past:], k=states, q_index=index[past:], k_index=index)
    q = torch.randn(batch, H, length - past, D)
    k, v = torch.randn(2, batch, H, length, D)
    pos = index[None]
    return AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=enc, q_pos=pos[:, past:], k_pos=pos, scale=D**-0.5,
        causal=causal, causal_offset=past, token_states=token_states,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "mode,causal,past",
    [("causal", True, 0), ("causal", True, 7), ("bidirectional", False, 0), ("bidirectional", False, 7)],
)
def test_flex_score_mod_reads_the_token_states(mode, causal, past):
    """flex's score_mod adds the bias of the tokens' gates, not bias_at (the bias at zero input):
    FlexAttention's uncompiled reference (the score_mod the compiled kernel fuses) equals the
    explicit-sum formula, for a fresh sequence and for queries after ``past`` cached tokens."""
    enc = _layer(mode, causal, dtype=torch.float32).encoding
    x = torch.randn(2, 12, E)
    with torch.no_grad():  # FlexAttention has no CPU backward
        req = _flex_request(enc, x, past, causal)
        got = flex_bias_attention(req, compiled=False)
        limits = backend_limits(get_backend("flex"), req)
    gates = enc.to_gates
    bias = reference_bias(x.double(), gates.weight.double(), gates.bias.double(), H, mode == "bidirectional")
    logits = req.q.double() @ req.k.double().transpose(-1, -2) * D**-0.5 + bias[:, :, past:]
    if causal:
        future = torch.arange(12)[None, :] > torch.arange(past, 12)[:, None]
        logits = logits.masked_fill(future, float("-inf"))
    want = torch.softmax(logits, -1) @ req.v.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert limits == []  # so auto and a forced flex serve FoX, no longer refused as position-only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode,causal", [("causal", True), ("bidirectional", False)])
def test_gpu_flex_trains_fox_like_eager(mode, causal):
    """On a GPU flex runs first: its output and every gradient (the gates' through the token states
    the score_mod captures) equal eager's."""
    layer = _layer(mode, causal, dtype=torch.float32).cuda()
    x = torch.randn(2, 37, E, device="cuda")
    results = {}
    for backend in ("eager", "flex"):
        layer.zero_grad()
        x_in = x.clone().requires_grad_(True)
        with posenc.use_backend(backend):
            out = layer(x_in)
        assert layer.last_backend == backend
        (out * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
        results[backend] = [out.detach(), x_in.grad] + [p.grad for p in layer.parameters()]
    for got, want in zip(results["flex"], results["eager"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def test_flex_refuses_an_input_bias_without_a_pointwise_form():
    """An input-dependent bias that declares only the dense bias_from_states cannot run in a
    score_mod: flex states why, so auto passes it over and a forced flex raises with the reason."""

    class DenseOnlyFoX(FoX):
        def input_bias(self):
            return InputBias(self.token_states, self.bias_from_states)

    enc = DenseOnlyFoX(num_heads=H, dim=E)
    req = _flex_request(enc, torch.randn(1, 5, E), 0, causal=True)
    assert any("bias_at_index" in r for r in backend_limits(get_backend("flex"), req))


def test_auto_never_picks_a_position_only_backend():
    layer = _layer(dtype=torch.float32)
    layer(torch.randn(1, 600, E))  # long enough that blocked would serve a position-only bias
    assert layer.last_backend in ("eager", "sdpa")


def test_request_without_token_states_is_refused():
    enc = posenc.build("fox", num_heads=H, dim=E)
    q = torch.zeros(1, H, 4, D)
    pos = torch.arange(4)[None]
    with pytest.raises(ValueError, match="token_states"):
        AttentionRequest.from_keywords(
            q=q, k=q, v=q, encoding=enc, q_pos=pos, k_pos=pos, scale=1.0, causal=True
        )
    alibi = posenc.build("alibi", num_heads=H)
    states = TokenStates.same_sequence(torch.zeros(1, H, 4))
    with pytest.raises(ValueError, match="not an input-dependent bias"):
        AttentionRequest(q=q, k=q, v=q, encoding=alibi, q_pos=pos, k_pos=pos, scale=1.0, token_states=states)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("fox:mode=forward", "mode"),
        ("fox:post_log_scale=0", "post_log_scale"),
        ("fox:post_log_scale=-1", "> 0"),
    ],
)
def test_bad_options_name_the_option(spec, match):
    with pytest.raises(ValueError, match=match):
        posenc.build(spec, num_heads=H, dim=E)


def test_causal_mode_refuses_a_bidirectional_layer():
    with pytest.raises(ValueError, match="causal"):
        posenc.MultiheadAttention(E, H, encoding="fox", causal=False)


def test_model_trains_and_decodes_with_fox():
    torch.manual_seed(0)
    model = posenc.TransformerLM(
        vocab_size=11, d_model=E, num_heads=H, num_layers=2, encoding="fox", max_len=32
    ).double()
    tokens = torch.randint(0, 11, (2, 9))
    logits = model(tokens)
    logits.sum().backward()
    assert model.blocks[0].attn.encoding.to_gates.weight.grad is not None
    cache = posenc.KVCache()
    steps = torch.cat([model(tokens[:, t : t + 1], cache=cache) for t in range(9)], 1)
    torch.testing.assert_close(steps, logits.detach(), rtol=1e-9, atol=1e-10)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
def test_bias_equals_x_transformers_data_dependent_alibi(mode):
    """x-transformers ``DataDependentAlibi`` with copied gate weights gives the same bias ``[B, H, T, T]``
    (in causal mode only its lower triangle counts: the causal mask hides the rest)."""
    xt = pytest.importorskip("x_transformers.x_transformers")
    torch.manual_seed(1)
    reference = xt.DataDependentAlibi(
        E, H, causal=mode == "causal", bias_init=3.0, post_log_scale=0.5
    ).double()
    enc = posenc.build(f"fox:mode={mode},bias_init=3.0,post_log_scale=0.5", num_heads=H, dim=E).double()
    linear = reference.to_forget_gates[0]
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.5)
        enc.to_gates.weight.copy_(linear.weight)
        enc.to_gates.bias.copy_(linear.bias)
    x = torch.randn(2, 13, E, dtype=torch.float64)
    got = enc.bias_from_states(TokenStates.same_sequence(enc.token_states(x)))
    want = reference(x)
    if mode == "causal":
        keep = torch.tril(torch.ones(13, 13, dtype=torch.bool))
        got, want = got[..., keep], want[..., keep]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
def test_fused_causal_path_equals_the_dense_bias(mode, monkeypatch):
    """Under a plain causal mask sdpa runs FoX with the key term in an extra head dimension (no L x L
    bias): outputs and every gradient equal eager's dense bias in float64."""
    import posenc.backends.sdpa as sdpa

    calls = []
    fused = sdpa._key_term_attention
    monkeypatch.setattr(sdpa, "_key_term_attention", lambda *a: calls.append(1) or fused(*a))
    layer = _layer(mode, causal=True, num_kv_heads=1)
    x = torch.randn(2, 37, E, dtype=torch.float64)
    results = {}
    for backend in ("eager", "sdpa"):
        layer.zero_grad()
        x_in = x.clone().requires_grad_(True)
        with posenc.use_backend(backend):
            out = layer(x_in)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results[backend] = [out.detach(), x_in.grad] + [p.grad for p in layer.parameters()]
    assert calls == [1]
    for got, want in zip(results["sdpa"], results["eager"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_fused_causal_path_in_float32_at_length_2048():
    layer = _layer(dtype=torch.float32)
    with torch.no_grad():
        layer.encoding.to_gates.bias.fill_(1.0)  # gates near 0.73: c spans about 640 over 2048 tokens
    x = torch.randn(1, 2048, E)
    with torch.no_grad():
        with posenc.use_backend("sdpa"):
            fast = layer(x).double()
        with posenc.use_backend("eager"):
            dense32 = layer(x).double()
            exact = layer.double()(x.double())
    # No worse than the dense float32 bias, which rounds c_i - c_j from values of |c| up to 640.
    fast_error, dense_error = (fast - exact).abs().max(), (dense32 - exact).abs().max()
    assert fast_error <= 2 * dense_error + 1e-6, (fast_error, dense_error)
    assert fast_error < 1e-4


def test_forcing_a_position_only_backend_is_a_value_error_naming_its_reason():
    layer = _layer(dtype=torch.float32, backend="blocked")
    with pytest.raises(
        ValueError, match=r"backend 'blocked' cannot run this request: .*depends on the layer input"
    ):
        layer(torch.randn(1, 300, E))
