"""The clipped split (``posenc.backends.clipped``): Shaw's key and value terms with far keys through
the fused CPU flash kernel, checked against the eager backend (the paper's formula on dense
logits) in float64, forward and every gradient (queries, keys, values, both tables)."""

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
from posenc.backends import AttentionRequest, auto_reasons, clipped, get_backend
from posenc.backends.clipped import clipped_attention


@pytest.mark.parametrize("kv_heads", [None, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("value_term", [True, False], ids=["values", "keys-only"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("length", [37, 64])
def test_clipped_split_equals_eager(length, causal, per_head, value_term, kv_heads, monkeypatch):
    """Blocks of 8 with k=4 (37 leaves a partial block; 64 fills them): several far and near parts."""
    monkeypatch.setattr(clipped, "CLIPPED_BLOCK", 8)
    torch.manual_seed(length)
    enc = posenc.build(
        f"shaw:k=4,per_head={per_head},value_term={value_term}", head_dim=DIM, num_heads=HEADS
    ).double()
    req = _request(enc, length, causal, kv_heads=kv_heads)
    out = clipped_attention(req)
    _assert_equals_eager(out, req, enc, *F64)


def test_block_grows_to_the_clipping_distance(monkeypatch):
    """With k larger than the block, the far part must still start beyond k (else the far constant
    would be wrong for distances between the block and k)."""
    monkeypatch.setattr(clipped, "CLIPPED_BLOCK", 4)
    torch.manual_seed(1)
    enc = posenc.build("shaw:k=9", head_dim=DIM, num_heads=HEADS).double()
    req = _request(enc, 50, causal=False)
    torch.testing.assert_close(
        clipped_attention(req), get_backend("eager").run(req)[0], rtol=1e-10, atol=1e-12
    )


def test_float32_at_default_block_matches_eager():
    torch.manual_seed(2)
    enc = posenc.build("shaw:k=16", head_dim=DIM, num_heads=HEADS)
    req = _request(enc, 600, causal=True, dtype=torch.float32, batch=1)
    assert auto_reasons(get_backend("clipped"), req) == []
    out = clipped_attention(req)
    _assert_equals_eager(out, req, enc, {"rtol": 1e-4, "atol": 1e-5}, {"rtol": 1e-3, "atol": 1e-4})


def test_layer_takes_the_split_on_long_sequences():
    """``auto`` runs Shaw on the clipped backend from 512 queries on, on the relative one below."""
    torch.manual_seed(3)
    layer = posenc.MultiheadAttention(16, 2, encoding="shaw:k=16", causal=True).double()
    x = torch.randn(1, 520, 16, dtype=torch.float64)
    out = layer(x)
    assert layer.last_backend == "clipped"
    with posenc.use_backend("eager"):
        ref = layer(x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    layer(x[:, :100])
    assert layer.last_backend == "relative", "short sequences keep the query blocks"


@pytest.mark.parametrize(
    "case, expected",
    [
        ("unclipped", "declares no clipped"),
        ("padding", "plain causal mask or none"),
        ("bfloat16", "float32 or float64"),
        ("nan", "nan or inf"),
        ("short", "queries the query blocks are as fast"),
        ("gaps", "consecutive positions"),
    ],
)
def test_clipped_split_states_why_it_does_not_serve(case, expected):
    torch.manual_seed(4)
    spec = "shaw:k=None,max_len=700" if case == "unclipped" else "shaw:k=4"
    enc = posenc.build(spec, head_dim=DIM, num_heads=HEADS)
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    length = 100 if case == "short" else 600
    extra = {}
    if case == "padding":
        pad = torch.ones(2, length, dtype=torch.bool)
        pad[0, -3:] = False
        extra["key_padding_mask"] = pad
    req = _request(enc, length, causal=True, dtype=dtype, **extra)
    if case == "nan":
        with torch.no_grad():
            req.q[0, 0, 5, 0] = float("nan")
        req = AttentionRequest.from_keywords(
            q=req.q, k=req.k, v=req.v, encoding=enc, q_pos=req.q_pos, k_pos=req.k_pos, scale=0.4, causal=True
        )
    if case == "gaps":
        pos = torch.arange(length)[None] * 2
        req = AttentionRequest.from_keywords(
            q=req.q, k=req.k, v=req.v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.4, causal=True
        )
    reason = "; ".join(auto_reasons(get_backend("clipped"), req)) or None
    assert reason is not None and expected in reason, reason
    if case != "short":  # the length floor is auto's choice; the split itself serves short inputs
        with pytest.raises(ValueError, match="clipped split"):
            clipped_attention(req)


def test_nan_is_never_turned_finite_on_the_relative_backend():
    """The flash kernel would return finite numbers for nan inputs: the relative backend must keep
    the query blocks (which propagate nan) instead of the split."""
    torch.manual_seed(5)
    layer = posenc.MultiheadAttention(16, 2, encoding="shaw:k=16", causal=True)
    x = torch.randn(1, 600, 16)
    x[0, 7, 3] = float("nan")
    out = layer(x)
    assert bool(out[0, 7:].isnan().any())


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("share", [True, False], ids=["shared-proj", "own-proj"])
@pytest.mark.parametrize("terms", ["c2p|p2c", "c2p", "p2c"])
def test_deberta_split_equals_eager(terms, share, causal, monkeypatch):
    """DeBERTa's c2p (a row constant far away) and p2c (a key constant: one extra head dimension in
    the kernel) on log buckets whose far rows start at different distances on each side (16 before
    the diagonal, 32 after); every parameter's gradient, projections included."""
    _split_at_every_length(monkeypatch)
    torch.manual_seed(6)
    spec = f"deberta:position_buckets=8,max_relative_positions=32,pos_att_type={terms},share_att_key={share}"
    layer = posenc.MultiheadAttention(24, 3, spec, causal=causal).double()
    x = torch.randn(2, 90, 24, dtype=torch.float64, requires_grad=True)
    inputs = [x, *(p for p in layer.parameters() if p.requires_grad)]
    with posenc.use_backend("clipped"):
        out = layer(x)
    assert layer.last_backend == "clipped"
    _assert_layer_equals_eager(layer, x, out, inputs)


@pytest.mark.parametrize(
    "spec",
    [
        "deberta:position_buckets=8,max_relative_positions=32",
        "deberta:position_buckets=-1,max_relative_positions=20",
        "deberta",
    ],
)
def test_deberta_far_distances_are_where_its_rows_saturate(spec):
    """The declared far distances, against the index computed pair by pair: constant from there on,
    and not one step earlier (an early start would put near pairs in the far part)."""
    from posenc.encodings.deberta import deberta_relative_index

    layer = posenc.MultiheadAttention(24, 3, spec)
    enc = layer.encoding
    terms = enc.clipped_relative(layer, 3)
    positions = torch.arange(1200)[None]
    rows = deberta_relative_index(positions, positions, enc.position_buckets, enc.max_relative_positions)[0]
    distance = positions[0][None] - positions[0][:, None]  # key minus query
    for side, far in ((-1, terms.far_before), (1, terms.far_after)):
        beyond = rows[distance * side >= far]
        assert bool((beyond == beyond[0]).all())
        assert not bool((rows[distance * side >= far - 1] == beyond[0]).all())
    assert torch.equal(terms.index(distance), rows)


def test_auto_takes_the_split_from_eight_near_blocks():
    """DeBERTa's default buckets saturate only past distance 500 (near blocks of 505 rows): below
    eight such blocks the query blocks are as fast and the reason says so; from eight on, and for a
    span of 256 (blocks of 255) from 2040 queries, the split serves. Forcing the split (its reasons alone)
    skips the rule."""
    for spec, length, takes_split in (
        ("deberta", 1100, False),
        ("deberta", 4040, True),
        ("deberta:position_buckets=-1,max_relative_positions=256", 1100, False),
        ("deberta:position_buckets=-1,max_relative_positions=256", 2040, True),
    ):
        layer = posenc.MultiheadAttention(24, 3, spec, causal=True)
        q = torch.randn(1, 3, length, 8)
        pos = torch.arange(length)[None]
        req = AttentionRequest.from_keywords(
            q=q, k=q, v=q, encoding=layer.encoding, q_pos=pos, k_pos=pos, scale=0.3, causal=True, layer=layer
        )
        reason = "; ".join(auto_reasons(get_backend("clipped"), req)) or None
        assert (reason is None) == takes_split, (spec, length, reason)
        if not takes_split:
            assert "8 near blocks of" in reason
            assert get_backend("clipped").reasons(req) == []


@pytest.mark.parametrize("value_term", [True, False], ids=["values", "keys-only"])
def test_gradient_of_any_layout_is_read_correctly(value_term, monkeypatch):
    """The output gradient may come in any strides (``[B, L, H, D]`` memory viewed as ``[B, H, L, D]``,
    what a layer's head split gives; and a transposed view): the flash kernels under the split must
    see it laid out as they expect, or the gradient is silently wrong."""
    monkeypatch.setattr(clipped, "CLIPPED_BLOCK", 8)
    torch.manual_seed(7)
    enc = posenc.build(f"shaw:k=4,value_term={value_term}", head_dim=DIM, num_heads=HEADS).double()
    req = _request(enc, 37, causal=True)  # 37: the last near block is partial
    inputs = [req.q, req.k, req.v, *enc.parameters()]
    for grad in (
        torch.randn(2, 37, HEADS, DIM, dtype=torch.float64).transpose(1, 2),
        torch.randn(2, HEADS, DIM, 37, dtype=torch.float64).transpose(-1, -2),
        torch.randn(2, HEADS, 40, DIM, dtype=torch.float64)[:, :, :37],
    ):
        assert not grad.is_contiguous()
        got = torch.autograd.grad(clipped_attention(req), inputs, grad)
        want = torch.autograd.grad(get_backend("eager").run(req)[0], inputs, grad)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(
    "index, block, causal, expected",
    [
        (lambda d: d.clamp(-8, 8) + 8, 8, False, 1),  # Shaw k = block: d + 8 throughout
        (lambda d: d.clamp(-8, 8) + 8, 8, True, 1),
        (lambda d: d.clamp(-4, 4) + 4, 8, False, None),  # saturates inside the band
        (lambda d: d.clamp(-8, 3) + 8, 8, True, 1),  # only d <= 0 is near under the causal mask
        (lambda d: d.clamp(-8, 3) + 8, 8, False, None),
        (lambda d: (20 - d).clamp(0, 39), 19, False, -1),  # DeBERTa without buckets
        (lambda d: 2 * d + 20, 8, False, None),  # affine but not one row per unit of distance
    ],
)
def test_slope_over_band_is_read_from_the_index(index, block, causal, expected):
    assert clipped._slope_over_band(index, block, causal) == expected


@pytest.mark.parametrize(
    "index, reach, slope, expected",
    [
        # DeBERTa span 256 without buckets: 511 − ... − d holds to d = −255 (the far distance): 3 x 85
        (lambda d: (256 - d).clamp(0, 511), 254, -1, (85, 3)),
        # a line that ends at the reach: 3 x 85 would read d = −255 off it; 2 x 127 reach 254 exactly
        (lambda d: d.clamp(-254, 0) + 254, 254, 1, (127, 2)),
        (lambda d: d.clamp(-254, 0) + 254, 254, None, (85, 3)),  # gathers take any reach
        (lambda d: d.clamp(-16, 16) + 16, 16, 1, (16, 1)),  # blocks below CLIPPED_BLOCK: one block
        (lambda d: d.clamp(-100, 100) + 100, 99, 1, (33, 3)),  # 3 x 33 = 99
    ],
)
def test_blocks_for_takes_the_most_blocks_the_index_allows(index, reach, slope, expected):
    assert clipped.CLIPPED_BLOCK == 16 and clipped.CLIPPED_BACK == 3
    assert clipped._blocks_for(index, reach, slope, True) == expected
