"""The near band of the clipped split (posenc.backends.parts.clipped_near): the strided views where the
declared index is affine on the band, the gathers where it is not, and the band cut into pieces (blocks,
groups of heads, one block of one head), against eager in float64, every gradient included."""

from __future__ import annotations

import pytest
import torch

import posenc
from _clipped import (
    DIM,
    F64,
    HEADS,
    _assert_equals_eager,
    _assert_layer_equals_eager,
    _request,
    _split_at_every_length,
)
from posenc.backends import clipped
from posenc.backends.clipped import clipped_attention


def _spy_slopes(monkeypatch) -> list:
    """Record the slope each call's near band takes (None: it gathers by the index)."""
    slopes = []
    original = clipped._slope_over_band

    def spy(index, block, causal):
        slopes.append(original(index, block, causal))
        return slopes[-1]

    monkeypatch.setattr(clipped, "_slope_over_band", spy)
    return slopes


#: Piece sizes that force the near band through each way of cutting it (``HEADS`` = 3, batch 2, float64,
#: blocks of 8 against 16 or 24 keys): one piece; several blocks of all heads; two heads at a time
#: (causal); one block of one head.
PIECES = {"whole": None, "blocks": 20_000, "heads": 2_100, "tiny": 1}


@pytest.mark.parametrize("pieces", list(PIECES))
@pytest.mark.parametrize("path", ["strided", "gather"])
@pytest.mark.parametrize("value_term", [True, False], ids=["values", "keys-only"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("length", [37, 53])
def test_near_band_paths_and_pieces_equal_eager(
    length, causal, per_head, value_term, path, pieces, monkeypatch
):
    """Shaw with k equal to the block (8) is ``d + k`` on the whole near band: the strided views; k=4
    saturates inside it: the gathers. ``tiny`` forces pieces of one block of one head (each piece's
    tables and adjoints must line up with its own rows and keys; ``blocks`` and ``heads`` cut it
    into several blocks of all heads and into groups of heads); 37 and 53 leave partial blocks."""
    monkeypatch.setattr(clipped, "CLIPPED_BLOCK", 8)
    if PIECES[pieces] is not None:
        monkeypatch.setattr(clipped, "NEAR_PIECE_BYTES", PIECES[pieces])
    slopes = _spy_slopes(monkeypatch)
    torch.manual_seed(length + 10 * causal)
    k = 8 if path == "strided" else 4
    enc = posenc.build(
        f"shaw:k={k},per_head={per_head},value_term={value_term}", head_dim=DIM, num_heads=HEADS
    ).double()
    req = _request(enc, length, causal, kv_heads=1 if per_head else None)
    out = clipped_attention(req)
    assert slopes == ([1] if path == "strided" else [None])
    _assert_equals_eager(out, req, enc, *F64)


@pytest.mark.parametrize("pieces", ["whole", "tiny"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("terms", ["c2p|p2c", "c2p", "p2c"])
@pytest.mark.parametrize("buckets", [-1, 8], ids=["linear", "log-buckets"])
def test_deberta_near_band_paths_equal_eager(buckets, terms, causal, pieces, monkeypatch):
    """DeBERTa without buckets reads row ``span − d`` on the near band (slope −1: the tables are
    flipped for c2p, not for p2c); with log buckets it gathers. Every gradient, projections included,
    with pieces of the whole band and of one block of one head."""
    _split_at_every_length(monkeypatch, pieces)
    slopes = _spy_slopes(monkeypatch)
    torch.manual_seed(8)
    spec = f"deberta:position_buckets={buckets},max_relative_positions=20,pos_att_type={terms}"
    layer = posenc.MultiheadAttention(24, 3, spec, causal=causal).double()
    x = torch.randn(2, 87, 24, dtype=torch.float64, requires_grad=True)
    inputs = [x, *(p for p in layer.parameters() if p.requires_grad)]
    with posenc.use_backend("clipped"):
        out = layer(x)
    assert slopes == ([-1] if buckets == -1 else [None])
    _assert_layer_equals_eager(layer, x, out, inputs)


def _spy_blocks(monkeypatch) -> list:
    """Record each call's near block and key blocks before it."""
    layouts = []
    original = clipped._blocks_for

    def spy(*args):
        layouts.append(original(*args))
        return layouts[-1]

    monkeypatch.setattr(clipped, "_blocks_for", spy)
    return layouts


@pytest.mark.parametrize("pieces", ["whole", "tiny"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize(
    "spec, layout",
    [
        # rows 22 − d, constant from d = −21 and from d = 22: the band must reach 20 (causal) or 21;
        # three blocks of 7 reach 21, where row 43 is still on the line
        ("deberta:position_buckets=-1,max_relative_positions=22", {True: (7, 3), False: (7, 3)}),
        # log buckets gather: rows past the far distance are constant, which the gathers read as they are
        ("deberta:position_buckets=8,max_relative_positions=22", None),
        # Shaw k=8: clip(d, -8, 8) + 8 leaves its line at 9, so two blocks of 4 (three of 3 would reach 9)
        ("shaw:k=8,value_term=True", {True: (4, 2), False: (4, 2)}),
    ],
    ids=["deberta-linear", "deberta-buckets", "shaw-values"],
)
def test_near_bands_of_several_key_blocks_equal_eager(spec, layout, causal, pieces, monkeypatch):
    """Blocks smaller than the near distance, with ``back`` key blocks before (and after) each: the
    skewed views' offsets, the zero keys in front, the edge blocks' masks and the far part starting
    at ``back · b + 1``, forward and every gradient, in one piece and in pieces of one block."""
    monkeypatch.setattr(clipped, "CLIPPED_BLOCK", 2 if spec.startswith("shaw") else 4)
    _split_at_every_length(monkeypatch, pieces)
    layouts = _spy_blocks(monkeypatch)
    torch.manual_seed(11)
    if spec.startswith("shaw"):
        enc = posenc.build(spec, head_dim=DIM, num_heads=HEADS).double()
        req = _request(enc, 53, causal)
        out = clipped_attention(req)
        assert layouts == [layout[causal]]
        _assert_equals_eager(out, req, enc, *F64)
        return
    layer = posenc.MultiheadAttention(24, 3, spec, causal=causal).double()
    x = torch.randn(2, 87, 24, dtype=torch.float64, requires_grad=True)
    inputs = [x, *(p for p in layer.parameters() if p.requires_grad)]
    with posenc.use_backend("clipped"):
        out = layer(x)
    assert len(layouts) == 1 and layouts[0][1] > 1
    if layout is not None:
        assert layouts == [layout[causal]]
    _assert_layer_equals_eager(layer, x, out, inputs)
