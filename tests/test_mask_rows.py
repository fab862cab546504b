"""Issue 36's masks against HF's ``masking_utils`` (called directly, tiny shapes, no downloads).

* a bidirectional sliding window (ModernBERT, T5Gemma, EmbeddingGemma):
  :class:`~posenc.masks.attention_mask.BidirectionalWindowMask`, ``window=`` on a non-causal layer;
* blockwise bidirectional groups (Gemma 3 / 4 image tokens): :class:`~posenc.masks.attention_mask.BlockwiseCausalMask`,
  ``group_ids=``;
* chunks counted from each row's first real token (Llama 4, a left-padded batch): ``ChunkMask``'s
  ``left_padding``;
* the window conventions and :func:`~posenc.masks.attention_mask.convert_window`.

Each mask is checked whole (``dense``), as FlexAttention's ``mask_mod`` and block by block
(``rows`` over ``key_range``, which must never cut off a visible key), padded, packed and at a cache
offset; each comparison has a neighbour (one window wider, no shift, no groups) that differs, so
it can fail. The layers then run on every backend that serves the mask, forward and backward, and
in cached decoding.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import Gemma3TextConfig, Llama4TextConfig, ModernBertConfig
from transformers import masking_utils as mu
from transformers.models.gemma3 import modeling_gemma3 as gemma3

import posenc
from posenc.backends import AttentionRequest, get_backend
from posenc.backends.flex import flex_bias_attention
from posenc.masks.attention_mask import (
    WINDOW_CONVENTIONS,
    AttentionMask,
    BidirectionalWindowMask,
    BlockwiseCausalMask,
    ChunkMask,
    convert_window,
)

EMBED, HEADS = 16, 2


def _no_cache(create):
    """HF's mask builder ``create`` called without a cache, under the keyword its release names it
    (``cache`` from transformers 5.22, ``past_key_values`` before): bound by name, not version."""
    import inspect

    name = "cache" if "cache" in inspect.signature(create).parameters else "past_key_values"
    return lambda **kwargs: create(**kwargs, **{name: None})


def _hf_sdpa(mask_function, batch, q_len, k_len, past=0, keep=None):
    """HF's bool mask ``[B, 1, Tq, Tk]`` of ``mask_function`` (queries at ``past + i``), with HF's 2-D
    ``attention_mask`` ``keep [B, Tk]`` (1 = real token)."""
    return mu.sdpa_mask(
        batch, q_len, k_len, q_offset=past, mask_function=mask_function, attention_mask=keep,
        allow_is_causal_skip=False,
    )  # fmt: skip


def _assert_mask_equals(mask: AttentionMask, want: torch.Tensor) -> None:
    """``mask`` equals HF's ``want [B, 1, Tq, Tk]`` whole, as a mask_mod, and block by block."""
    batch, _, q_len, k_len = want.shape
    want = want.expand(batch, mask.heads, q_len, k_len)
    dense = mask.dense()
    assert torch.equal(torch.ones_like(want) if dense is None else dense.expand_as(want), want)
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in want.shape), indexing="ij")
    assert torch.equal(mask.mask_mod()(b, h, i, j).expand_as(want), want)
    for size in (1, 4, q_len):
        for i0 in range(0, q_len, size):
            i1 = min(q_len, i0 + size)
            lo, hi = mask.key_range(i0, i1)
            assert not want[..., i0:i1, :lo].any() and not want[..., i0:i1, hi:].any(), (i0, i1, lo, hi)
            rows = mask.rows(i0, i1, lo, hi)
            expected = want[..., i0:i1, lo:hi]
            assert torch.equal(
                torch.ones_like(expected) if rows is None else rows.expand_as(expected), expected
            )
    empty = mask.empty_rows()
    want_empty = ~want.any(dim=-1, keepdim=True)
    assert torch.equal(
        torch.zeros_like(want_empty) if empty is None else empty.expand_as(want_empty), want_empty
    )


