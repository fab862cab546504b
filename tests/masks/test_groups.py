"""Mask components over groups of tokens (posenc.masks.groups): packed documents equal each document run on
its own; Gemma 3's image groups and packed documents equal HF's masks."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig
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
)
from _patterns import EMBED, HEADS, NAMES, _grads, _layer
from posenc.masks.attention_mask import (
    BlockwiseCausalMask,
)


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


def test_documents_need_self_attention():
    layer = posenc.MultiheadAttention(EMBED, HEADS, "rope")
    with pytest.raises(ValueError, match="document_ids applies to self-attention only"):
        layer(
            torch.randn(1, 3, EMBED),
            torch.randn(1, 4, EMBED),
            document_ids=torch.zeros(1, 3, dtype=torch.long),
        )


# ----------------------------------------------------------------------------
# Issue 36's masks against HF's ``masking_utils`` (called directly, tiny shapes, no downloads).


# ---------------------------------------------------------------------------- blockwise groups


def _token_types(batch: int, length: int) -> torch.Tensor:
    """Gemma 3's ``token_type_ids`` (1 = image token): two images in row 0, one in row 1."""
    types = torch.zeros(batch, length, dtype=torch.long)
    types[0, 2:5] = 1
    types[0, 7:10] = 1
    types[1, 5:9] = 1
    return types


def _with_mask(attn, allowed):
    """``attn.forward`` as a non-causal, windowless layer under ``allowed``."""
    forward = attn.forward

    def call(x, **kw):
        attn.causal, attn.window = False, None
        return forward(x, attn_mask=allowed, **kw)

    return call


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


def test_group_ids_without_a_group_are_plain_causal():
    """``-1`` everywhere (a decode step's token, text only) adds no component: SDPA's ``is_causal`` path
    stays open."""
    mask = _build(9, 9, causal=True, group_ids=torch.full((2, 9), -1))
    assert mask.is_plain_causal
    assert not _build(9, 9, causal=True, group_ids=torch.tensor([[-1] * 8 + [0]] * 2)).is_plain_causal
