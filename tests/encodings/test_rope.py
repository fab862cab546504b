"""RoPE (pairings, partial rotary, dtype, weight conversion, the pairing switch, ``drop_rotation``) against
HF Llama, GPT-J, GPT-NeoX, NoPE on the same weights and docs/conventions.md §7.2."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import functional as F
from posenc.encodings.rope import RoPE


def _positions(batch: int, length: int, offset: int = 0) -> torch.Tensor:
    return (torch.arange(length) + offset)[None].expand(batch, -1) + torch.arange(batch)[:, None] * 3


# ---------------------------------------------------------------------------- HF Llama (half pairing)


def test_matches_hf_llama_rotary_embedding_and_apply():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500000.0
    )
    hf_rope = LlamaRotaryEmbedding(config)
    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16)
    pos = _positions(2, 7, offset=100)
    cos, sin = hf_rope(q, pos)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)

    ours = posenc.build("rope", head_dim=16, base=500000.0)
    got_q, got_k = ours.rotate(q, k, pos, pos)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)

    inv_freq, scale = F.rope_inv_freq(16, base=500000.0)
    torch.testing.assert_close(inv_freq, hf_rope.inv_freq)
    assert scale == 1.0
    torch.testing.assert_close(F.apply_rope(q, pos, inv_freq), want_q, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- HF GPT-J (interleaved)


@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_matches_hf_gptj_interleaved(rotary_dim):
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    head_dim, length = 16, 9
    width = rotary_dim or head_dim
    x = torch.randn(2, 3, length, head_dim)  # ours: [B, H, T, D]
    pos = _positions(2, length, offset=5)
    table = create_sinusoidal_positions(64, width)  # [num_pos, width] = [sin | cos]
    sin, cos = table[pos].split(width // 2, dim=-1)
    x_hf = x.transpose(1, 2)  # GPT-J: [B, T, H, D]
    rotated = apply_rotary_pos_emb(x_hf[..., :width], sin, cos)
    want = torch.cat((rotated, x_hf[..., width:]), dim=-1).transpose(1, 2)

    inv_freq, _ = F.rope_inv_freq(width)
    got = F.apply_rope(x, pos, inv_freq, pairing="interleaved", rotary_dim=width)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    enc = posenc.build("rope", head_dim=head_dim, pairing="interleaved", rotary_dim=rotary_dim)
    got_q, _ = enc.rotate(x, x[:, :1], pos, pos)
    torch.testing.assert_close(got_q, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- GPT-NeoX partial rotary


def test_partial_rotary_matches_gpt_neox_rotary_pct():
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    config = GPTNeoXConfig(hidden_size=64, num_attention_heads=4, rotary_pct=0.25)  # head 16, rotary 4
    hf_rope = GPTNeoXRotaryEmbedding(config)
    torch.testing.assert_close(hf_rope.inv_freq, torch.tensor([1.0, 0.01]))  # docs/conventions.md §7.4
    q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 4, 6, 16)
    pos = torch.arange(6)[None] + 40
    cos, sin = hf_rope(q, pos)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)

    enc = posenc.build("rope", head_dim=16, rotary_dim=4)
    got_q, got_k = enc.rotate(q, k, pos, pos)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_q[..., 4:], q[..., 4:], rtol=0, atol=0)
    # The HF rope_parameters spelling of the same thing.
    via_dict = posenc.build(
        "rope", head_dim=16, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25}
    )
    torch.testing.assert_close(via_dict.rotate(q, k, pos, pos)[0], want_q, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- worked example (docs/conventions.md §7.2)


@pytest.mark.parametrize(
    ("pairing", "position", "expected"),
    [
        ("interleaved", 1, [-1.142640, 1.922076, 2.959851, 4.029800]),
        ("half", 1, [-1.984111, 1.959901, 2.462378, 4.019800]),
        ("interleaved", 2, [-2.234742, 0.077004, 2.919405, 4.059196]),
        ("half", 2, [-3.144039, 1.919605, -0.339143, 4.039197]),
    ],
)
def test_reference_worked_example(pairing, position, expected):
    inv_freq, _ = F.rope_inv_freq(4)  # θ = [1, 0.01]
    torch.testing.assert_close(inv_freq, torch.tensor([1.0, 0.01]))
    q = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    got = F.apply_rope(q, torch.tensor([position]), inv_freq, pairing=pairing)
    torch.testing.assert_close(got.flatten(), torch.tensor(expected), rtol=0, atol=2e-6)


# ---------------------------------------------------------------------------- properties


def _rotation_reference(x: torch.Tensor, position: float, theta: torch.Tensor, pairing: str) -> torch.Tensor:
    """The paper's rotation written pair by pair in float64 (independent of the library code)."""
    d = x.shape[-1]
    out = x.clone()
    for k in range(d // 2):
        a, b = (2 * k, 2 * k + 1) if pairing == "interleaved" else (k, k + d // 2)
        angle = position * float(theta[k])
        out[..., a] = x[..., a] * math.cos(angle) - x[..., b] * math.sin(angle)
        out[..., b] = x[..., a] * math.sin(angle) + x[..., b] * math.cos(angle)
    return out


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_score_depends_only_on_offset(pairing):
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    inv_freq = F.rope_inv_freq(8)[0].double()

    def score(m: int, n: int) -> float:
        rq = F.apply_rope(q, torch.tensor([m]), inv_freq, pairing=pairing)
        rk = F.apply_rope(k, torch.tensor([n]), inv_freq, pairing=pairing)
        return float((rq * rk).sum())

    assert score(3, 7) == pytest.approx(score(13, 17), abs=1e-10)
    assert score(3, 7) == pytest.approx(score(1003, 1007), abs=1e-9)
    assert score(3, 7) != pytest.approx(score(3, 8), abs=1e-3)
    rq = F.apply_rope(q, torch.tensor([5]), inv_freq, pairing=pairing)
    torch.testing.assert_close(rq.norm(), q.norm())  # rotations keep the norm
    torch.testing.assert_close(rq.flatten(), _rotation_reference(q.flatten(), 5, inv_freq, pairing))


def test_bf16_keeps_positions_above_256():
    """Angles in float32: in bf16, position 301 would round to 300 or 302 and rotate by a wrong angle."""
    x = torch.randn(1, 2, 4, 8)
    pos = torch.tensor([299, 301, 303, 1027])
    inv_freq, _ = F.rope_inv_freq(8)
    want = torch.stack(
        [
            _rotation_reference(x[0, :, t].double(), float(pos[t]), inv_freq.double(), "half")
            for t in range(4)
        ],
        dim=1,
    )[None]
    got = F.apply_rope(x.bfloat16(), pos, inv_freq)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=0, atol=0.05)
    enc = RoPE(8).to(torch.bfloat16)
    got_q, _ = enc.rotate(x.bfloat16(), x.bfloat16(), pos[None], pos[None])
    assert enc.cos_cached.dtype == torch.float32  # rebuilt in float32 after the module cast
    torch.testing.assert_close(got_q.double(), want, rtol=0, atol=0.05)


def test_cache_grows_beyond_cache_size():
    enc = RoPE(8, cache_size=16)
    x = torch.randn(1, 1, 3, 8)
    pos = torch.tensor([[5, 40, 100]])
    got, _ = enc.rotate(x, x, pos, pos)
    assert enc.cos_cached.shape[0] >= 101
    torch.testing.assert_close(got, F.apply_rope(x, pos, enc.inv_freq))
    assert "cos_cached" not in enc.state_dict()


# ---------------------------------------------------------------------------- pairing conversion


@pytest.mark.parametrize(
    ("src", "dst", "rotary_dim"), [("interleaved", "half", None), ("half", "interleaved", 4)]
)
def test_convert_pairing_keeps_attention_outputs(src, dst, rotary_dim):
    torch.manual_seed(2)
    heads, kv_heads, head_dim = 4, 2, 8
    spec = f"rope:pairing={src}" + (f",rotary_dim={rotary_dim}" if rotary_dim else "")
    original = posenc.MultiheadAttention(32, heads, encoding=spec, num_kv_heads=kv_heads, causal=True)
    converted = posenc.MultiheadAttention(
        32, heads, encoding=spec.replace(src, dst), num_kv_heads=kv_heads, causal=True
    )
    state = original.state_dict()
    for name, n in (("q_proj", heads), ("k_proj", kv_heads)):
        for part in ("weight", "bias"):
            key = f"{name}.{part}"
            state[key] = F.convert_rope_pairing(
                state[key], n, head_dim, src=src, dst=dst, rotary_dim=rotary_dim
            )
    converted.load_state_dict(state)
    x = torch.randn(2, 11, 32)
    pos = torch.arange(11) + 7
    torch.testing.assert_close(converted(x, positions=pos), original(x, positions=pos), rtol=1e-5, atol=1e-6)
    # Without the conversion the outputs differ (the test can fail).
    converted.load_state_dict(original.state_dict())
    assert not torch.allclose(converted(x, positions=pos), original(x, positions=pos), atol=1e-4)


def test_convert_pairing_round_trip():
    w = torch.randn(3 * 8, 5)
    there = F.convert_rope_pairing(w, 3, 8, src="interleaved", dst="half")
    back = F.convert_rope_pairing(there, 3, 8, src="half", dst="interleaved")
    torch.testing.assert_close(back, w, rtol=0, atol=0)
    assert not torch.equal(there, w)


# ---------------------------------------------------------------------------- errors


def test_bad_options_raise_naming_the_parameter():
    with pytest.raises(ValueError, match="head_dim"):
        posenc.build("rope", head_dim=7)
    with pytest.raises(ValueError, match="head_dim"):
        F.rope_inv_freq(9)
    with pytest.raises(ValueError, match="rotary_dim"):
        posenc.build("rope", head_dim=8, rotary_dim=3)
    with pytest.raises(ValueError, match="rotary_dim"):
        posenc.build("rope", head_dim=8, rotary_dim=10)
    with pytest.raises(ValueError, match="pairing"):
        posenc.build("rope:pairing=pairwise", head_dim=8)
    with pytest.raises(ValueError, match="rotary_dim"):
        F.apply_rope(torch.randn(1, 1, 2, 8), torch.arange(2), F.rope_inv_freq(8)[0], rotary_dim=5)
    with pytest.raises(ValueError, match="head_dim"):
        posenc.MultiheadAttention(21, 3, encoding="rope")  # head_dim 7
    with pytest.raises(ValueError, match="rows"):
        F.convert_rope_pairing(torch.randn(10, 4), 2, 4)


def test_spec_string_round_trip():
    enc = posenc.build("rope:base=500000,pairing=interleaved,rotary_dim=4", head_dim=8)
    again = posenc.build(enc.spec())
    assert again.config() == enc.config()
    torch.testing.assert_close(again.inv_freq, torch.tensor([1.0, 500000.0**-0.5]))


def test_the_layer_rotates_its_fresh_projections_in_place():
    layer = posenc.MultiheadAttention(32, 2, encoding="rope", causal=True)
    q = torch.randn(1, 2, 5, 16)
    k = torch.randn(1, 2, 5, 16)
    pos = torch.arange(5)[None]
    q_rot, k_rot = layer.encoding.rotate_fresh(q, k, pos, pos)
    assert q_rot.data_ptr() == q.data_ptr() and k_rot.data_ptr() == k.data_ptr()
    q2, k2 = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    out_q, _ = layer.encoding.rotate(q2, k2, pos, pos)
    assert out_q.data_ptr() != q2.data_ptr()  # rotate() never touches its inputs


@pytest.mark.parametrize(
    "spec",
    [
        "rope",
        "rope:rotary_dim=4",
        "rope:scaling=proportional,rotary_dim=4",
        "rope:scaling=yarn,factor=2,original_max_position_embeddings=8",
    ],
)
def test_switching_a_layer_to_interleaved_pairs_keeps_its_outputs(spec):
    """switch_rope_pairing_ permutes q/k rows and switches the pairing: the layer (GQA, biases, partial
    rotary, p-RoPE, scaled) gives the outputs and input gradients it gave before; switching back
    restores the weights bit for bit."""
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(32, 4, spec, num_kv_heads=2, causal=True, bias=True).double()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(2, 11, 32, dtype=torch.float64, requires_grad=True)
    want = layer(x)
    (want_grad,) = torch.autograd.grad(want.square().sum(), x)
    assert posenc.switch_rope_pairing_(layer) == 1
    assert layer.encoding.pairing == "interleaved" and "pairing=interleaved" in layer.encoding.spec()
    assert not torch.equal(layer.q_proj.weight, before["q_proj.weight"])  # the rows moved
    got = layer(x)
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    assert posenc.switch_rope_pairing_(layer) == 0  # already interleaved
    assert posenc.switch_rope_pairing_(layer, "half") == 1
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_switching_a_model_switches_its_shared_encoding_once():
    torch.manual_seed(0)
    model = posenc.TransformerLM(
        vocab_size=13, d_model=32, num_heads=4, num_layers=3, encoding="rope"
    ).double()
    tokens = torch.randint(0, 13, (2, 9))
    want = model(tokens)
    assert posenc.switch_rope_pairing_(model) == 3
    torch.testing.assert_close(model(tokens), want, rtol=1e-12, atol=1e-12)


def test_switching_refuses_a_cache_written_before_and_encodings_serving_other_modules():
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(16, 2, "rope", causal=True)
    cache = posenc.KVCache()
    layer(torch.randn(1, 4, 16), cache=cache)
    posenc.switch_rope_pairing_(layer)
    with pytest.raises(ValueError, match="switch_rope_pairing_"):
        layer(torch.randn(1, 1, 16), cache=cache)
    other = posenc.MultiheadAttention(16, 2, "rope", causal=True)
    holder = torch.nn.Module()
    holder.layer, holder.elsewhere = other, other.encoding
    weight = other.q_proj.weight.clone()
    with pytest.raises(ValueError, match=r"'elsewhere'.*also serves"):
        posenc.switch_rope_pairing_(holder)
    assert other.encoding.pairing == "half" and torch.equal(other.q_proj.weight, weight)  # nothing changed
    with pytest.raises(ValueError, match="pairing"):
        posenc.switch_rope_pairing_(other, "paired")


def test_repr_shows_the_base_and_scaling_from_rope_parameters():
    """Issue 49 item 14: a RoPE built from rope_parameters printed ``base=10000.0, scaling=None``
    while it computed with 500000 and llama3."""
    llama31 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    text = repr(posenc.build("rope", head_dim=64, rope_parameters=llama31))
    for shown in ("base=500000.0", "scaling='llama3'", "factor=8.0", "original_max_position_embeddings=8192"):
        assert shown in text, text
    assert "10000.0" not in text and "None" not in text.split("(tables)")[0].replace("head_dim=None", "")


def _pair(first: str, second: str) -> tuple[posenc.MultiheadAttention, posenc.MultiheadAttention]:
    a = posenc.MultiheadAttention(32, 4, encoding=first, causal=True)
    b = posenc.MultiheadAttention(32, 4, encoding=second, causal=True)
    b.load_state_dict(a.state_dict())
    return a, b


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


def test_always_equals_nope_on_the_same_weights():
    dropped, nope = _pair("rope:drop_rotation=always", "nope")
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(dropped(x), nope(x), rtol=1e-6, atol=1e-6)
    rope, _ = _pair("rope", "nope")
    rope.load_state_dict(dropped.state_dict())
    assert not torch.allclose(rope(x), nope(x), atol=1e-4)  # the rotation matters on these weights


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
