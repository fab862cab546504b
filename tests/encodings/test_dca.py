"""Dual Chunk Attention against HKUNLP/ChunkLlama's ``chunkllama_attn_replace.py``, restated here.

The references are the patch's two recipes, written again with HF's RoPE tables
(:mod:`_piecewise_rope`) and the patch's own position tables (``q_t = arange(c)``,
``qc_t = (arange(c) + c).clamp(max=chunk_size)``, ``k_t = arange(n) % c``, ``c = chunk_size -
local_size``): the decode step's explicit logits, ``[inter | successive | intra]`` joined along the
keys, and the prefill's chunk loop, flash attentions of each chunk's three parts merged by their
log-sum-exp (in float64 here; the patch rounds the merge weights to bfloat16).
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from _piecewise_rope import (
    EXACT,
    HEAD_DIM,
    THETA,
    cached_generate_equals_full_pass,
    cached_pieces,
    causal_part,
    hf_cos_sin,
    hf_ids,
    layer,
    max_diff,
    plain_rope_output,
    qk,
    rotate_half,
    smollm2_checks,
    swapped_equals_hf,
    tiny_llama,
)

SCALE = HEAD_DIM**-0.5


def _tables(chunk_size: int, local_size: int, length: int):
    chunk = chunk_size - local_size
    q_t = torch.arange(chunk, dtype=torch.float32)
    qc_t = (torch.arange(chunk, dtype=torch.float32) + chunk).clamp(max=chunk_size)
    k_t = torch.arange(length, dtype=torch.float32) % chunk
    return chunk, q_t, qc_t, k_t


def _at(x, float_positions):
    cos, sin = hf_cos_sin(float_positions)
    return x * cos + rotate_half(x) * sin


def patch_decode_row(q_row, k, i: int, chunk_size: int, local_size: int):
    """The patch's cached step (``has_kv_cache``) for the query at position ``i``, keys ``0..i``."""
    kv_len = i + 1
    chunk, q_t, qc_t, k_t = _tables(chunk_size, local_size, kv_len)
    keys = _at(k[:, :, :kv_len], k_t)
    current = (kv_len - 1) // chunk
    within = i % chunk
    scores = [_at(q_row, q_t[within]) @ keys[:, :, chunk * current :].transpose(-1, -2)]
    if current >= 1:
        succ_keys = keys[:, :, chunk * (current - 1) : chunk * current]
        scores.insert(0, _at(q_row, qc_t[within]) @ succ_keys.transpose(-1, -2))
    if current >= 2:
        inter_keys = keys[:, :, : chunk * (current - 1)]
        scores.insert(0, _at(q_row, qc_t[chunk - 1]) @ inter_keys.transpose(-1, -2))
    return torch.cat(scores, dim=-1) / math.sqrt(HEAD_DIM)