def _left_padded(batch: int, length: int, pads=(0, 5)) -> torch.Tensor:
    """Bool ``[B, T]``, True = padding: row ``b`` starts with ``pads[b]`` padding tokens."""
    padding = torch.zeros(batch, length, dtype=torch.bool)
    for b, pad in enumerate(pads[:batch]):
        padding[b, :pad] = True
    return padding


def _build(q_len, k_len, batch=2, **options) -> AttentionMask:
    return AttentionMask.build(q_len=q_len, k_len=k_len, batch=batch, heads=HEADS, **options)


# ---------------------------------------------------------------------------- bidirectional window


@pytest.mark.parametrize("hf_window", [0, 1, 3, 36])
@pytest.mark.parametrize("q_len,past", [(37, 0), (1, 36), (5, 6)])
def test_bidirectional_window_equals_hf(hf_window, q_len, past):
    """``sliding_window_bidirectional_mask_function(w)`` (``|i - j| <= w``) is posenc's ``window = w +
    1`` on a non-causal layer: padded, and at a cache offset (HF's ``q_offset``)."""
    k_len = past + q_len
    padding = _left_padded(2, k_len)
    want = _hf_sdpa(mu.sliding_window_bidirectional_mask_function(hf_window), 2, q_len, k_len, past, ~padding)
    window = convert_window(hf_window, "hf", "posenc", causal=False)
    assert window == hf_window + 1
    options = dict(causal=False, causal_offset=past, key_padding_mask=padding)
    mask = _build(q_len, k_len, window=window, **options)
    assert any(isinstance(c, BidirectionalWindowMask) for c in mask.components)
    _assert_mask_equals(mask, want)
    if hf_window + 1 < k_len:  # one key narrower on each side is another mask (the check can fail)
        assert not torch.equal(
            _build(q_len, k_len, window=window - 1, **options).dense().expand_as(want), want
        )


def test_bidirectional_window_packed_equals_hf():
    """Packed documents under a bidirectional window: HF's ``and_masks`` of the window and
    ``packed_sequence_mask_function``; posenc's document ids with the window."""
    docs = torch.tensor([[0] * 11 + [1] * 20 + [2] * 6, [0] * 37])
    function = mu.and_masks(
        mu.sliding_window_bidirectional_mask_function(4), mu.packed_sequence_mask_function(docs)
    )
    want = _hf_sdpa(function, 2, 37, 37)
    _assert_mask_equals(
        _build(37, 37, causal=False, window=5, q_document_ids=docs, k_document_ids=docs), want
    )


def _emb(batch: int, length: int) -> torch.Tensor:
    return torch.zeros(batch, length, 8)


def test_modernbert_and_embedding_gemma_windows_equal_their_hf_masks():
    """The models' own mask creation: ModernBERT (``local_attention=L``: HF's inclusive ``L // 2``) and
    Gemma 3's bidirectional mode (EmbeddingGemma: ``sliding_window=S`` stored as ``S // 2 + 1``,
    compared exclusively)."""
    padding = _left_padded(2, 13, (0, 3))
    keep = (~padding).long()
    bert = ModernBertConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=2, local_attention=6, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, cls_token_id=1, sep_token_id=2)  # fmt: skip
    bert._attn_implementation = "sdpa"
    want = mu.create_bidirectional_sliding_window_mask(
        config=bert, inputs_embeds=_emb(2, 13), attention_mask=keep
    )
    window = convert_window(bert.sliding_window, "hf", "posenc", causal=False)
    assert window == 4  # |i - j| <= 3
    _assert_mask_equals(_build(13, 13, causal=False, window=window, key_padding_mask=padding), want)

    gemma = Gemma3TextConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=4, sliding_window=8,
                             use_bidirectional_attention=True)  # fmt: skip
    gemma._attn_implementation = "sdpa"
    assert gemma.sliding_window == 5  # 8 // 2 + 1
    want = _no_cache(mu.create_sliding_window_causal_mask)(
        config=gemma, inputs_embeds=_emb(2, 13), attention_mask=keep,
        position_ids=torch.arange(13)[None], or_mask_function=gemma3._bidirectional_window_overlay(5),
    )  # fmt: skip
    _assert_mask_equals(
        _build(13, 13, causal=False, window=gemma.sliding_window, key_padding_mask=padding), want
    )


