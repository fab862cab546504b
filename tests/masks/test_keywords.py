"""The keywords that describe a mask (posenc.masks.keywords), checked where the mask is built
(``AttentionMask.build``): a wrong ``causal``, ``causal_offset``, ``key_padding_mask`` or ``attn_mask``
raises a ``MaskKeywordError`` naming the keyword and what it must be; right ones build the mask whose
pairs are written out here by hand."""

from __future__ import annotations

import pytest
import torch

from posenc.masks.attention_mask import AttentionMask
from posenc.masks.keywords import MaskKeywordError

SIZES = dict(q_len=3, k_len=4, batch=1, heads=2)


@pytest.mark.parametrize(
    "keywords, keyword, message",
    [
        ({"causal": 1}, "causal", "must be True or False, got 1"),
        ({"causal_offset": -1}, "causal_offset", "must be an int >= 0 (the cache length), got -1"),
        (
            {"causal": True, "causal_offset": 2.0},
            "causal_offset",
            "must be an int >= 0 (the cache length), got 2.0",
        ),
        (
            {"causal": True, "causal_offset": True},
            "causal_offset",
            "must be an int >= 0 (the cache length), got True",
        ),
        (
            {"key_padding_mask": torch.zeros(1, 4)},
            "key_padding_mask",
            "must be a bool tensor [B, Tk] (True = padding), got a torch.float32 tensor of shape [1, 4]",
        ),
        (
            {"key_padding_mask": torch.zeros(2, 5, dtype=torch.bool)},
            "key_padding_mask",
            "must have shape [B, Tk] = [1, 4], got [2, 5]",
        ),
        (
            {"attn_mask": torch.zeros(1, 1, 3, 4, dtype=torch.int64)},
            "attn_mask",
            "must be a bool (True = may attend) or float tensor, got a torch.int64 tensor of shape [1, 1, 3, 4]",
        ),
        (
            {"attn_mask": torch.zeros(3, 4, dtype=torch.bool)},
            "attn_mask",
            "must be 4-D and broadcastable to [B, H, Tq, Tk] = [1, 2, 3, 4], got [3, 4]",
        ),
        (
            {"attn_mask": torch.zeros(1, 3, 3, 4, dtype=torch.bool)},
            "attn_mask",
            "must be 4-D and broadcastable to [B, H, Tq, Tk] = [1, 2, 3, 4], got [1, 3, 3, 4]",
        ),
    ],
)
def test_a_wrong_keyword_is_named_with_what_it_must_be(keywords, keyword, message):
    with pytest.raises(MaskKeywordError) as error:
        AttentionMask.build(**SIZES, **keywords)
    assert error.value.keyword == keyword
    assert str(error.value) == f"{keyword}: {message}"


def test_right_keywords_build_the_pairs_they_describe():
    # Queries at 1, 2, 3 (a cache of one) see keys j <= i; key 0 is padding.
    padding = torch.tensor([[True, False, False, False]])
    mask = AttentionMask.build(**SIZES, causal=True, causal_offset=1, key_padding_mask=padding)
    assert mask.dense()[0, 0].int().tolist() == [[0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
    # A user mask broadcast over heads and queries: key 1 hidden from every row.
    keep = torch.tensor([True, False, True, True]).view(1, 1, 1, 4)
    mask = AttentionMask.build(**SIZES, attn_mask=keep)
    assert mask.dense()[0, 0].tolist() == [[True, False, True, True]] * 3
