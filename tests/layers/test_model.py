"""TransformerLM / TransformerEncoder: shapes, hybrids, positions, cached generation for every encoding."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.encodings.base import Kind
from posenc.encodings.registry import format_spec

D_MODEL, HEADS = 32, 2  # head size 16: the size the encodings' example_options are made for


def _spec(name: str) -> str:
    return format_spec(name, posenc.get_class(name).example_options)


def _lm(encoding, **kw) -> posenc.TransformerLM:
    kw.setdefault("max_len", 64)
    return posenc.TransformerLM(23, D_MODEL, 2, HEADS, encoding, d_ff=48, **kw).double().eval()


def test_forward_shape_pre_ln_and_untied_head():
    model = posenc.TransformerLM(11, 16, 3, 2, "nope")
    logits = model(torch.randint(0, 11, (2, 5)))
    assert logits.shape == (2, 5, 11)
    assert model.head.weight.data_ptr() != model.token_embedding.weight.data_ptr()
    assert len(model.blocks) == 3 and hasattr(model.blocks[0], "norm_attn")


@pytest.mark.parametrize("name", posenc.available())
def test_cached_generation_equals_full_recomputation(name):
    torch.manual_seed(0)
    model = _lm(_spec(name))
    prompt = torch.randint(0, 23, (2, 5))
    with_cache = model.generate(prompt, 7, use_cache=True)
    without = model.generate(prompt, 7, use_cache=False)
    assert torch.equal(with_cache, without)
    # Logits too: decoding step by step through the cache equals one full forward pass.
    full = model(with_cache)
    cache = posenc.KVCache()
    steps = [model(with_cache[:, :5], cache=cache)] + [
        model(with_cache[:, t : t + 1], cache=cache) for t in range(5, 12)
    ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize(
    ("prompt", "hint"),
    [
        (torch.zeros(2, 0, dtype=torch.long), r"shape \(2, 0\); give every row at least one token"),
        (torch.tensor([3, 1, 4]), r"shape \(3,\); for one sequence pass prompt\[None\]"),
        (torch.ones(1, 2), r"shape \(1, 2\) torch.float32; pass integer token ids"),
    ],
)
def test_generate_names_a_prompt_without_a_last_token(prompt, hint, use_cache):
    """An empty or 1-D prompt has no last token per row to continue: a named error, not an IndexError."""
    model = _lm("rope")
    with pytest.raises(
        ValueError, match=r"generate: prompt must be integer token ids \[B, T >= 1\], got " + hint
    ):
        model.generate(prompt, 3, use_cache=use_cache)


def test_causal_lm_ignores_future_tokens_and_encoder_does_not():
    tokens = torch.randint(0, 23, (1, 8))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 23
    lm = _lm("alibi")
    assert torch.equal(lm(tokens)[:, :-1], lm(changed)[:, :-1])
    encoder = posenc.TransformerEncoder(23, D_MODEL, 2, HEADS, "t5", d_ff=48).double().eval()
    assert encoder(tokens).shape == (1, 8, 23)
    assert not torch.allclose(encoder(tokens)[:, 0], encoder(changed)[:, 0])


def test_model_fills_bidirectional_from_causal():
    lm = posenc.TransformerLM(5, 16, 1, 2, "t5")
    encoder = posenc.TransformerEncoder(5, 16, 1, 2, "t5")
    assert lm.blocks[0].attn.encoding.config()["bidirectional"] is False
    assert encoder.blocks[0].attn.encoding.config()["bidirectional"] is True
    explicit = posenc.TransformerLM(5, 16, 1, 2, "t5:bidirectional=true")
    assert explicit.blocks[0].attn.encoding.config()["bidirectional"] is True


def test_causal_defaults_per_class_and_explicit_override():
    """One constructor: the LM is causal and the encoder bidirectional unless ``causal`` says otherwise."""
    layers = lambda model: {block.attn.causal for block in model.blocks}  # noqa: E731
    assert posenc.TransformerLM(5, 16, 2, 2).causal is True
    assert layers(posenc.TransformerLM(5, 16, 2, 2)) == {True}
    assert posenc.TransformerEncoder(5, 16, 2, 2).causal is False
    assert layers(posenc.TransformerEncoder(5, 16, 2, 2)) == {False}
    assert layers(posenc.TransformerLM(5, 16, 2, 2, causal=False)) == {False}
    assert layers(posenc.TransformerEncoder(5, 16, 2, 2, causal=True)) == {True}


def test_absolute_encoding_is_added_once_at_the_input():
    """``sinusoidal``: logits equal embedding + the paper's table (written here in float64), then
    blocks without any positional term."""
    torch.manual_seed(0)
    model = _lm("sinusoidal")
    tokens = torch.randint(0, 23, (2, 9))
    position = torch.arange(9, dtype=torch.float64)[:, None]
    rates = 10000.0 ** (-torch.arange(0, D_MODEL, 2, dtype=torch.float64) / D_MODEL)
    table = torch.zeros(9, D_MODEL, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = torch.sin(position * rates), torch.cos(position * rates)
    x = model.token_embedding(tokens) + table
    for block in model.blocks:
        assert block.attn.encoding.name == "nope"
        x = block(x, positions=torch.arange(9)[None], key_padding_mask=None, cache=None)
    torch.testing.assert_close(model(tokens), model.head(model.final_norm(x)))


def test_hybrid_list_semantics():
    model = posenc.TransformerLM(7, 32, 5, 2, ["t5", "t5", "rope", "sinusoidal", "sinusoidal"], max_len=16)
    encodings = [block.attn.encoding for block in model.blocks]
    assert [e.name for e in encodings] == ["t5", "t5", "rope", "nope", "nope"]
    assert encodings[0] is encodings[1], "T5 shares one table across the layers listing it"
    assert [e.name for e in model.input_encodings] == ["sinusoidal"], (
        "absolute entries summed once at the input"
    )
    per_layer = posenc.TransformerLM(7, 32, 2, 2, ["rope", "rope"])
    assert per_layer.blocks[0].attn.encoding is not per_layer.blocks[1].attn.encoding
    both = posenc.TransformerLM(7, 32, 3, 2, ["learned", "sinusoidal", "alibi"], max_len=16)
    assert sorted(e.name for e in both.input_encodings) == ["learned", "sinusoidal"]
    assert both.input_encodings[0].config()["max_len"] == 16
    assert both(torch.randint(0, 7, (1, 6))).shape == (1, 6, 7)


def test_hybrid_and_argument_errors():
    with pytest.raises(ValueError, match="num_layers"):
        posenc.TransformerLM(7, 32, 3, 2, ["t5", "t5"])
    with pytest.raises(ValueError, match="d_model"):
        posenc.TransformerLM(7, 30, 2, 4)
    with pytest.raises(ValueError, match="spec string"):
        posenc.TransformerLM(7, 32, 2, 2, posenc.build("alibi", num_heads=2))
    model = posenc.TransformerLM(7, 32, 1, 2, "learned", max_len=8)
    with pytest.raises(ValueError, match="max_len=8"):
        model(torch.randint(0, 7, (1, 9)))


@pytest.mark.parametrize("name", ["learned", "rope", "alibi", "t5"])
def test_left_padding_gets_positions_from_the_mask(name):
    """A left-padded row gives the same logits at its real tokens as the unpadded sequence."""
    torch.manual_seed(0)
    model = _lm(_spec(name))
    tokens = torch.randint(0, 23, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), tokens], dim=1)
    mask = torch.tensor([[True] * 3 + [False] * 6])
    torch.testing.assert_close(
        model(padded, key_padding_mask=mask)[:, 3:], model(tokens), rtol=1e-9, atol=1e-9
    )


def test_explicit_positions_shift_absolute_but_not_relative():
    torch.manual_seed(0)
    tokens = torch.randint(0, 23, (1, 6))
    shifted = torch.arange(10, 16)
    alibi, learned = _lm("alibi"), _lm("learned")
    torch.testing.assert_close(alibi(tokens, positions=shifted), alibi(tokens), rtol=1e-9, atol=1e-9)
    assert not torch.allclose(learned(tokens, positions=shifted), learned(tokens))


def test_gqa_and_dropout_options():
    model = posenc.TransformerLM(9, 32, 2, 4, "rope", num_kv_heads=2, dropout=0.1, ffn_mult=2.0)
    assert model.blocks[0].attn.num_kv_heads == 2 and model.blocks[0].ffn.up.out_features == 64
    model.train()
    assert model(torch.randint(0, 9, (2, 4))).shape == (2, 4, 9)
    assert math.isfinite(float(model(torch.randint(0, 9, (2, 4))).detach().sum()))


def test_every_kind_is_placed_where_it_acts():
    for name in posenc.available():
        model = posenc.TransformerLM(5, D_MODEL, 1, HEADS, _spec(name), max_len=8)
        absolute = posenc.get_class(name).kind is Kind.ABSOLUTE
        assert (model.blocks[0].attn.encoding.name == "nope") == (absolute or name == "nope")
        assert bool(model.input_encodings) == absolute


def test_encoder_padding_is_never_attended():
    torch.manual_seed(0)
    encoder = (
        posenc.TransformerEncoder(23, D_MODEL, 2, HEADS, "alibi:mode=symmetric", d_ff=48).double().eval()
    )
    tokens = torch.randint(0, 23, (1, 5))
    padded = torch.cat([tokens, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.tensor([[False] * 5 + [True] * 3])
    torch.testing.assert_close(
        encoder(padded, key_padding_mask=mask)[:, :5], encoder(tokens), rtol=1e-9, atol=1e-9
    )


def test_encoder_gets_the_noncausal_form_of_alibi():
    # ALiBi's causal form would favour distant future keys without a causal mask (docs/conventions.md §6.2).
    model = posenc.TransformerEncoder(10, 16, 1, 2, encoding="alibi")
    enc = next(m for m in model.modules() if isinstance(m, posenc.PositionalEncoding))
    assert enc.mode == "symmetric" and not enc.causal_only
    bias = enc.bias(3, 3)[0]
    slope = 2.0 ** (-8 * 1 / 2)  # the paper: m_h = 2^(-8h/n), head h=1 of n=2
    torch.testing.assert_close(
        bias, -slope * (torch.arange(3)[:, None] - torch.arange(3)[None]).abs().float()
    )