# ---------------------------------------------------------------------------- blockwise groups


def _token_types(batch: int, length: int) -> torch.Tensor:
    """Gemma 3's ``token_type_ids`` (1 = image token): two images in row 0, one in row 1."""
    types = torch.zeros(batch, length, dtype=torch.long)
    types[0, 2:5] = 1
    types[0, 7:10] = 1
    types[1, 5:9] = 1
    return types


@pytest.mark.parametrize("padded", [False, True])
def test_image_groups_equal_gemma3_masks(padded):
    """Gemma 3's own ``create_masks_for_vision_model``: full layers OR(causal, blockwise), sliding
    layers AND(window, OR(causal, blockwise)); posenc's ``group_ids`` from its
    ``get_block_sequence_ids_for_mask``, with and without the window."""
    length = 13
    config = Gemma3TextConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=4, sliding_window=3)  # fmt: skip
    config._attn_implementation = "sdpa"
    padding = _left_padded(2, length, (0, 3)) if padded else None
    keep = None if padding is None else (~padding).long()
    groups = gemma3.get_block_sequence_ids_for_mask(_token_types(2, length))
    masks = gemma3.create_masks_for_vision_model(
        config, _emb(2, length), keep, None, torch.arange(length)[None], groups
    )
    options = dict(causal=True, key_padding_mask=padding, group_ids=groups)
    full = _build(length, length, **options)
    assert any(isinstance(c, BlockwiseCausalMask) for c in full.components)
    _assert_mask_equals(full, masks["full_attention"])
    _assert_mask_equals(_build(length, length, window=3, **options), masks["sliding_attention"])
    plain = _build(length, length, causal=True, key_padding_mask=padding).dense()
    assert not torch.equal(plain.expand_as(masks["full_attention"]), masks["full_attention"])  # groups matter


def test_image_groups_in_packed_documents_equal_hf():
    """HF's ``create_causal_mask`` on packed sequences (positions restarting at each document) with
    ``block_sequence_ids``: (causal or same group) and same document; posenc's document ids and group
    ids together."""
    config = Gemma3TextConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=4, sliding_window=3)  # fmt: skip
    config._attn_implementation = "sdpa"
    docs = torch.tensor([[0] * 6 + [1] * 9 + [2] * 5])
    positions = torch.cat([torch.arange(6), torch.arange(9), torch.arange(5)])[None]
    groups = torch.full((1, 20), -1)
    groups[0, 2:5], groups[0, 8:12], groups[0, 16:19] = 0, 1, 2
    want = _no_cache(mu.create_causal_mask)(
        config=config, inputs_embeds=_emb(1, 20), attention_mask=None, position_ids=positions,
        block_sequence_ids=groups,
    )  # fmt: skip
    mask = _build(20, 20, batch=1, causal=True, group_ids=groups, q_document_ids=docs, k_document_ids=docs)
    _assert_mask_equals(mask, want)


@pytest.mark.parametrize("window", [None, 4])
def test_image_groups_at_a_cache_offset_equal_hf(window):
    """A call after ``past`` cached keys: HF reads the group ids of every key (``q_offset``); posenc
    takes this call's ids only (earlier keys precede every query, so their ids never matter)."""
    past, q_len = 6, 31
    k_len = past + q_len
    ids = torch.full((2, k_len), -1)
    ids[0, 2:4], ids[0, 8:14], ids[0, 20:33], ids[1, 7:9], ids[1, 30:37] = 0, 1, 2, 0, 1
    function = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids))
    if window is not None:
        function = mu.and_masks(function, mu.sliding_window_overlay(window))
    padding = _left_padded(2, k_len, (0, 2))
    want = _hf_sdpa(function, 2, q_len, k_len, past, ~padding)
    mask = _build(q_len, k_len, causal=True, causal_offset=past, key_padding_mask=padding, window=window,
                  group_ids=ids[:, past:])  # fmt: skip
    _assert_mask_equals(mask, want)


