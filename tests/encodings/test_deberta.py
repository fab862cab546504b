"""DeBERTa-v2 disentangled attention against HF transformers and docs/conventions.md §5.

The key reference is HF ``DebertaV2Encoder`` / ``DisentangledSelfAttention`` built from tiny random
configs in code (no downloads), with its weights copied into ``posenc.MultiheadAttention``.
Bucket numbers come from HF ``make_log_bucket_position`` and the hand-checked lists in docs/conventions.md §5.4.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers.models.deberta_v2.modeling_deberta_v2 as hf_deberta  # a test reference: the [test] extra installs it
from transformers import DebertaV2Config

import posenc
from posenc import functional as F

HIDDEN, HEADS = 32, 4


# ---------------------------------------------------------------------------- buckets and indices


def test_log_bucket_ranges_for_8_32_match_reference():
    expected = {}
    for low, high, bucket in [
        (5, 7, 5),
        (8, 15, 6),
        (16, 31, 7),
        (32, 61, 8),
        (62, 121, 9),
        (122, 240, 10),
        (241, 300, 11),
    ]:
        for r in range(low, high + 1):
            expected[r], expected[-r] = bucket, -bucket
    for r in range(-4, 5):
        expected[r] = r
    distances = torch.tensor(sorted(expected))
    got = F.deberta_log_bucket(distances, 8, 32)
    assert got.tolist() == [expected[r] for r in sorted(expected)]


def test_relative_index_for_query_39_bucket_8_32():
    keys = torch.tensor([[0, 8, 16, 24, 31, 32, 35, 38, 39]])
    index = F.deberta_relative_index(torch.tensor([[39]]), keys, 8, 32)
    assert index.tolist() == [[[15, 15, 15, 14, 14, 13, 12, 9, 8]]]


def test_c2p_rows_for_v3_setting_match_reference():
    distances = [0, 1, -1, 127, 128, 129, -128, -129, 300, 511, 512, 1000, -1000]
    index = F.deberta_relative_index(torch.tensor([distances]), torch.zeros(1, 1, dtype=torch.long), 256, 512)
    assert index[0, :, 0].tolist() == [256, 257, 255, 383, 384, 385, 128, 127, 463, 511, 511, 511, 0]
    buckets = F.deberta_log_bucket(torch.tensor([129, 130, 131, 132, 300]), 256, 512)
    assert buckets.tolist() == [129, 130, 131, 131, 207]
    rows = F.deberta_relative_index(
        torch.arange(-600, 600)[None], torch.zeros(1, 1, dtype=torch.long), 256, 512
    )[0, :, 0]
    distances_all = torch.arange(-600, 600)
    assert int(distances_all[rows == 511].min()) == 506  # top row from r >= 506
    assert int(distances_all[rows == 0].max()) == -512  # row 0 from r <= -512


def test_no_bucket_index_l5_span3_matches_reference():
    positions = torch.arange(5)[None]
    expected = [[3, 2, 1, 0, 0], [4, 3, 2, 1, 0], [5, 4, 3, 2, 1], [5, 5, 4, 3, 2], [5, 5, 5, 4, 3]]
    assert F.deberta_relative_index(positions, positions, -1, 3).tolist() == [expected]


@pytest.mark.parametrize("bucket_size,max_position", [(256, 512), (128, 512), (8, 32), (32, 128), (16, 17)])
def test_log_bucket_equals_hf(bucket_size, max_position):
    distances = torch.arange(-20000, 20001)
    expected = hf_deberta.make_log_bucket_position(distances, bucket_size, max_position).long()
    assert torch.equal(F.deberta_log_bucket(distances, bucket_size, max_position), expected)


@pytest.mark.parametrize("buckets,max_relative", [(8, 32), (-1, 32), (256, 512)])
def test_relative_index_equals_hf_c2p_index(buckets, max_relative):
    q = torch.zeros(1, 40, 4)
    hf_relative = hf_deberta.build_relative_position(q, q, bucket_size=buckets, max_position=max_relative)
    span = buckets if buckets > 0 else max_relative
    expected = torch.clamp(hf_relative + span, 0, 2 * span - 1)
    positions = torch.arange(40)[None]
    assert torch.equal(F.deberta_relative_index(positions, positions, buckets, max_relative), expected)


def test_bad_bucket_configuration_names_the_parameter():
    with pytest.raises(ValueError, match="max_position"):
        F.deberta_log_bucket(torch.arange(3), 8, 5)
    with pytest.raises(ValueError, match="bucket_size"):
        F.deberta_log_bucket(torch.arange(3), 1, 32)


# ---------------------------------------------------------------------------- HF equality


def hf_config(buckets: int, share: bool, pos_att_type: str, max_relative: int = 32) -> DebertaV2Config:
    return DebertaV2Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=11,
        max_position_embeddings=48,
        relative_attention=True,
        position_buckets=buckets,
        max_relative_positions=max_relative,
        pos_att_type=pos_att_type,
        share_att_key=share,
        norm_rel_ebd="layer_norm",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def copy_linear(target: torch.nn.Linear, source: torch.nn.Linear) -> None:
    target.weight.copy_(source.weight)
    target.bias.copy_(source.bias)


def paired_layers(config: DebertaV2Config, dtype: torch.dtype):
    """An HF encoder (one layer) and a posenc layer holding the same weights."""
    encoder = hf_deberta.DebertaV2Encoder(config).eval().to(dtype)
    hf_self = encoder.layer[0].attention.self
    spec = (
        f"deberta:position_buckets={config.position_buckets},max_relative_positions={config.max_relative_positions},"
        f"pos_att_type={'|'.join(config.pos_att_type)},share_att_key={config.share_att_key},"
        f"max_position_embeddings={config.max_position_embeddings}"
    )
    ours = posenc.MultiheadAttention(HIDDEN, HEADS, spec).eval().to(dtype)
    with torch.no_grad():
        copy_linear(ours.q_proj, hf_self.query_proj)
        copy_linear(ours.k_proj, hf_self.key_proj)
        copy_linear(ours.v_proj, hf_self.value_proj)
        ours.out_proj.weight.copy_(torch.eye(HIDDEN))  # HF's self-attention output is before its dense layer
        ours.out_proj.bias.zero_()
        ours.encoding.rel_embeddings.weight.copy_(encoder.rel_embeddings.weight)
        encoder.LayerNorm.weight.normal_(1.0, 0.2)  # non-trivial LayerNorm so copying it matters
        encoder.LayerNorm.bias.normal_(0.0, 0.2)
        copy_linear(ours.encoding.layer_norm, encoder.LayerNorm)
        for name in ("pos_key_proj", "pos_query_proj"):
            if hasattr(hf_self, name):
                copy_linear(getattr(ours, name), getattr(hf_self, name))
    return encoder, ours


def hf_self_attention(encoder, hidden: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """HF's context layer ``[B, T, HIDDEN]``, with its own mask, relative positions and table."""
    hf_self = encoder.layer[0].attention.self
    out, _ = hf_self(
        hidden,
        encoder.get_attention_mask(real.long()),
        relative_pos=encoder.get_rel_pos(hidden),
        rel_embeddings=encoder.get_rel_embedding(),
    )
    return out