def _flash(q, k, v, causal: bool):
    """``flash_attn_func(..., return_attn_probs=True)``'s output and log-sum-exp, in float64."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    if causal:
        logits = logits.masked_fill(torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return logits.softmax(-1) @ v, logits.logsumexp(-1)


def patch_prefill_output(q, k, v, chunk_size: int, local_size: int):
    """The patch's prefill: chunk by chunk, intra (causal), successive and inter flash attentions
    merged by their log-sum-exp (``merge_attn_outputs``)."""
    length = q.shape[2]
    chunk, q_t, qc_t, k_t = _tables(chunk_size, local_size, length)
    keys = _at(k, k_t)
    position = torch.arange(length) % chunk
    outputs = [
        _flash(_at(q[:, :, :chunk], q_t[position[:chunk]]), keys[:, :, :chunk], v[:, :, :chunk], True)[0]
    ]
    for begin in range(chunk, length, chunk):
        end = min(begin + chunk, length)
        rows = position[begin:end]
        parts = [_flash(_at(q[:, :, begin:end], q_t[rows]), keys[:, :, begin:end], v[:, :, begin:end], True)]
        prev = slice(begin - chunk, begin)
        parts.append(_flash(_at(q[:, :, begin:end], qc_t[rows]), keys[:, :, prev], v[:, :, prev], False))
        if begin - chunk > 0:
            inter_q = _at(q[:, :, begin:end], qc_t[torch.full_like(rows, chunk - 1)])
            parts.append(_flash(inter_q, keys[:, :, : begin - chunk], v[:, :, : begin - chunk], False))
        lse = torch.stack([p[1] for p in parts])
        weights = (lse - lse.max(0).values).exp()
        weights = weights / weights.sum(0)
        outputs.append(sum(w[..., None] * p[0] for w, p in zip(weights, parts)))
    return torch.cat(outputs, dim=2)


def _posenc_logits(spec: str, q, k):
    enc = posenc.build(spec, head_dim=HEAD_DIM)
    positions = torch.arange(q.shape[2])[None]
    return enc.logits(q, k, positions, positions, scale=SCALE)


def _spec(chunk_size: int, local_size: int) -> str:
    return f"dca:chunk_size={chunk_size},local_size={local_size}"


SIZES = [(6, 2), (8, 3), (5, 0), (7, 5), (3, 2), (12, 5)]


@pytest.mark.parametrize("chunk_size,local_size", SIZES)
def test_logits_equal_the_patch_decode_step_in_float64(chunk_size, local_size):
    q, k = qk(1, 37, seed=4)
    got = _posenc_logits(_spec(chunk_size, local_size), q, k)
    for i in range(37):
        want = patch_decode_row(q[:, :, i : i + 1], k, i, chunk_size, local_size)
        assert max_diff(got[:, :, i : i + 1, : i + 1], want) < 1e-12, i


@pytest.mark.parametrize("chunk_size,local_size", SIZES)
@pytest.mark.parametrize("length", [37, 1])
def test_attention_equals_the_patch_prefill_s_merged_chunks_in_float64(chunk_size, local_size, length):
    q, k = qk(2, length, seed=6)
    v = torch.randn(2, 2, length, HEAD_DIM, dtype=torch.float64)
    logits = _posenc_logits(_spec(chunk_size, local_size), q, k)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    got = logits.masked_fill(future, -math.inf).softmax(-1) @ v
    assert max_diff(got, patch_prefill_output(q, k, v, chunk_size, local_size)) < 1e-12


@pytest.mark.parametrize(
    "spec,rope_spec",
    [
        ("dca:chunk_size=37,local_size=0", "rope"),
        ("dca:chunk_size=50,local_size=10", "rope"),
        (
            "dca:chunk_size=64,local_size=3,base=500,pairing=interleaved,rotary_dim=8,scaling=ntk,factor=2",
            "rope:base=500,pairing=interleaved,rotary_dim=8,scaling=ntk,factor=2",
        ),
    ],
)
def test_one_chunk_is_plain_rope(spec, rope_spec):
    """Every position within the first chunk (below chunk_size - local_size): RoPE with the same options."""
    attn = layer(spec)
    x = torch.randn(2, 37, attn.embed_dim, dtype=torch.float64)
    torch.testing.assert_close(attn(x), plain_rope_output(attn, x, rope_spec), **EXACT)


def test_several_chunks_differ_from_plain_rope():
    attn = layer(_spec(6, 2))
    x = torch.randn(1, 20, attn.embed_dim, dtype=torch.float64)
    assert max_diff(attn(x), plain_rope_output(attn, x, "rope")) > 1e-3


def test_no_relative_position_exceeds_chunk_size():
    """With q = k = a vector RoPE turns (the first pair), every logit is cos(relative angle): the
    relative positions DCA gives lie in [0, chunk_size] (the key position is below the query's)."""
    enc = posenc.build(_spec(6, 2), head_dim=HEAD_DIM)
    unit = torch.zeros(1, 1, 40, HEAD_DIM, dtype=torch.float64)
    unit[..., 0] = 1.0
    positions = torch.arange(40)[None]
    cosines = causal_part(enc.logits(unit, unit, positions, positions, scale=1.0))
    theta = 1.0  # the first pair's frequency, base**0
    allowed = torch.cos(torch.arange(0, 7) * theta)
    assert ((cosines[..., None] - allowed).abs().min(-1).values < 1e-6).all()


@pytest.mark.parametrize("spec", [_spec(6, 2), _spec(5, 0)])
@pytest.mark.parametrize("chunks", [[1] * 20, [7, 1, 1, 5, 6], [3, 17]])
def test_cached_decoding_equals_the_full_pass_past_the_chunks(spec, chunks):
    attn = layer(spec, num_kv_heads=1)
    x = torch.randn(2, 20, attn.embed_dim, dtype=torch.float64)
    torch.testing.assert_close(cached_pieces(attn, x, chunks), attn(x), **EXACT)


@pytest.mark.parametrize(
    "spec,option",
    [
        ("dca:chunk_size=4,local_size=4", "local_size"),
        ("dca:chunk_size=4,local_size=9", "local_size"),
        ("dca:chunk_size=0,local_size=0", "chunk_size"),
        ("dca:chunk_size=4,local_size=-1", "local_size"),
        ("dca:local_size=2", "chunk_size"),
        ("dca:chunk_size=6", "local_size"),
        ("dca:chunk_size=6,local_size=2,scaling=dynamic,factor=2", "scaling"),
        ("dca:chunk_size=6,local_size=2,log_scale_length=8", "log_scale_length"),
    ],
)
def test_bad_options_are_refused_at_build_time_by_name(spec, option):
    with pytest.raises(ValueError, match=option):
        posenc.build(spec, head_dim=HEAD_DIM)


# ---------------------------------------------------------------------------- HF


@pytest.mark.hf
@pytest.mark.parametrize("spec", [_spec(19, 0), _spec(64, 16)])
def test_hf_swap_disabled_is_the_model_s_own_rope(spec):
    swapped_equals_hf(tiny_llama, f"{spec},base={THETA}", hf_ids(19))


@pytest.mark.hf
def test_hf_swap_enabled_generates_with_the_cache_as_a_full_pass():
    import posenc.hf

    model = posenc.hf.swap_encoding(tiny_llama(), f"{_spec(5, 2)},base={THETA}")
    with torch.no_grad():
        assert max_diff(model(hf_ids(12)).logits, tiny_llama()(hf_ids(12)).logits) > 1e-4  # the method acts
    cached_generate_equals_full_pass(model, hf_ids(9), 8, rtol=1e-9, atol=1e-9)


@pytest.mark.real
@pytest.mark.hf
def test_smollm2_disabled_is_hf_and_enabled_decodes_as_a_full_pass():
    smollm2_checks(f"{_spec(4096, 512)},base=100000", f"{_spec(9, 3)},base=100000")