# ---------------------------------------------------------------------------- chunks and left padding


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_chunks_start_at_the_first_real_token_as_in_llama4(chunk):
    """Llama 4's ``create_chunked_causal_mask`` counts chunks from each row's first real token
    (``(j - pad_b) // c == (i - pad_b) // c``); posenc does so whenever a padding mask is given."""
    length = 13
    config = Llama4TextConfig(vocab_size=32, hidden_size=8, intermediate_size=16, intermediate_size_mlp=16,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                              attention_chunk_size=chunk)  # fmt: skip
    config._attn_implementation = "sdpa"
    padding = _left_padded(2, length, (0, 3))
    want = _no_cache(mu.create_chunked_causal_mask)(
        config=config, inputs_embeds=_emb(2, length), attention_mask=(~padding).long(),
        position_ids=torch.arange(length)[None],
    )  # fmt: skip
    mask = _build(length, length, causal=True, chunk=chunk, key_padding_mask=padding)
    chunks = [c for c in mask.components if isinstance(c, ChunkMask)]
    assert chunks and chunks[0].left_padding.tolist() == [0, 3]
    _assert_mask_equals(mask, want)


@pytest.mark.parametrize("q_len,past", [(1, 36), (5, 8), (37, 0)])
def test_chunks_with_left_padding_at_a_cache_offset_equal_hf(q_len, past):
    """Batched generation: HF's ``chunked_causal_mask_function`` with its left padding count, queries
    at ``past + i``; without the shift the mask differs (the check can fail)."""
    k_len = past + q_len
    padding = _left_padded(3, k_len, (0, 5, 2))
    padding[0, 10] = True  # padding after the first real token does not move the chunks
    keep = (~padding).long()
    left = (keep.cumsum(dim=-1) == 0).sum(dim=-1)  # HF's count
    want = _hf_sdpa(mu.chunked_causal_mask_function(4, left), 3, q_len, k_len, past, keep)
    mask = _build(q_len, k_len, batch=3, causal=True, causal_offset=past, chunk=4, key_padding_mask=padding)
    _assert_mask_equals(mask, want)
    unshifted = _hf_sdpa(
        mu.chunked_causal_mask_function(4, torch.zeros(3, dtype=torch.long)), 3, q_len, k_len, past, keep
    )
    assert not torch.equal(unshifted, want)


# ---------------------------------------------------------------------------- layers on every backend


#: (layer options, call options) of each new mask, on a left-padded batch of 37 tokens.
LAYER_CASES = {
    "band": ({"causal": False, "window": 5}, {}),
    "groups": (
        {"causal": True},
        {"group_ids": torch.tensor([[-1] * 3 + [0] * 9 + [-1] * 25, [-1] * 20 + [0] * 17])},
    ),
    "groups_window": (
        {"causal": True, "window": 4},
        {"group_ids": torch.tensor([[-1] * 3 + [0] * 9 + [-1] * 5 + [1] * 20, [-1] * 20 + [0] * 17])},
    ),
    "chunks": ({"causal": True, "chunk": 6}, {}),
}


def _layer_grads(backend, encoding, layer_options, call, dtype=torch.float64):
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(EMBED, HEADS, encoding, backend=backend, **layer_options).to(dtype)
    x = torch.randn(2, 37, EMBED, dtype=dtype, requires_grad=True)
    out = layer(x, key_padding_mask=_left_padded(2, 37), **call)
    weight = torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)
    params = [x, *layer.parameters()]
    return layer.last_backend, out.detach(), torch.autograd.grad((out * weight).sum(), params)


@pytest.mark.parametrize("case", list(LAYER_CASES))
@pytest.mark.parametrize(
    "encoding,backends",
    [("rope", ["sdpa", "blocked", "segments"]), ("alibi:mode=symmetric", ["sdpa", "blocked"])],
)
def test_layers_equal_eager_on_every_backend(case, encoding, backends):
    """Output and gradients (input and every parameter) of each backend that serves the mask equal
    eager's, in float64."""
    layer_options, call = LAYER_CASES[case]
    _, ref, ref_grads = _layer_grads("eager", encoding, layer_options, call)
    for backend in backends:
        used, out, grads = _layer_grads(backend, encoding, layer_options, call)
        assert used == backend
        torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-9)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", ["band", "groups_window", "chunks"])
