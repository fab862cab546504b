"""Position bookkeeping bugs reported in other projects in 2026, kept out of posenc: one test per report,
named after it, each against a reference that does not share the code under test.

- torchtitan 2559, OLMo-core 591, Megatron 5243: packed documents whose positions never reset.
- mlxcel 679, imp 117: chunked prefill against one shot under a sliding window (chunks longer than
  the window, a cache that keeps the recent tokens).
- cactus 688: half-precision angles at position 100,000 and beyond.
- Soup 793: a RoPE scaling set after the model is loaded.
- pie 603: partial RoPE's frequencies taken from the head size instead of the rotary width.
- tt-xla 3688: a window cache recompiling every decode step of compiled HF generation: in
  ``tests/hf/test_static_cache.py`` (``test_compiled_static_generation_traces_once``, the case
  ``tt_xla_3688-mistral-sliding-window``: a second compiled ``generate`` traces nothing).
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc

E, H = 32, 4


def _model(encoding: str = "rope", **options) -> posenc.TransformerLM:
    torch.manual_seed(0)
    return posenc.TransformerLM(23, E, 2, H, encoding, **options).double().eval()


def test_torchtitan_2559_olmo_core_591_megatron_5243_packed_documents_restart_their_positions():
    """Three documents packed in one row give each document's logits as if it ran alone."""
    model = _model()
    lengths = (5, 3, 6)
    tokens = torch.randint(0, 23, (1, sum(lengths)))
    documents = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = model(tokens, document_ids=documents)
        alone = torch.cat([model(part) for part in tokens.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 2, 5, 7])
@pytest.mark.parametrize("max_length", [None, 12])
def test_mlxcel_679_imp_117_chunked_prefill_under_a_window_equals_one_shot(chunk, max_length):
    """A windowed layer (window 4) prefilled in chunks, some longer than the window, into a cache
    that keeps only the window's keys (trimmed; preallocated or growing) equals the one-shot pass."""
    torch.manual_seed(1)
    layer = posenc.MultiheadAttention(E, H, "rope", causal=True, window=4).double().eval()
    x = torch.randn(2, 19, E, dtype=torch.float64)
    with torch.no_grad():
        whole = layer(x)
        cache = posenc.KVCache(max_length=max_length)
        pieces = [layer(part, cache=cache) for part in x.split(chunk, dim=1)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-10, atol=1e-10)
    assert cache.length(0) <= 3 or chunk > 3  # the cache kept the window's keys, not the prefix


def test_mlxcel_679_a_recent_tokens_cache_decodes_as_its_window_says():
    """StreamingLLM's cache (sinks + recent tokens) against the same attention written with positions
    inside the cache, step by step: the positions are the slots, not the tokens' indices."""
    torch.manual_seed(2)
    layer = posenc.MultiheadAttention(E, H, "rope", causal=True).double().eval()
    x = torch.randn(1, 10, E, dtype=torch.float64)
    sinks, recent = 1, 3
    cache = posenc.KVCache(recent_tokens=recent, sink_tokens=sinks)
    with torch.no_grad():
        outs = [layer(x[:, t : t + 1], cache=cache) for t in range(10)]
        for t in range(5, 10):
            kept = [0, *range(t - recent, t + 1)]  # the sink, the recent tokens and the new one
            want = layer(x[:, kept], positions=torch.arange(len(kept)))[:, -1:]
            torch.testing.assert_close(outs[t], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cactus_688_half_precision_angles_at_position_100000(dtype):
    """q and k in half precision at positions 100,000 and beyond rotate by float32 angles: the result
    is the float64 rotation rounded once to the half type, not a rotation by half-precision angles
    (which at p = 100,000 are off by tens of radians in bfloat16)."""
    torch.manual_seed(3)
    encoding = posenc.build("rope", head_dim=16)
    positions = torch.arange(100_000, 100_008)[None]
    q = torch.randn(1, 2, 8, 16)
    rotated, _ = encoding.rotate(q.to(dtype), q.to(dtype), positions, positions)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    angles = positions[0, :, None].double() * inv_freq.float().double()
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    qd = q.to(dtype).double()
    want = qd * cos + torch.cat([-qd[..., 8:], qd[..., :8]], -1) * sin
    eps = torch.finfo(dtype).eps
    assert float((rotated.double() - want).abs().max()) < 8 * eps * float(qd.abs().max())


def test_soup_793_a_scaling_set_after_load_equals_loading_with_it():
    transformers = pytest.importorskip("transformers")
    import posenc.hf

    torch.manual_seed(4)
    base = {"vocab_size": 60, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
    scaling = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    }
    loaded = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base)).eval()
    scaled = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base, rope_parameters=scaling)).eval()
    scaled.load_state_dict(loaded.state_dict())
    posenc.hf.set_rope_scaling(loaded, scaling)
    ids = torch.randint(0, 60, (1, 200))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, scaled(ids).logits, rtol=1e-5, atol=1e-5)


def test_pie_603_partial_rope_takes_its_frequencies_from_the_rotary_width():
    """Partial RoPE (rotary_dim 8 of a head of 32) turns pair k at base^(-2k/8), as HF's
    ``partial_rotary_factor`` does, not base^(-2k/32)."""
    encoding = posenc.build("rope:rotary_dim=8", head_dim=32)
    want = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.int64).float() / 8))
    torch.testing.assert_close(encoding.inv_freq, want, rtol=0, atol=0)
    q = torch.randn(1, 1, 3, 32)
    turned, _ = encoding.rotate(q, q, torch.arange(3)[None], torch.arange(3)[None])
    torch.testing.assert_close(turned[..., 8:], q[..., 8:])  # the other channels pass through
    assert math.isclose(float(encoding.inv_freq[1]), 0.1, rel_tol=1e-6)