def exact_scale_in_float64(monkeypatch) -> None:
    """HF computes sqrt(d·s) in float32 even for a float64 model (a 1e-8 relative error); compute it
    in float64 so a float64 comparison can be tight. Everything else is HF's own code."""

    def scaled_size_sqrt(layer: torch.Tensor, scale_factor: int) -> torch.Tensor:
        return torch.sqrt(torch.tensor(layer.size(-1), dtype=torch.float64) * scale_factor)

    monkeypatch.setattr(hf_deberta, "scaled_size_sqrt", scaled_size_sqrt)


CASES = [
    (buckets, share, pos_att_type)
    for buckets in (8, -1)
    for share in (True, False)
    for pos_att_type in ("c2p|p2c", "c2p", "p2c")
]


@pytest.mark.parametrize("buckets,share,pos_att_type", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_self_attention_equals_hf_deberta_v2(buckets, share, pos_att_type, dtype, tol, monkeypatch):
    if dtype == torch.float64:
        exact_scale_in_float64(monkeypatch)
    encoder, ours = paired_layers(hf_config(buckets, share, pos_att_type), dtype)
    length = 45  # beyond max_relative_positions=32: saturated rows and far buckets are exercised
    hidden = torch.randn(2, length, HIDDEN, dtype=dtype)
    real = torch.ones(2, length, dtype=torch.bool)
    real[1, 30:] = False  # right padding in the second sequence
    with torch.no_grad():
        expected = hf_self_attention(encoder, hidden, real)
        got = ours(hidden, key_padding_mask=~real)
    # HF fills padded query rows with a uniform average; compare the real tokens.
    torch.testing.assert_close(got[real], expected[real], rtol=tol, atol=tol)


def test_gradients_equal_hf_deberta_v2(monkeypatch):
    exact_scale_in_float64(monkeypatch)
    encoder, ours = paired_layers(hf_config(8, False, "c2p|p2c"), torch.float64)
    hidden = torch.randn(2, 20, HIDDEN, dtype=torch.float64)
    real = torch.ones(2, 20, dtype=torch.bool)
    weight = torch.randn(2, 20, HIDDEN, dtype=torch.float64)
    hf_self = encoder.layer[0].attention.self
    pairs = [
        (hf_self.query_proj.weight, ours.q_proj.weight),
        (hf_self.key_proj.weight, ours.k_proj.weight),
        (hf_self.pos_key_proj.weight, ours.pos_key_proj.weight),
        (hf_self.pos_query_proj.bias, ours.pos_query_proj.bias),
        (encoder.rel_embeddings.weight, ours.encoding.rel_embeddings.weight),
        (encoder.LayerNorm.weight, ours.encoding.layer_norm.weight),
    ]
    x_hf = hidden.clone().requires_grad_(True)
    x_ours = hidden.clone().requires_grad_(True)
    expected = torch.autograd.grad(
        (hf_self_attention(encoder, x_hf, real) * weight).sum(), [x_hf] + [p for p, _ in pairs]
    )
    got = torch.autograd.grad((ours(x_ours) * weight).sum(), [x_ours] + [p for _, p in pairs])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("max_relative", [-1, 0])
def test_non_positive_max_relative_positions_uses_max_position_embeddings(max_relative, monkeypatch):
    exact_scale_in_float64(monkeypatch)
    encoder, ours = paired_layers(hf_config(-1, True, "c2p|p2c", max_relative=max_relative), torch.float64)
    assert ours.encoding.att_span == 48
    assert ours.encoding.rel_embeddings.weight.shape == encoder.rel_embeddings.weight.shape
    hidden = torch.randn(1, 60, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        expected = hf_self_attention(encoder, hidden, torch.ones(1, 60, dtype=torch.bool))
        torch.testing.assert_close(ours(hidden), expected, rtol=1e-10, atol=1e-10)


def test_table_size_matches_hf_for_buckets():
    config = hf_config(8, True, "c2p|p2c")
    encoder = hf_deberta.DebertaV2Encoder(config)
    ours = posenc.build(
        "deberta", dim=HIDDEN, num_heads=HEADS, head_dim=8, position_buckets=8, max_relative_positions=32
    )
    assert ours.rel_embeddings.weight.shape == encoder.rel_embeddings.weight.shape == (16, HIDDEN)


@pytest.mark.parametrize("pos_att_type,terms", [("c2p|p2c", 3), ("c2p", 2), ("p2c", 2)])
def test_logit_scale_is_sqrt_d_times_terms(pos_att_type, terms):
    layer = posenc.MultiheadAttention(HIDDEN, HEADS, f"deberta:pos_att_type={pos_att_type}")
    assert layer.scale == pytest.approx(1 / math.sqrt(8 * terms), rel=1e-15)


# ---------------------------------------------------------------------------- beyond HF: Tq != Tk


def make_layer(spec: str, causal: bool) -> posenc.MultiheadAttention:
    layer = posenc.MultiheadAttention(HIDDEN, HEADS, spec, causal=causal).to(torch.float64).eval()
    with torch.no_grad():
        layer.encoding.rel_embeddings.weight.normal_()  # larger position terms than the 0.02 init
        layer.encoding.layer_norm.bias.normal_()
    return layer


@pytest.mark.parametrize(
    "spec", ["deberta:position_buckets=8,max_relative_positions=32", "deberta:share_att_key=false"]
)
def test_cached_decoding_equals_own_full_forward(spec):
    layer = make_layer(spec, causal=True)
    x = torch.randn(2, 40, HIDDEN, dtype=torch.float64)
    full = layer(x)
    cache = posenc.KVCache()
    pieces = [layer(x[:, :30], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-10)


def test_queries_at_last_positions_equal_rows_of_full_forward():
    """Tq < Tk (HF v2 raises here, docs/conventions.md §5.5): query rows are the last positions."""
    layer = make_layer(
        "deberta:position_buckets=8,max_relative_positions=32,share_att_key=false", causal=False
    )
    x = torch.randn(2, 40, HIDDEN, dtype=torch.float64)
    full = layer(x)
    got = layer(x[:, 33:], context=x, positions=torch.arange(33, 40))
    torch.testing.assert_close(got, full[:, 33:], rtol=1e-10, atol=1e-10)


def test_one_table_shared_by_layers_with_per_layer_projections():
    enc = posenc.build("deberta", dim=HIDDEN, num_heads=HEADS, head_dim=8, share_att_key=False)
    first = posenc.MultiheadAttention(HIDDEN, HEADS, enc)
    second = posenc.MultiheadAttention(HIDDEN, HEADS, enc)
    assert first.encoding is second.encoding
    assert first.pos_key_proj is not second.pos_key_proj and first.pos_query_proj is not second.pos_query_proj
    assert not hasattr(posenc.MultiheadAttention(HIDDEN, HEADS, "deberta"), "pos_key_proj")


def test_logits_without_layer_is_a_clear_error():
    enc = posenc.build("deberta", dim=HIDDEN, num_heads=HEADS, head_dim=8)
    q = torch.randn(1, HEADS, 3, 8)
    with pytest.raises(ValueError, match="layer"):
        enc.logits(q, q, torch.arange(3)[None], torch.arange(3)[None], scale=1.0)


def test_preview_shows_index_map():
    text = posenc.build(
        "deberta", dim=HIDDEN, num_heads=HEADS, head_dim=8, position_buckets=8, max_relative_positions=32
    ).preview(5)
    assert "   8    7    6    5    4" in text


@pytest.mark.parametrize("share", [True, False])
def test_grouped_query_heads_equal_mha_with_repeated_kv_projections(share):
    """num_kv_heads=2 of 4: same output as multi-head attention with each key/value head repeated
    (with share_att_key the relative keys come from the repeated key projection as well)."""
    spec = f"deberta:position_buckets=8,max_relative_positions=32,share_att_key={share}"
    gqa = posenc.MultiheadAttention(HIDDEN, HEADS, spec, num_kv_heads=2).to(torch.float64)
    mha = posenc.MultiheadAttention(HIDDEN, HEADS, spec).to(torch.float64)
    state = dict(gqa.state_dict())
    for name in ("k_proj", "v_proj"):
        weight = getattr(gqa, name).weight.detach().view(2, 8, HIDDEN)
        state[f"{name}.weight"] = weight.repeat_interleave(2, dim=0).reshape(HIDDEN, HIDDEN)
        state[f"{name}.bias"] = (
            getattr(gqa, name).bias.detach().view(2, 8).repeat_interleave(2, dim=0).reshape(HIDDEN)
        )
    mha.load_state_dict(state)
    x = torch.randn(2, 40, HIDDEN, dtype=torch.float64)
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-12, atol=1e-12)


def test_pos_dropout_acts_only_in_training():
    layer = posenc.MultiheadAttention(
        HIDDEN, HEADS, "deberta:position_buckets=8,max_relative_positions=32,pos_dropout=0.5"
    )
    x = torch.randn(1, 12, HIDDEN)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x), rtol=0, atol=0)
    layer.train()
    assert not torch.allclose(layer(x), layer.eval()(x))