def test_flex_mask_mod_equals_eager(case):
    """FlexAttention takes each new component as a ``mask_mod`` (its uncompiled reference on CPU,
    forward in float32)."""
    layer_options, call = LAYER_CASES[case]
    padding = _left_padded(2, 37)
    causal = layer_options["causal"]
    mask = _build(37, 37, causal=causal, key_padding_mask=padding, window=layer_options.get("window"),
                  chunk=layer_options.get("chunk"), group_ids=call.get("group_ids"))  # fmt: skip
    enc = posenc.build("alibi:mode=symmetric", num_heads=HEADS)
    q, k, v = (torch.randn(2, HEADS, 37, 8) for _ in range(3))
    pos = torch.arange(37)[None]
    req = AttentionRequest(q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.3, mask=mask)
    ref, _ = get_backend("eager").run(req)
    torch.testing.assert_close(flex_bias_attention(req, compiled=False), ref, rtol=1e-5, atol=1e-6)


def test_auto_takes_the_window_backend_for_a_long_band():
    """At 700 tokens a band of 64 keys a side is served by ``segments`` (it skips the keys outside the
    band), and its output equals sdpa's dense masked call."""
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(32, 2, "rope", causal=False, window=64)
    x = torch.randn(1, 700, 32)
    with torch.no_grad():
        out = layer(x)
        assert layer.last_backend == "segments"
        layer.backend = "sdpa"
        torch.testing.assert_close(layer(x), out, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- cached decoding


def _stepwise(layer, x, steps, **call):
    """``layer`` over ``x`` in calls of ``steps`` tokens each, through one cache."""
    cache, outs, start = posenc.KVCache(), [], 0
    for size in steps:
        part = {k: (v[:, start : start + size] if k == "group_ids" else v) for k, v in call.items()}
        if "key_padding_mask" in part:
            part["key_padding_mask"] = call["key_padding_mask"][:, : start + size]
        outs.append(layer(x[:, start : start + size], cache=cache, **part))
        start += size
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("case", ["groups_window", "chunks"])
def test_cached_decoding_equals_one_call(case):
    """Prefill then one token at a time equals one call: the image groups lie inside the prefill, and
    the chunks keep counting from each row's first real token."""
    layer_options, call = LAYER_CASES[case]
    if "group_ids" in call:  # groups inside the 31 prefilled tokens, the decoded ones in none
        call = {
            "group_ids": torch.tensor(
                [[-1] * 3 + [0] * 9 + [-1] * 5 + [1] * 14 + [-1] * 6, [-1] * 20 + [0] * 11 + [-1] * 6]
            )
        }
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(EMBED, HEADS, "rope", **layer_options).double().eval()
    x = torch.randn(2, 37, EMBED, dtype=torch.float64)
    call = {**call, "key_padding_mask": _left_padded(2, 37)}
    with torch.no_grad():
        whole = layer(x, **call)
        steps = _stepwise(layer, x, [37 - 6] + [1] * 6, **call)
    real = ~_left_padded(2, 37)  # padded queries see no key in a chunk layer: compare the real ones
    torch.testing.assert_close(steps[real], whole[real], rtol=1e-9, atol=1e-11)


def test_bidirectional_window_in_calls_sees_the_keys_written_so_far():
    """A non-causal windowed layer fed in calls (an encoder over a stream): each query sees the keys
    within the window that exist when it runs, ``|i - j| < W`` and ``j`` before the end of its call;
    the cache keeps the window's ``W - 1`` newest keys. The reference is one eager call with that
    mask written out."""
    torch.manual_seed(0)
    window, steps = 5, [11, 7, 1, 18]
    layer = posenc.MultiheadAttention(EMBED, HEADS, "rope", causal=False, window=window).double()
    x = torch.randn(2, 37, EMBED, dtype=torch.float64)
    with torch.no_grad():
        got = _stepwise(layer, x, steps)
        ends = torch.repeat_interleave(torch.tensor(steps).cumsum(0), torch.tensor(steps))  # [T]
        i, j = torch.arange(37)[:, None], torch.arange(37)[None, :]
        allowed = ((i - j).abs() < window) & (j < ends[:, None])
        layer.window = None  # the written-out mask alone
        want = layer(x, attn_mask=allowed)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("window", [0, -2])
@pytest.mark.parametrize("causal", [True, False])
def test_a_window_of_zero_or_below_names_window(window, causal):
    with pytest.raises(ValueError, match="window must be a positive int"):
        posenc.MultiheadAttention(EMBED, HEADS, "rope", causal=causal, window=window)


def test_a_chunk_still_needs_a_causal_layer():
    with pytest.raises(ValueError, match="chunk=4 needs causal=True"):
        posenc.MultiheadAttention(EMBED, HEADS, "rope", causal=False, chunk=4)


@pytest.mark.parametrize(
    "layer_options,group_ids,extra,match",
    [
        ({}, torch.zeros(2, 4, dtype=torch.long), {}, r"group_ids must have shape \[B, T\] = \[2, 5\]"),
        ({}, torch.zeros(5, dtype=torch.long), {}, r"group_ids must have shape"),
        ({}, torch.zeros(2, 5), {}, "group_ids must be an integer tensor.*float32"),
        ({}, torch.zeros(2, 5, dtype=torch.bool), {}, "group_ids must be an integer tensor.*bool"),
        ({}, [[0] * 5] * 2, {}, "group_ids must be an integer tensor"),
        ({"causal": False}, torch.zeros(2, 5, dtype=torch.long), {}, "group_ids needs a causal layer"),
        ({}, torch.zeros(2, 5, dtype=torch.long), {"prefix_len": 2}, "prefix_len or group_ids, not both"),
        ({}, torch.zeros(2, 5, dtype=torch.long), {"context": True}, "group_ids applies to self-attention"),
    ],
)
def test_bad_group_ids_name_the_parameter(layer_options, group_ids, extra, match):
    layer = posenc.MultiheadAttention(EMBED, HEADS, "rope", **{"causal": True, **layer_options})
    x = torch.randn(2, 5, EMBED)
    if extra.pop("context", False):
        extra["context"] = torch.randn(2, 3, EMBED)
    with pytest.raises(ValueError, match=match):
        layer(x, group_ids=group_ids, **extra)


def test_group_ids_refused_for_a_causal_only_encoding():
    layer = posenc.MultiheadAttention(EMBED, HEADS, "fox", causal=True)
    with pytest.raises(ValueError, match="group_ids: encoding 'fox' is defined for causal attention only"):
        layer(torch.randn(2, 5, EMBED), group_ids=torch.zeros(2, 5, dtype=torch.long))


# ---------------------------------------------------------------------------- window conventions


def _band_of_posenc(window: int, causal: bool, length: int = 40) -> torch.Tensor:
    mask = _build(length, length, batch=1, causal=causal, window=window).dense()
    return mask[0, 0]


def _band_formula(left: int, right: int, length: int = 40) -> torch.Tensor:
    """FlashAttention's ``window_size=(left, right)``: ``i - left <= j <= i + right``, written out."""
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return (j >= i - left) & (j <= i + right)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 2, 5, 16])
def test_each_convention_describes_posenc_s_mask(window, causal):
    """posenc's ``window`` converted to each convention gives back the mask posenc builds: the flash
    band written out, HF's own mask function with the hf value, and the number of keys of a row away
    from the ends."""
    want = _band_of_posenc(window, causal)
    left, right = convert_window(window, "posenc", "flash", causal=causal)
    assert torch.equal(_band_formula(left, right), want)
    hf = convert_window(window, "posenc", "hf", causal=causal)
    function = (
        mu.sliding_window_causal_mask_function(hf)
        if causal
        else mu.sliding_window_bidirectional_mask_function(hf)
    )
    assert torch.equal(_hf_sdpa(function, 1, 40, 40)[0, 0], want)
    assert convert_window(window, "posenc", "keys", causal=causal) == int(want[20].sum())
    wider = _band_formula(left + 1, right + (0 if causal else 1))
    assert not torch.equal(wider, want)  # a convention off by one would fail


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("source", sorted(WINDOW_CONVENTIONS))
@pytest.mark.parametrize("target", sorted(WINDOW_CONVENTIONS))
def test_convert_window_round_trips(source, target, causal):
    """Every direction: posenc's windows 1..9 through ``source`` and ``target`` and back."""
    for window in range(1, 10):
        value = convert_window(window, "posenc", source, causal=causal)
        there = convert_window(value, source, target, causal=causal)
        assert convert_window(there, target, source, causal=causal) == value
        assert convert_window(there, target, "posenc", causal=causal) == window


