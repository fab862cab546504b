"""Attention patterns as layer options: sliding windows, chunks, packed documents, prefix LM.

References: the same layer without the option plus an explicit boolean ``attn_mask`` written here
from the definition; HF ``masking_utils`` mask functions for windows and chunks; and, for packed
documents, each document run on its own.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.examples import build_example
from posenc.masks.attention_mask import AttentionMask

HEADS, HEAD_DIM = 2, 8
EMBED = HEADS * HEAD_DIM
NAMES = posenc.available()


def _layer(name: str, *, causal: bool = True, dtype=torch.float64, **options) -> posenc.MultiheadAttention:
    enc = build_example(name, num_heads=HEADS, head_dim=HEAD_DIM)
    torch.manual_seed(1)
    layer = posenc.MultiheadAttention(EMBED, HEADS, encoding=enc, causal=causal, **options)
    with torch.no_grad():
        for param in layer.encoding.parameters():
            if param.numel() and bool((param == 0).all()):
                param.normal_(0.0, 0.5)
    return layer.to(dtype).eval()


def _twin(layer: posenc.MultiheadAttention, **options) -> posenc.MultiheadAttention:
    """The same weights in a layer built with other pattern options."""
    twin = _layer(layer.encoding.name, causal=layer.causal, dtype=layer.q_proj.weight.dtype, **options)
    twin.load_state_dict(layer.state_dict())
    return twin


def _definition(q_len: int, *, window=None, chunk=None, prefix=None) -> torch.Tensor:
    """Allowed pairs ``[Tq, Tk]`` of a causal self-attention, written pair by pair."""
    allowed = torch.zeros(q_len, q_len, dtype=torch.bool)
    for i in range(q_len):
        for j in range(q_len):
            ok = j <= i or (prefix is not None and j < prefix)
            if window is not None:
                ok = ok and j > i - window
            if chunk is not None:
                ok = ok and j // chunk == i // chunk
            allowed[i, j] = ok
    return allowed


def _grads(out: torch.Tensor, inputs) -> list[torch.Tensor]:
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "options",
    [{"window": 4}, {"chunk": 5}, {"prefix": 6}, {"window": 3, "chunk": 7}],
    ids=["window4", "chunk5", "prefix6", "window3_chunk7"],
)
def test_pattern_equals_explicit_mask(name, options):
    """Forward and gradients (input and parameters) equal the plain layer with the mask written out."""
    length = 17
    prefix = options.get("prefix")
    layer_options = {k: v for k, v in options.items() if k != "prefix"}
    plain = _layer(name)
    patterned = _twin(plain, **layer_options)
    x = torch.randn(2, length, EMBED, dtype=torch.float64, requires_grad=True)
    if prefix is not None:
        if plain.encoding.causal_only:  # such encodings are undefined on future keys
            with pytest.raises(ValueError, match="prefix_len"):
                patterned(x, prefix_len=prefix)
            return
        # A causal layer never lets a user mask unmask future keys: the reference is bidirectional.
        plain = _layer(name, causal=False)
        plain.load_state_dict(patterned.state_dict())
    out = patterned(x, prefix_len=prefix)
    ref = plain(x, attn_mask=_definition(length, **options))
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-9)
    for got, want in zip(_grads(out, [x, *patterned.parameters()]), _grads(ref, [x, *plain.parameters()])):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("offset", [0, 5])
def test_window_and_chunk_equal_hf_masking_utils(offset):
    masking_utils = pytest.importorskip("transformers.masking_utils")
    q_len, k_len = 9, 9 + offset
    q_idx = torch.arange(q_len)[:, None] + offset  # HF indexes queries by cache position
    kv_idx = torch.arange(k_len)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    cases = {
        "window": (
            {"window": 4},
            masking_utils.sliding_window_causal_mask_function(4)(zero, zero, q_idx, kv_idx),
        ),
        "chunk": (
            {"chunk": 3},
            masking_utils.chunked_causal_mask_function(3, torch.zeros(1, dtype=torch.long))(
                zero, zero, q_idx, kv_idx
            ),
        ),
    }
    for label, (options, hf) in cases.items():
        mask = AttentionMask.build(
            q_len=q_len, k_len=k_len, batch=1, heads=1, causal=True, causal_offset=offset, **options
        )
        assert torch.equal(mask.dense()[0, 0], hf), label


def _split_documents(lengths: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    ids, spans, start = [], [], 0
    for doc, size in enumerate(lengths):
        ids += [doc] * size
        spans.append((start, start + size))
        start += size
    return torch.tensor(ids), spans


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_packed_documents_equal_separate_runs(name, causal):
    """Each document of a packed row gives what it gives alone (positions restart at 0)."""
    if not causal and posenc.get_class(name).causal_only:
        pytest.skip(f"{name} is causal only")
    try:
        layer = _layer(name, causal=causal)
    except ValueError as err:
        pytest.skip(f"{name} refuses a non-causal layer: {err}")
    ids, spans = _split_documents([5, 1, 7, 4])
    x = torch.randn(1, len(ids), EMBED, dtype=torch.float64, requires_grad=True)
    out = layer(x, document_ids=ids[None])
    pieces = [layer(x[:, a:b]) for a, b in spans]
    torch.testing.assert_close(out, torch.cat(pieces, dim=1), rtol=1e-7, atol=1e-9)
    params = [p for p in layer.parameters() if p.requires_grad]
    got = _grads(out, [x, *params])
    want = _grads(torch.cat(pieces, dim=1), [x, *params])
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "shaw", "learned", "cope"])
@pytest.mark.parametrize(
    "options",
    [{"window": 4}, {"chunk": 5}, {"documents": True}, {"prefix": 6}],
    ids=["window", "chunk", "documents", "prefix"],
)
def test_cached_decoding_equals_full_pass(name, options):
    length = 15
    layer_options = {k: v for k, v in options.items() if k in ("window", "chunk")}
    layer = _layer(name, **layer_options)
    if options.get("prefix") and layer.encoding.causal_only:
        pytest.skip(f"{name} is causal only: no prefix LM")
    x = torch.randn(2, length, EMBED, dtype=torch.float64)
    docs = torch.tensor([[0] * 6 + [1] * 9, [0] * 2 + [3] * 13]) if options.get("documents") else None
    prefix = options.get("prefix")
    full = layer(x, document_ids=docs, prefix_len=prefix)
    cache = posenc.KVCache()
    pieces, start = [], 0
    for size in [prefix, 4, 1, length - prefix - 5] if prefix else [4, 1, 6, 4]:
        step_docs = None if docs is None else docs[:, start : start + size]
        pieces.append(
            layer(x[:, start : start + size], document_ids=step_docs, prefix_len=prefix, cache=cache)
        )
        start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "blocked"])
def test_blocked_skips_keys_outside_the_window_and_documents(backend):
    """Key ranges with a start (windows, later documents) give what eager gives, gradients included."""
    layer = _layer("t5", window=5)
    x = torch.randn(2, 37, EMBED, dtype=torch.float64, requires_grad=True)
    docs = torch.tensor([[0] * 20 + [1] * 17, [0] * 3 + [1] * 30 + [2] * 4])
    with posenc.use_backend("eager"):
        ref = layer(x, document_ids=docs)
    with posenc.use_backend(backend):
        out = layer(x, document_ids=docs)
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-9)
    params = [x, *layer.parameters()]
    for g, w in zip(_grads(out, params), _grads(ref, params)):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-8)


def test_document_positions_restart():
    ids = torch.tensor([[0, 0, 0, 1, 1, 4, 4, 4, 4]])
    assert posenc.layers.positions.document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]


@pytest.mark.parametrize(
    "options,call,match",
    [
        ({"window": 0}, {}, "window must be a positive int"),
        ({"window": -3}, {}, "window must be a positive int"),
        ({"chunk": 0}, {}, "chunk must be a positive int"),
        ({"window": 2.5}, {}, "window must be a positive int"),
        ({"chunk": 4, "causal": False}, {}, "chunk=4 needs causal=True"),
        ({}, {"document_ids": torch.zeros(2, 5)}, "document_ids must be an integer tensor"),
        ({}, {"document_ids": torch.zeros(2, 4, dtype=torch.long)}, r"document_ids must have shape \[B, T\]"),
        ({}, {"document_ids": torch.tensor([[0, 1, 0, 1, 1]] * 2)}, "non-decreasing"),
        ({}, {"prefix_len": 6}, r"prefix_len must be in \[0, 5\]"),
        ({}, {"prefix_len": -1}, r"prefix_len must be in \[0, 5\]"),
        ({}, {"prefix_len": torch.tensor([1, 2, 3])}, r"prefix_len must have shape \[B\]"),
        ({"causal": False}, {"prefix_len": 2}, "prefix_len needs a causal layer"),
    ],
)
def test_bad_pattern_options_name_the_parameter(options, call, match):
    causal = options.pop("causal", True)
    with pytest.raises(ValueError, match=match):
        layer = posenc.MultiheadAttention(EMBED, HEADS, "rope", causal=causal, **options)
        layer(torch.randn(2, 5, EMBED), **call)


def test_documents_need_self_attention():
    layer = posenc.MultiheadAttention(EMBED, HEADS, "rope")
    with pytest.raises(ValueError, match="document_ids applies to self-attention only"):
        layer(
            torch.randn(1, 3, EMBED),
            torch.randn(1, 4, EMBED),
            document_ids=torch.zeros(1, 3, dtype=torch.long),
        )


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "shaw", "learned", "fire"])
def test_windowed_layer_cache_keeps_only_what_the_window_sees(name):
    layer = _layer(name, window=4)
    x = torch.randn(2, 19, EMBED, dtype=torch.float64)
    full = layer(x)
    cache, pieces = posenc.KVCache(), []
    for a, b in ((0, 6), (6, 7), (7, 8), (8, 13), (13, 19)):
        pieces.append(layer(x[:, a:b], cache=cache))
        assert cache.length(0) <= 3  # window - 1: all the next query can see
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "shaw", "nope"])
def test_streaming_cache_keeps_sinks_and_a_window_with_positions_inside_the_cache(name):
    """StreamingLLM: once tokens are evicted, each step equals a full pass over the kept tokens
    (sinks, then the window, then the new token) at positions 0, 1, ... of the cache."""
    sinks, window = 2, 5
    layer = _layer(name)
    x = torch.randn(1, 30, EMBED, dtype=torch.float64)
    cache = posenc.KVCache(recent_tokens=window, sink_tokens=sinks)
    prompt = 4
    out = layer(x[:, :prompt], cache=cache)
    torch.testing.assert_close(out, layer(x[:, :prompt]))  # nothing evicted yet: the plain pass
    for t in range(prompt, 30):
        step = layer(x[:, t : t + 1], cache=cache)
        kept = torch.cat([x[:, : min(sinks, t)], x[:, max(sinks, t - window) : t + 1]], dim=1)
        torch.testing.assert_close(step, layer(kept)[:, -1:], rtol=1e-7, atol=1e-9)
        assert cache.length(0) <= sinks + window  # memory O(sinks + window)


def test_streaming_cache_refuses_what_it_cannot_honour():
    cache = posenc.KVCache(recent_tokens=4, sink_tokens=1)
    with pytest.raises(ValueError, match="positions: a streaming KVCache"):
        _layer("rope")(torch.randn(1, 2, EMBED, dtype=torch.float64), positions=torch.arange(2), cache=cache)
    with pytest.raises(ValueError, match="'learned' adds absolute positions"):
        _layer("learned")(torch.randn(1, 2, EMBED, dtype=torch.float64), cache=cache)
    with pytest.raises(ValueError, match="recent_tokens must be a positive int"):
        posenc.KVCache(recent_tokens=0)
    with pytest.raises(ValueError, match="sink_tokens needs recent_tokens"):
        posenc.KVCache(sink_tokens=2)


def test_kvcache_window_is_refused_naming_recent_tokens():
    """``window`` is a layer's sliding-window mask only; the cache's StreamingLLM retention is
    ``recent_tokens``, and the old name is refused with the new one."""
    with pytest.raises(TypeError, match=r"recent_tokens=.*window= is a layer's sliding-window mask"):
        posenc.KVCache(window=4, sink_tokens=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'windows'"):
        posenc.KVCache(windows=4)
    assert posenc.KVCache(recent_tokens=4, sink_tokens=1).streaming
