"""The mask components (posenc.masks.components): a sliding window, chunks and a prefix LM as layer options
give the same output as an explicit boolean attn_mask written here from the definition; bidirectional
windows and Llama 4's chunks equal HF's masking_utils, padded, packed and at a cache offset."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import Gemma3TextConfig, Llama4TextConfig, ModernBertConfig
from transformers import masking_utils as mu
from transformers.models.gemma3 import modeling_gemma3 as gemma3

import posenc
from _mask_rows import (
    _assert_mask_equals,
    _build,
    _emb,
    _hf_sdpa,
    _left_padded,
    _no_cache,
    _stepwise,
)
from _patterns import EMBED, HEADS, NAMES, _grads, _layer
from posenc.masks.attention_mask import (
    AttentionMask,
    BidirectionalWindowMask,
    ChunkMask,
    convert_window,
)


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


# ----------------------------------------------------------------------------
# Issue 36's masks against HF's ``masking_utils`` (called directly, tiny shapes, no downloads).


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