def test_convert_window_known_values():
    """HF's flash path passes ``window_size=(sliding_window - 1, sliding_window - 1)``; Mistral's 4096 is
    4096 keys; ModernBERT's ``local_attention=128`` (HF's 64) keeps 129 keys."""
    assert convert_window(4096, "hf", "flash", causal=True) == (4095, 0)
    assert convert_window(4096, "hf", "keys", causal=True) == 4096
    assert convert_window(4096, "hf", "posenc", causal=True) == 4096
    assert convert_window(64, "hf", "posenc", causal=False) == 65
    assert convert_window(64, "hf", "flash", causal=False) == (64, 64)
    assert convert_window(64, "hf", "keys", causal=False) == 129
    assert convert_window((64, 64), "flash", "hf", causal=False) == 64
    assert convert_window(129, "keys", "posenc", causal=False) == 65


@pytest.mark.parametrize(
    "value,source,target,causal,match",
    [
        (0, "posenc", "hf", True, "value must be an int >= 1"),
        (-1, "hf", "posenc", False, "value must be an int >= 0"),
        ((3, 2), "flash", "posenc", False, r"bidirectional posenc window is a band \(left, left\)"),
        ((3, 1), "flash", "posenc", True, r"causal posenc window is a band \(left, 0\)"),
        ((-1, -1), "flash", "posenc", False, "no window"),
        (4, "flash", "posenc", False, "window_size, a tuple"),
        (4, "keys", "posenc", False, "odd number of keys"),
        (4, "mistral", "posenc", True, "source must be one of"),
        (4, "hf", "fa2", True, "target must be one of"),
        (2.5, "posenc", "hf", True, "value must be an int"),
    ],
)
def test_convert_window_bad_input_names_the_argument(value, source, target, causal, match):
    with pytest.raises(ValueError, match=match):
        convert_window(value, source, target, causal=causal)


