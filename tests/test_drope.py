"""RoPE's ``drop_rotation`` (DroPE-style evaluation without rotation) against NoPE and RoPE on the same weights.

docs/conventions.md §7.8.
"""

from __future__ import annotations

import pytest
import torch

import posenc


def _pair(first: str, second: str) -> tuple[posenc.MultiheadAttention, posenc.MultiheadAttention]:
    a = posenc.MultiheadAttention(32, 4, encoding=first, causal=True)
    b = posenc.MultiheadAttention(32, 4, encoding=second, causal=True)
    b.load_state_dict(a.state_dict())
    return a, b


def test_always_equals_nope_on_the_same_weights():
    dropped, nope = _pair("rope:drop_rotation=always", "nope")
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(dropped(x), nope(x), rtol=1e-6, atol=1e-6)
    rope, _ = _pair("rope", "nope")
    rope.load_state_dict(dropped.state_dict())
    assert not torch.allclose(rope(x), nope(x), atol=1e-4)  # the rotation matters on these weights


def _trained_lm(encoding: str) -> posenc.TransformerLM:
    torch.manual_seed(0)
    model = posenc.TransformerLM(17, 32, 2, 4, encoding, ffn_mult=2.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 17, (4, 12))
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def test_eval_mode_drops_the_rotation_of_a_rope_trained_model():
    """Trained with rotation (train mode equals plain RoPE); evaluated without (eval mode equals NoPE)."""
    model = _trained_lm("rope:drop_rotation=eval")
    rope = posenc.TransformerLM(17, 32, 2, 4, "rope", ffn_mult=2.0)
    nope = posenc.TransformerLM(17, 32, 2, 4, "nope", ffn_mult=2.0)
    rope.load_state_dict(model.state_dict())
    nope.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 17, (3, 15))
    model.train(), rope.train()
    torch.testing.assert_close(model(tokens), rope(tokens), rtol=1e-6, atol=1e-6)
    model.eval(), nope.eval()
    torch.testing.assert_close(model(tokens), nope(tokens), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(model(tokens), rope.eval()(tokens), atol=1e-4)
    assert model.blocks[0].attn.encoding.rotation_dropped


def test_spec_round_trip_and_bad_value():
    enc = posenc.build("rope:drop_rotation=eval", head_dim=16)
    assert "drop_rotation=eval" in enc.spec() and posenc.build(enc.spec()).drop_rotation == "eval"
    with pytest.raises(ValueError, match="drop_rotation"):
        posenc.build("rope:drop_rotation=sometimes", head_dim=16)
