"""Bad input gives a clear error naming the parameter, never a silent wrong answer."""

from __future__ import annotations

import pytest
import torch

import posenc


def test_unknown_encoding_name_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown encoding 'rop'.*did you mean 'rope'"):
        posenc.build("rop")


def test_unknown_option_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown option 'num_bucket'.*did you mean 'num_buckets'"):
        posenc.build("t5:num_bucket=32", num_heads=4)


def test_badly_typed_option_names_it():
    with pytest.raises(ValueError, match=r"option 'base'.*float"):
        posenc.build("rope:base=large", head_dim=8)
    with pytest.raises(ValueError, match=r"option 'bidirectional'.*bool"):
        posenc.build("t5", num_heads=4, bidirectional="sometimes")
    with pytest.raises(ValueError, match=r"option 'pairing' must be one of"):
        posenc.build("rope:pairing=halves", head_dim=8)


def test_malformed_spec():
    with pytest.raises(ValueError, match="expected key=value"):
        posenc.build("rope:base")
    with pytest.raises(ValueError, match="given twice"):
        posenc.build("rope:base=1,base=2", head_dim=8)


def test_layer_option_conflict_is_named():
    with pytest.raises(ValueError, match="num_heads"):
        posenc.MultiheadAttention(32, 4, encoding="t5:num_heads=8")


def test_odd_head_dim_for_rope():
    with pytest.raises(ValueError, match="head_dim"):
        posenc.MultiheadAttention(30, 2, encoding="rope")


def test_odd_dim_for_sinusoidal():
    with pytest.raises(ValueError, match="dim"):
        posenc.MultiheadAttention(21, 3, encoding="sinusoidal")


def test_sequence_past_a_learned_table():
    layer = posenc.MultiheadAttention(16, 2, encoding="learned:max_len=8")
    layer(torch.randn(1, 8, 16))
    with pytest.raises(ValueError, match="max_len"):
        layer(torch.randn(1, 9, 16))


def test_sequence_past_an_unclipped_shaw_table():
    layer = posenc.MultiheadAttention(16, 2, encoding="shaw:k=None,max_len=6", causal=True)
    layer(torch.randn(1, 6, 16))
    with pytest.raises(ValueError, match="max_len"):
        layer(torch.randn(1, 7, 16))


def test_mask_of_the_wrong_shape():
    layer = posenc.MultiheadAttention(16, 2)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        layer(x, attn_mask=torch.ones(5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        layer(x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask must be a bool"):
        layer(x, key_padding_mask=torch.zeros(2, 5))


def test_positions_of_the_wrong_shape_or_dtype():
    layer = posenc.MultiheadAttention(16, 2, encoding="rope")
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="positions must have shape"):
        layer(x, positions=torch.arange(4))
    with pytest.raises(ValueError, match="positions must have shape"):
        layer(x, positions=torch.arange(5).expand(3, 5))
    # rotary encodings take real-valued positions (tests/encodings/test_base.py); a table does not
    with pytest.raises(ValueError, match="positions must be an integer tensor"):
        posenc.MultiheadAttention(16, 2, encoding="learned")(x, positions=torch.arange(5.0))


def test_negative_positions_where_not_allowed():
    for spec in ("rope", "sinusoidal", "learned", "t5"):
        layer = posenc.MultiheadAttention(16, 2, encoding=spec)
        with pytest.raises(ValueError, match="non-negative"):
            layer(torch.randn(1, 3, 16), positions=torch.tensor([-1, 0, 1]))


def test_mismatched_dtypes():
    layer = posenc.MultiheadAttention(16, 2)
    with pytest.raises(ValueError, match=r"x has dtype torch.float64.*float32"):
        layer(torch.randn(1, 3, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="context has dtype"):
        layer(torch.randn(1, 3, 16), context=torch.randn(1, 4, 16, dtype=torch.float64))


def test_bad_layer_sizes():
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        posenc.MultiheadAttention(30, 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        posenc.MultiheadAttention(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, 16\]"):
        posenc.MultiheadAttention(16, 2)(torch.randn(3, 16))


def test_missing_layer_option_in_a_standalone_build_is_named():
    with pytest.raises(ValueError, match=r"t5: missing required option\(s\) 'num_heads'.*attention layer"):
        posenc.build("t5")


def test_documented_rope_spec_builds_and_binds_to_the_layer():
    enc = posenc.build("rope:base=500000,scaling=yarn,factor=4")  # the exact line of docs/architecture.md §2
    assert enc.config()["factor"] == 4.0 and enc.config()["scaling"] == "yarn"
    # YaRN's frequencies depend on the pretraining length: binding without it is a named error.
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        posenc.MultiheadAttention(64, 4, encoding=enc)
    enc = posenc.build("rope:base=500000")
    layer = posenc.MultiheadAttention(64, 4, encoding=enc)
    assert enc.head_dim == 16 and layer(torch.randn(1, 3, 64)).shape == (1, 3, 64)
    with pytest.raises(ValueError, match="head_dim=16"):
        posenc.MultiheadAttention(64, 2, encoding=enc)