# ---------------------------------------------------------------------------- posenc.hf: HF's bidirectional windows


def _bert():
    config = ModernBertConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=2, local_attention=6, global_attn_every_n_layers=3,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    return transformers.ModernBertForMaskedLM(config).double().eval(), "sdpa", lambda out: out.logits


def _t5gemma_encoder():
    layer = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, sliding_window=4, attn_logit_softcapping=None,
                 layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    config = transformers.T5GemmaConfig(encoder=layer, decoder=layer, vocab_size=50, is_encoder_decoder=False)
    torch.manual_seed(0)
    # (T5Gemma has no sdpa; its eager softmax runs in float32)
    return (
        transformers.T5GemmaEncoderModel(config).double().eval(),
        "eager",
        lambda out: out.last_hidden_state,
    )


@pytest.mark.hf
@pytest.mark.parametrize("name", ["modernbert", "t5gemma"])
@pytest.mark.parametrize("padded", [False, True])
def test_hf_bidirectional_sliding_layers_get_posenc_s_band(name, padded, monkeypatch):
    """Through ``posenc.hf`` an unpadded bidirectional sliding layer reaches the dispatcher as posenc's
    band (so the window backends can serve it), with the window its HF mask keeps (ModernBERT hands
    ``W``, T5Gemma ``W - 1``); a padded batch keeps HF's dense mask. Outputs and gradients equal HF's."""
    import posenc.hf as posenc_hf
    import posenc.hf._attention as bridge

    posenc_hf.register()
    seen = []
    original = bridge.attend
    monkeypatch.setattr(bridge, "attend", lambda *a, **kw: seen.append(kw["mask"]) or original(*a, **kw))
    model, reference, output = {"modernbert": _bert, "t5gemma": _t5gemma_encoder}[name]()
    ids = torch.randint(3, 50, (2, 19), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, 19, dtype=torch.long)
    if padded:
        keep[1, 15:] = 0
    real = keep.bool()

    def run(impl):
        model.set_attn_implementation(impl)
        model.zero_grad()
        out = output(model(ids, attention_mask=keep))[real]
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want, want_grads = run(reference)
    got, got_grads = run("posenc")
    # (T5Gemma's eager softmax runs in float32: float32's tolerance)
    tolerance = {"rtol": 1e-9, "atol": 1e-11} if reference == "sdpa" else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(got, want, **tolerance)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **{k: v * 10 for k, v in tolerance.items()})
    bands = [c for m in seen if m is not None for c in m.components if isinstance(c, BidirectionalWindowMask)]
    if padded:
        assert bands == []
        return
    hf_window = model.config.sliding_window if name == "modernbert" else model.config.encoder.sliding_window
    assert bands and {c.window for c in bands} == {convert_window(hf_window, "hf", "posenc", causal=False)}
    # One key wider on each side is not what HF computes: the comparison refuses it.
    query = torch.zeros(1, 1, 19, 4)
    band = _build(19, 19, batch=1, causal=False, window=bands[0].window).dense()
    assert bridge._window_mask(band, bands[0].window, query, query, causal=False) is not None
    assert bridge._window_mask(band, bands[0].window + 1, query, query, causal=False) is None


