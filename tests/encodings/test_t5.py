"""T5 relative position bias: buckets against HF ``T5Attention._relative_position_bucket`` and the hand
tables of docs/conventions.md §4.2 and §4.3; the dense bias against HF ``compute_bias`` (with a cache offset); a full
attention layer against HF ``T5Attention`` with copied weights (encoder, decoder, cached decoding)."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc import functional as F
from posenc.encodings.t5 import T5Bias

T5_CONFIGS = [  # (num_buckets, max_distance)
    (32, 128),
    (7, 20),
    (33, 100),
    (8, 20),
    (16, 32),
    (64, 256),
    (10, 6),
    (32, 20),
    (5, 3),
]


def hf_bucket(
    relative_position: torch.Tensor, num_buckets: int, max_distance: int, bidirectional: bool
) -> torch.Tensor:
    from transformers.models.t5.modeling_t5 import T5Attention

    return T5Attention._relative_position_bucket(
        relative_position, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", T5_CONFIGS)
def test_buckets_equal_hf_on_minus_300_to_300(
    num_buckets: int, max_distance: int, bidirectional: bool
) -> None:
    r = torch.arange(-300, 301)
    ours = F.t5_bucket(r, num_buckets, max_distance, bidirectional)
    expected = hf_bucket(r, num_buckets, max_distance, bidirectional)
    assert ours.dtype == torch.int64
    torch.testing.assert_close(ours, expected.long(), rtol=0, atol=0)
    assert int(ours.min()) >= 0 and int(ours.max()) < num_buckets


def test_max_distance_inside_the_exact_range_is_an_error_where_hf_gives_bad_buckets() -> None:
    # 32 causal buckets: exact up to 16; HF with max_distance=10 returns negative bucket ids.
    assert int(hf_bucket(torch.arange(-300, 1), 32, 10, False).min()) < 0
    with pytest.raises(ValueError, match="max_distance"):
        F.t5_bucket(torch.arange(-300, 1), 32, 10, bidirectional=False)


def test_buckets_equal_hf_for_2d_and_int32_inputs() -> None:
    r = torch.arange(7)[None, :] - torch.arange(5)[:, None] * 40
    torch.testing.assert_close(F.t5_bucket(r.int()), hf_bucket(r, 32, 128, True).long(), rtol=0, atol=0)


def _expand(ranges: list[tuple[int, int, int]]) -> dict[int, int]:
    return {r: bucket for low, high, bucket in ranges for r in range(low, high + 1)}


# docs/conventions.md §4.2 and §4.3, r = key − query, num_buckets = 32, max_distance = 128 (hand-checked table).
BIDIRECTIONAL = _expand(
    [
        (-200, -91, 15),
        (-90, -64, 14),
        (-63, -46, 13),
        (-45, -32, 12),
        (-31, -23, 11),
        (-22, -16, 10),
        (-15, -12, 9),
        (-11, -8, 8),
    ]
    + [(r, r, -r) for r in range(-7, 1)]
    + [(r, r, 16 + r) for r in range(1, 8)]
    + [
        (8, 11, 24),
        (12, 15, 25),
        (16, 22, 26),
        (23, 31, 27),
        (32, 45, 28),
        (46, 63, 29),
        (64, 90, 30),
        (91, 200, 31),
    ]
)

CAUSAL = _expand(
    [
        (-200, -113, 31),
        (-112, -99, 30),
        (-98, -87, 29),
        (-86, -77, 28),
        (-76, -67, 27),
        (-66, -59, 26),
        (-58, -52, 25),
        (-51, -46, 24),
        (-45, -40, 23),
        (-39, -35, 22),
        (-34, -31, 21),
        (-30, -27, 20),
        (-26, -24, 19),
        (-23, -21, 18),
        (-20, -19, 17),
        (-18, -16, 16),
    ]
    + [(r, r, -r) for r in range(-15, 0)]
    + [(0, 200, 0)]
)


@pytest.mark.parametrize("bidirectional,table", [(True, BIDIRECTIONAL), (False, CAUSAL)])
def test_reference_hand_table(bidirectional: bool, table: dict[int, int]) -> None:
    r = torch.tensor(sorted(table))
    expected = torch.tensor([table[v] for v in sorted(table)])
    assert len(table) == 401
    torch.testing.assert_close(F.t5_bucket(r, bidirectional=bidirectional), expected, rtol=0, atol=0)


def test_reference_spot_checks() -> None:
    def bucket(r: int, bidirectional: bool) -> int:
        return int(F.t5_bucket(torch.tensor(r), 32, 128, bidirectional))

    assert (bucket(-91, True), bucket(91, True), bucket(1, True), bucket(-90, True)) == (15, 31, 17, 14)
    assert (bucket(-113, False), bucket(-112, False), bucket(1, False), bucket(500, False)) == (31, 30, 0, 0)
    used = set(F.t5_bucket(torch.arange(-1000, 1001)).tolist())
    assert 16 not in used and used == set(range(32)) - {16}  # 31 distinct buckets, never 16
    assert set(F.t5_bucket(torch.arange(0, 1000), bidirectional=False).tolist()) == {0}  # every future key


def _hf_attention(is_decoder: bool, num_buckets: int = 8, max_distance: int = 20):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    config = T5Config(
        d_model=16,
        num_heads=2,
        d_kv=8,
        relative_attention_num_buckets=num_buckets,
        relative_attention_max_distance=max_distance,
        is_decoder=is_decoder,
        dropout_rate=0.0,
    )
    config._attn_implementation = "eager"
    hf = T5Attention(config, has_relative_attention_bias=True, layer_idx=0, is_causal=is_decoder).eval()
    with torch.no_grad():
        hf.relative_attention_bias.weight.normal_()
    return config, hf


def _our_encoding(hf, is_decoder: bool) -> T5Bias:
    enc = posenc.build(
        "t5",
        num_heads=hf.n_heads,
        num_buckets=hf.relative_attention_num_buckets,
        max_distance=hf.relative_attention_max_distance,
        bidirectional=not is_decoder,
    )
    enc.load_state_dict({"table.weight": hf.relative_attention_bias.weight.detach().clone()})
    return enc


@pytest.mark.parametrize("is_decoder", [False, True])
@pytest.mark.parametrize(
    "q_len,k_len,past", [(7, 7, 0), (1, 9, 8), (3, 12, 9), (5, 40, 35), (4, 30, 0), (6, 2, 0)]
)
def test_bias_equals_hf_compute_bias(is_decoder: bool, q_len: int, k_len: int, past: int) -> None:
    _, hf = _hf_attention(is_decoder)
    enc = _our_encoding(hf, is_decoder)
    with torch.no_grad():
        expected = hf.compute_bias(q_len, k_len, past_seen_tokens=past)[0]
    got = enc.bias(q_len, k_len, q_offset=past)
    assert got.shape == (2, q_len, k_len) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_incremental_row_is_the_row_of_the_full_bias() -> None:
    # docs/conventions.md §1.3 and §4.4: one query at absolute position 6 equals row 6 of the full 7×7 bias.
    enc = T5Bias(num_heads=3, bidirectional=False)
    torch.testing.assert_close(enc.bias(1, 7, q_offset=6), enc.bias(7, 7)[:, 6:7], rtol=0, atol=0)
    buckets = enc.buckets(torch.arange(7) - 6)
    assert buckets.tolist() == [6, 5, 4, 3, 2, 1, 0]


def _our_layer(hf, is_decoder: bool) -> posenc.MultiheadAttention:
    attn = posenc.MultiheadAttention(
        16,
        2,
        encoding=_our_encoding(hf, is_decoder),
        causal=is_decoder,
        scale=1.0,
        bias=False,
        backend="eager",
    )
    with torch.no_grad():
        for ours, theirs in [
            (attn.q_proj, hf.q),
            (attn.k_proj, hf.k),
            (attn.v_proj, hf.v),
            (attn.out_proj, hf.o),
        ]:
            ours.weight.copy_(theirs.weight)
    return attn.eval()


@pytest.mark.parametrize("is_decoder", [False, True])
def test_full_layer_equals_hf_t5_attention(is_decoder: bool) -> None:
    _, hf = _hf_attention(is_decoder, num_buckets=8, max_distance=20)
    hf = hf.double()
    attn = _our_layer(hf, is_decoder).double()
    length = 30  # beyond max_distance, so the saturated buckets are used
    x = torch.randn(2, length, 16, dtype=torch.float64)
    mask = None
    if is_decoder:  # HF takes the causal mask as an additive [B, 1, Tq, Tk] tensor
        future = torch.ones(length, length, dtype=torch.bool).triu(1)
        mask = torch.zeros(length, length, dtype=torch.float64).masked_fill(
            future, torch.finfo(torch.float64).min
        )
        mask = mask[None, None]
    with torch.no_grad():
        expected = hf(x, mask=mask)[0]
        got = attn(x)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_cached_decoding_equals_hf_cached_decoding() -> None:
    from transformers import DynamicCache

    config, hf = _hf_attention(True)
    attn = _our_layer(hf, True)
    x = torch.randn(1, 25, 16)
    hf_cache, cache = DynamicCache(config=config), posenc.KVCache()
    chunks = [(0, 4), (4, 5), (5, 17), (17, 18), (18, 25)]
    with torch.no_grad():
        for start, stop in chunks:
            step = x[:, start:stop]
            size = stop - start
            mask = None
            if size > 1:  # the causal mask of the new queries over all keys so far
                future = torch.arange(stop)[None, :] > torch.arange(start, stop)[:, None]
                mask = torch.zeros(size, stop).masked_fill(future, torch.finfo(torch.float32).min)[None, None]
            expected = hf(step, mask=mask, past_key_values=hf_cache)[0]
            torch.testing.assert_close(attn(step, cache=cache), expected, rtol=1e-5, atol=1e-6)


def test_one_table_shared_by_every_layer_of_a_stack() -> None:
    assert T5Bias.shared_across_layers
    enc = T5Bias(num_heads=2)
    layers = torch.nn.ModuleList(posenc.MultiheadAttention(8, 2, encoding=enc, layer_idx=i) for i in range(3))
    assert all(layer.encoding is enc for layer in layers)
    tables = [p for name, p in layers.named_parameters() if "table" in name]
    assert len(tables) == 1  # deduplicated: one parameter for the stack


def test_shift_invariance_and_elementwise_bias_at() -> None:
    enc = T5Bias(num_heads=3, num_buckets=16, max_distance=40)
    q, k = torch.arange(5)[None], torch.arange(60)[None]
    torch.testing.assert_close(
        enc.bias_for_positions(q + 1000, k + 1000), enc.bias_for_positions(q, k), rtol=0, atol=0
    )
    dense = enc.bias(5, 60).detach()
    for h, i, j in [(0, 0, 0), (2, 4, 59), (1, 3, 1)]:
        value = enc.bias_at(torch.tensor(h), torch.tensor(i), torch.tensor(j)).detach()
        assert value.shape == () and float(value) == float(dense[h, i, j])
        score = enc.score_mod(
            torch.tensor(0.5), torch.tensor(0), torch.tensor(h), torch.tensor(i), torch.tensor(j)
        )
        assert float(score.detach()) == pytest.approx(0.5 + float(dense[h, i, j]))


def test_bias_dtype_float32_for_low_precision_and_float64_for_float64_tables() -> None:
    enc = T5Bias(num_heads=2)
    assert enc.to(torch.bfloat16).bias(3, 3).dtype == torch.float32
    assert enc.to(torch.float64).bias(3, 3).dtype == torch.float64


def test_table_has_buckets_by_heads_and_is_trainable() -> None:
    enc = T5Bias(num_heads=4, num_buckets=12)
    assert enc.table.weight.shape == (12, 4) and enc.table.weight.requires_grad
    enc.bias(6, 6).sum().backward()
    assert enc.table.weight.grad is not None and bool(enc.table.weight.grad.abs().sum() > 0)


def test_bad_options_are_errors_naming_the_option() -> None:
    with pytest.raises(ValueError, match="num_buckets"):
        posenc.build("t5:num_buckets=3", num_heads=2)  # bidirectional needs >= 4
    posenc.build("t5:num_buckets=3,max_distance=8,bidirectional=false", num_heads=2)  # causal: >= 2 is enough
    with pytest.raises(ValueError, match="max_distance"):
        posenc.build("t5:max_distance=8", num_heads=2)  # 32 bidirectional buckets: exact up to 8
    with pytest.raises(ValueError, match="num_buckets"):
        posenc.build("t5:num_buckets=many", num_heads=2)
    with pytest.raises(ValueError, match="bidirectional"):
        posenc.build("t5:bidirectional=maybe", num_heads=2)
    with pytest.raises(ValueError, match="num_heads"):
        posenc.build("t5", num_heads=0)
    with pytest.raises(ValueError, match="max_distance"):
        F.t5_bucket(torch.arange(3), 32, 4)


def test_preview_shows_the_bucket_row_for_distances_minus_20_to_20() -> None:
    text = T5Bias(num_heads=2).preview()
    assert "-20" in text and " 20" in text
    rows = [line.split()[1:] for line in text.splitlines() if line.strip().startswith(("r ", "bucket"))]
    distances = [int(v) for row in rows[0::2] for v in row]
    buckets = [int(v) for row in rows[1::2] for v in row]
    assert distances == list(range(-20, 21))
    assert buckets == [BIDIRECTIONAL[r] for r in range(-20, 21)]
