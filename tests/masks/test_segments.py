"""The key segments of a block of query rows (posenc.masks._segments, AttentionMask.segments): a window's
block splits into anticausal, full and causal runs, a document's into full and causal, and the segments
rebuilt give exactly the mask's own rows."""

from __future__ import annotations

import pytest
import torch

from posenc.masks.attention_mask import AttentionMask

# ---------------------------------------------------------------------------- mask segments


def _segments(mask, i0, i1):
    return [(s.batch, s.k0, s.k1, s.pattern) for s in mask.segments(i0, i1)]


def test_window_block_splits_into_anticausal_full_causal():
    mask = AttentionMask.build(q_len=64, k_len=64, batch=1, heads=1, causal=True, window=20)
    # rows 32..39 see keys (i - 20, i]: 13..32 for the first, 20..39 for the last
    assert _segments(mask, 32, 40) == [
        (None, 13, 21, "anticausal"),
        (None, 21, 32, "full"),
        (None, 32, 40, "causal"),
    ]
    # the first block sees keys from 0 only: no anticausal square
    assert _segments(mask, 0, 8) == [(None, 0, 8, "causal")]


def test_document_block_splits_into_full_and_causal():
    docs = torch.tensor([[0] * 16 + [1] * 32])
    mask = AttentionMask.build(
        q_len=48, k_len=48, batch=1, heads=1, causal=True, q_document_ids=docs, k_document_ids=docs
    )
    assert _segments(mask, 32, 40) == [(None, 16, 32, "full"), (None, 32, 40, "causal")]
    assert _segments(mask, 12, 20)[0][3] == "masked"  # a block across the boundary


@pytest.mark.parametrize(
    "options",
    [
        {"causal": True, "window": 7},
        {"causal": True, "chunk": 5},
        {"causal": True, "causal_offset": 9},
        {"causal": False},
        {"causal": True, "prefix": True},
        {"causal": True, "padding": True},
    ],
    ids=lambda o: "-".join(sorted(o)),
)
def test_segments_cover_exactly_the_visible_keys(options):
    """Rebuilt from its segments, every block equals the mask's own rows."""
    options = dict(options)
    batch, q_len, k_len = 2, 29, 29 + options.get("causal_offset", 0)
    if options.pop("prefix", False):
        options["prefix_len"] = torch.tensor([4, 11])
    if options.pop("padding", False):
        options["key_padding_mask"] = torch.zeros(batch, k_len, dtype=torch.bool)
        options["key_padding_mask"][1, :5] = True
    mask = AttentionMask.build(q_len=q_len, k_len=k_len, batch=batch, heads=1, **options)
    for i0 in range(0, q_len, 8):
        i1 = min(q_len, i0 + 8)
        rebuilt = torch.zeros(batch, i1 - i0, k_len, dtype=torch.bool)
        for seg in mask.segments(i0, i1):
            rows = range(batch) if seg.batch is None else [seg.batch]
            n = seg.k1 - seg.k0
            square = torch.ones(n, n, dtype=torch.bool)
            part = {
                "full": torch.ones(i1 - i0, n, dtype=torch.bool),
                "causal": square.tril(),
                "anticausal": square.triu(),
            }.get(seg.pattern)
            for b in rows:
                rebuilt[b, :, seg.k0 : seg.k1] |= part if part is not None else seg.allowed[0]
        expected = mask.rows(i0, i1)
        expected = torch.ones_like(rebuilt) if expected is None else expected[:, 0].expand_as(rebuilt)
        assert torch.equal(rebuilt, expected), (options, i0)