def test_a_gemma3_pattern_model_takes_group_ids():
    """``TransformerLM(pattern="gemma3")`` hands ``group_ids`` to every layer: the logits equal the same
    model whose layers get Gemma 3's masks written out as ``attn_mask`` (global: causal or same group;
    sliding: that and ``j > i - W``), and the groups change the logits."""
    torch.manual_seed(0)
    model = posenc.TransformerLM(
        vocab_size=40, d_model=16, num_heads=2, num_layers=3, pattern="gemma3:window=4,global_every=3"
    )
    tokens = torch.randint(0, 40, (2, 13))
    groups = gemma3.get_block_sequence_ids_for_mask(_token_types(2, 13))
    i, j = torch.arange(13)[:, None], torch.arange(13)[None, :]
    same = (groups[:, :, None] == groups[:, None, :]) & (groups[:, :, None] >= 0)  # [B, T, T]
    with torch.no_grad():
        with_groups = model(tokens, group_ids=groups)
        assert not torch.allclose(with_groups, model(tokens))
        for block in model.blocks:
            attn = block.attn
            allowed = (j <= i) | same
            if attn.window is not None:
                allowed = allowed & (j > i - attn.window)
            attn.forward = _with_mask(attn, allowed[:, None])
        torch.testing.assert_close(model(tokens), with_groups)


def _with_mask(attn, allowed):
    """``attn.forward`` as a non-causal, windowless layer under ``allowed``."""
    forward = attn.forward

    def call(x, **kw):
        attn.causal, attn.window = False, None
        return forward(x, attn_mask=allowed, **kw)

    return call


def test_group_ids_without_a_group_are_plain_causal():
    """``-1`` everywhere (a decode step's token, text only) adds no component: SDPA's ``is_causal`` path
    stays open."""
    mask = _build(9, 9, causal=True, group_ids=torch.full((2, 9), -1))
    assert mask.is_plain_causal
    assert not _build(9, 9, causal=True, group_ids=torch.tensor([[-1] * 8 + [0]] * 2)).is_plain_causal
