"""LeRoPE (``rope:learned_frequencies=true``, Mistral Large 4) against HF ``MistralLarge4TextRotaryEmbedding``.

The reference is HF transformers' rotary embedding of Mistral Large 4 (a learned ``alpha`` per
frequency, ``inv_freq · exp(alpha)`` after the scaling) with ``apply_rotary_pos_emb`` (half pairs)
and ``apply_rotary_pos_emb_interleave`` (the model's interleaved pairs), on tiny random configs with
a random nonzero ``alpha``. Nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.encodings.rope import RoPE, load_lerope_alpha_

ml4 = pytest.importorskip("transformers.models.mistral_large4.modeling_mistral_large4")
from transformers import MistralLarge4TextConfig  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

D = 8  # qk_rope_head_dim: 4 frequency pairs

ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
    # Mistral Large 4's own default: YaRN over 512 tokens, no magnitude scaling
    "yarn_ml4": None,
    "yarn_mscale": {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def _config(rope_parameters: dict | None) -> MistralLarge4TextConfig:
    return MistralLarge4TextConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=4,
        qk_rope_head_dim=D,
        qk_nope_head_dim=4,
        v_head_dim=6,
        kv_lora_rank=12,
        max_position_embeddings=4096,
        rope_parameters=None if rope_parameters is None else dict(rope_parameters),
    )


def _pair(name: str, pairing: str = "half", seed: int = 0):
    """HF's rotary embedding with a random alpha, and posenc's LeRoPE holding the same alpha."""
    config = _config(ROPE_PARAMETERS[name])
    hf = ml4.MistralLarge4TextRotaryEmbedding(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        hf.alpha.normal_(0.0, 0.4)
    enc = RoPE(
        head_dim=D,
        pairing=pairing,
        rope_parameters=dict(config.rope_parameters),
        max_position_embeddings=config.max_position_embeddings,
        learned_frequencies=True,
    )
    load_lerope_alpha_(enc, hf.alpha)
    return hf, enc


POSITIONS = torch.tensor([[0, 1, 2, 7, 100, 511, 513, 3000], [5, 6, 9, 40, 41, 900, 2047, 4095]])


@pytest.mark.parametrize("name", list(ROPE_PARAMETERS))
def test_cos_sin_equal_hf(name):
    hf, enc = _pair(name)
    assert bool((hf.alpha != 0).all())
    x = torch.zeros(1, dtype=torch.float32)
    hf_cos, hf_sin = hf(x, POSITIONS)  # [B, T, D] = cat(freqs, freqs)
    cos, sin = enc.cos_sin(POSITIONS)  # [B, T, D/2]
    assert cos.dtype == torch.float32
    torch.testing.assert_close(cos, hf_cos[..., : D // 2], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin[..., : D // 2], atol=1e-6, rtol=0)
    # alpha changes the rotation: without it the tables differ from HF's (the test can fail)
    plain = RoPE(head_dim=D, rope_parameters=dict(hf.config.rope_parameters), max_position_embeddings=4096)
    assert not torch.allclose(plain.cos_sin(POSITIONS)[0], hf_cos[..., : D // 2], atol=1e-3)


@pytest.mark.parametrize("name", ["default", "yarn_ml4", "yarn_mscale"])
def test_rotated_q_k_equal_hf_half_pairs_float64(name):
    hf, enc = _pair(name)
    torch.manual_seed(1)
    q = torch.randn(2, 3, POSITIONS.shape[1], D, dtype=torch.float64)
    k = torch.randn(2, 3, POSITIONS.shape[1], D, dtype=torch.float64)
    cos, sin = hf(q, POSITIONS)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = enc.rotate(q, k, POSITIONS, POSITIONS)
    torch.testing.assert_close(got_q, hf_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, hf_k, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["yarn_ml4", "linear"])
def test_rotated_q_k_equal_hf_interleaved_pairs(name):
    """Mistral Large 4 rotates pairs (2k, 2k+1) and writes them out as halves: posenc's interleaved
    rotation, then the evens-then-odds permutation HF's output layout has."""
    hf, enc = _pair(name, pairing="interleaved")
    torch.manual_seed(2)
    q = torch.randn(2, 3, POSITIONS.shape[1], D)
    k = torch.randn(2, 3, POSITIONS.shape[1], D)
    cos, sin = hf(q, POSITIONS)
    hf_q, hf_k = ml4.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    got_q, got_k = enc.rotate(q.clone(), k.clone(), POSITIONS, POSITIONS)
    order = torch.cat((torch.arange(0, D, 2), torch.arange(1, D, 2)))
    torch.testing.assert_close(got_q[..., order], hf_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k[..., order], hf_k, atol=1e-5, rtol=1e-5)


def test_alpha_gradient_equals_hf():
    hf, enc = _pair("yarn_ml4")
    torch.manual_seed(3)
    q = torch.randn(1, 2, POSITIONS.shape[1], D, dtype=torch.float64)
    k = torch.randn(1, 2, POSITIONS.shape[1], D, dtype=torch.float64)
    cos, sin = hf(q, POSITIONS[:1])
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    (hf_q @ hf_k.transpose(-1, -2)).sum().backward()
    got_q, got_k = enc.rotate(q, k, POSITIONS[:1], POSITIONS[:1])
    (got_q @ got_k.transpose(-1, -2)).sum().backward()
    assert enc.alpha.grad is not None and bool((enc.alpha.grad != 0).any())
    torch.testing.assert_close(enc.alpha.grad, hf.alpha.grad, atol=1e-4, rtol=1e-4)


def test_alpha_is_a_float32_parameter_initialised_to_zero_and_saved():
    enc = posenc.build(
        "rope:learned_frequencies=true,scaling=yarn,factor=4,original_max_position_embeddings=16", head_dim=16
    )
    assert isinstance(enc.alpha, torch.nn.Parameter) and enc.alpha.dtype == torch.float32
    assert enc.alpha.shape == (8,) and bool((enc.alpha == 0).all())
    assert list(enc.state_dict()) == ["alpha"]
    # at init LeRoPE is the scaling's rotation
    plain = posenc.build("rope:scaling=yarn,factor=4,original_max_position_embeddings=16", head_dim=16)
    pos = torch.arange(50)[None]
    torch.testing.assert_close(enc.cos_sin(pos), plain.cos_sin(pos), atol=0, rtol=0)
    # the non-learned path keeps its buffers and no parameter
    assert plain.alpha is None and not list(plain.parameters())
    # round trips: spec, state dict
    again = posenc.build(enc.spec())
    with torch.no_grad():
        enc.alpha.normal_()
    again.load_state_dict(enc.state_dict())
    torch.testing.assert_close(again.cos_sin(pos), enc.cos_sin(pos))


def test_alpha_stays_float32_when_the_layer_is_cast():
    layer = posenc.MultiheadAttention(32, 2, "rope:learned_frequencies=true", causal=True)
    alpha = layer.encoding.alpha
    layer.to(torch.bfloat16)
    assert layer.encoding.alpha is alpha and alpha.dtype == torch.float32
    assert layer.q_proj.weight.dtype == torch.bfloat16
    out = layer(torch.randn(1, 5, 32, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def test_proportional_keeps_its_still_pairs():
    """p-RoPE's pairs of frequency 0 stay still whatever alpha (0 · exp(alpha) = 0)."""
    enc = posenc.build(
        "rope:scaling=proportional,partial_rotary_factor=0.5,learned_frequencies=true", head_dim=16
    )
    with torch.no_grad():
        enc.alpha.normal_()
    cos, sin = enc.cos_sin(torch.arange(10)[None])
    still = enc.inv_freq == 0
    assert bool(still.any())
    assert bool((cos[..., still] == 1).all()) and bool((sin[..., still] == 0).all())


def test_learned_frequencies_must_be_a_bool():
    with pytest.raises(ValueError, match="learned_frequencies"):
        posenc.build("rope:learned_frequencies=maybe")
    with pytest.raises(ValueError, match="learned_frequencies"):
        RoPE(head_dim=8, learned_frequencies=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spec",
    [
        "self_extend:group_size=3,neighbor_window=4,learned_frequencies=true",
        "rerope:window=4,learned_frequencies=true",
        "mrope:mrope_section=2|1|1,learned_frequencies=true",
    ],
)
def test_families_built_on_rope_refuse_the_option_by_name(spec):
    with pytest.raises(ValueError, match="learned_frequencies"):
        posenc.build(spec)


def test_load_lerope_alpha_checks_the_encoding_and_the_shape():
    with pytest.raises(ValueError, match="learned_frequencies"):
        load_lerope_alpha_(RoPE(head_dim=8), torch.zeros(4))
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        load_lerope_alpha_(RoPE(head_dim=8, learned_frequencies=True), torch.zeros(5))


def test_worked_numbers_of_conventions_7_18():
    """docs/conventions.md §7.18: θ'_k = θ_k · exp(α_k), the numbers computed by hand (math module)."""
    enc = RoPE(head_dim=8, learned_frequencies=True)
    alpha = torch.tensor([0.5, -0.5, 0.0, 1.0])
    load_lerope_alpha_(enc, alpha)
    expected = torch.tensor([1.6487213, 0.0606531, 0.01, 0.0027183])
    torch.testing.assert_close(enc.frequencies().detach(), expected, atol=1e-7, rtol=1e-7)
    cos, sin = enc.cos_sin(torch.tensor([[3]]))
    torch.testing.assert_close(
        cos[0, 0].detach(), torch.tensor([0.231651, 0.983491, 0.999550, 0.999967]), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        sin[0, 0].detach(), torch.tensor([-0.972799, 0.180957, 0.029996, 0.008155]), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("max_length", [None, 16])
def test_lerope_layer_decodes_with_the_cache_as_the_full_pass(max_length):
    """The plain decode step and the preallocated cache rotate through the learned frequencies too."""
    torch.manual_seed(7)
    layer = posenc.MultiheadAttention(
        32, 2, "rope:learned_frequencies=true,scaling=linear,factor=2", causal=True
    ).eval()
    with torch.no_grad():
        layer.encoding.alpha.normal_(0.0, 0.5)
    twin = posenc.MultiheadAttention(32, 2, "rope:scaling=linear,factor=2", causal=True).eval()
    twin.load_state_dict(layer.state_dict(), strict=False)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        full = layer(x)
        assert not torch.allclose(full, twin(x), atol=1e-3)  # alpha acts
        cache = posenc.KVCache(max_length=max_length)
        steps = [layer(x[:, :3], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(3, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
