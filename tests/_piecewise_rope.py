"""What the tests of the piecewise-RoPE families (ReRoPE and Leaky ReRoPE, Self-Extend, DCA) share.

* HF Llama's RoPE recipe restated on its own (``LlamaRotaryEmbedding``: float32 angles
  ``position · inv_freq``, ``cos``/``sin`` of ``cat(freqs, freqs)``; ``rotate_half``), the tables the
  reference patches rotate with, applied to float64 queries and keys;
* the checks every family meets: a layer's output from reference logits (one softmax), cached
  decoding against the full pass, the layer against plain RoPE where the method is disabled;
* a tiny random HF Llama and SmolLM2's trained weights through ``posenc.hf.swap_encoding``: disabled,
  HF's own logits; enabled, cached greedy generation equals a full pass's argmax.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import posenc

F64 = torch.float64
HEADS, HEAD_DIM = 2, 16
EMBED = HEADS * HEAD_DIM
EXACT = {"rtol": 1e-10, "atol": 1e-10}


# ---------------------------------------------------------------------------- HF's RoPE recipe


def hf_inv_freq(dim: int = HEAD_DIM, base: float = 10000.0) -> torch.Tensor:
    """``1 / base^(2k/d)`` in float32, as HF's default RoPE builds it."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def hf_cos_sin(positions: torch.Tensor, dim: int = HEAD_DIM, base: float = 10000.0):
    """``cos``/``sin`` ``[..., dim]`` (float32 angles and tables, returned as float64) at ``positions``
    (integer, or float32 values already computed as the reference computes them)."""
    freqs = positions.float()[..., None] * hf_inv_freq(dim, base)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(F64), emb.sin().to(F64)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0, sign: float = 1.0) -> torch.Tensor:
    """``x [B, H, T, D]`` rotated at ``positions [T]`` (``sign=-1``: by minus the angle, as the
    patches' decode steps turn their keys)."""
    cos, sin = hf_cos_sin(positions, x.shape[-1], base)
    return x * cos + rotate_half(x) * (sign * sin)


def qk(batch: int, length: int, seed: int = 0, k_len: int | None = None):
    """Random float64 ``q [B, H, T, D]`` and ``k [B, H, Tk, D]`` of unit scale."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, length, HEAD_DIM, generator=generator, dtype=F64)
    k = torch.randn(
        batch, HEADS, length if k_len is None else k_len, HEAD_DIM, generator=generator, dtype=F64
    )
    return q, k


def causal_part(logits: torch.Tensor) -> torch.Tensor:
    """The entries a causal decoder reads (key index <= query index; queries are the last ones)."""
    q_len, k_len = logits.shape[-2:]
    keep = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    return logits[..., keep]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------------- layers


def layer(spec: str, seed: int = 0, **kwargs) -> posenc.MultiheadAttention:
    torch.manual_seed(seed)
    return posenc.MultiheadAttention(EMBED, HEADS, encoding=spec, causal=True, dtype=F64, **kwargs).eval()


def twin(source: posenc.MultiheadAttention, spec: str) -> posenc.MultiheadAttention:
    """A layer with ``source``'s weights and another encoding."""
    other = layer(spec, num_kv_heads=source.num_kv_heads)
    other.load_state_dict(source.state_dict())
    return other


def x_input(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, length, EMBED, generator=torch.Generator().manual_seed(seed), dtype=F64)


def output_from_logits(attn: posenc.MultiheadAttention, x: torch.Tensor, logits_fn) -> torch.Tensor:
    """``attn``'s output with its logits replaced by ``logits_fn(q, k) [B, H, T, T]`` (scaled):
    one causal softmax, then the values and the output projection, as a plain attention layer."""
    batch, length, _ = x.shape

    def heads(proj: torch.nn.Linear, count: int) -> torch.Tensor:
        out = proj(x).view(batch, length, count, attn.head_dim).transpose(1, 2)
        return out.repeat_interleave(attn.num_heads // count, dim=1)

    q, k, v = (
        heads(attn.q_proj, attn.num_heads),
        heads(attn.k_proj, attn.num_kv_heads),
        heads(attn.v_proj, attn.num_kv_heads),
    )
    logits = logits_fn(q, k)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    probs = logits.masked_fill(future, -math.inf).softmax(-1)
    return attn.out_proj((probs @ v).transpose(1, 2).reshape(batch, length, -1))


def cached_pieces(attn: posenc.MultiheadAttention, x: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """``attn`` run over ``x`` in ``chunks`` with a KV cache, the outputs joined."""
    cache, pieces, start = posenc.KVCache(), [], 0
    for size in chunks:
        pieces.append(attn(x[:, start : start + size], cache=cache))
        start += size
    assert start == x.shape[1]
    return torch.cat(pieces, dim=1)


def plain_rope_output(attn: posenc.MultiheadAttention, x: torch.Tensor, rope_spec: str) -> torch.Tensor:
    """The output of ``attn``'s weights with plain RoPE (``rope_spec``) on the eager backend."""
    with posenc.use_backend("eager"):
        return twin(attn, rope_spec)(x)


# ---------------------------------------------------------------------------- HF


VOCAB, THETA = 61, 10000.0


def tiny_llama(seed: int = 0):
    """A two-layer random Llama (4 heads of 16, 2 KV heads; no end-of-text token, so generation runs
    its whole length), float64, eval."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=THETA, eos_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(F64).eval()


def hf_ids(length: int, batch: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def swapped_equals_hf(model_fn, spec: str, ids: torch.Tensor, **tolerance) -> float:
    """``swap_encoding(model, spec)`` against the same weights with HF's own RoPE (sdpa): the max
    difference of the logits (asserted within ``tolerance``)."""
    import posenc.hf

    reference = model_fn()
    reference.set_attn_implementation("sdpa")
    swapped = posenc.hf.swap_encoding(model_fn(), spec)
    with torch.no_grad():
        want, got = reference(ids).logits, swapped(ids).logits
    torch.testing.assert_close(got, want, **(tolerance or EXACT))
    return max_diff(got, want)


def cached_generate_equals_full_pass(model, ids: torch.Tensor, new_tokens: int, **tolerance) -> float:
    """Greedy ``generate()`` (KV cache) picks each full pass's argmax, and its step logits equal the
    full pass's over the generated sequence; returns the largest logit difference."""
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        full = model(out.sequences).logits
    length = ids.shape[1]
    steps = torch.stack(out.logits, dim=1)  # the logits that chose tokens length .. length + new - 1
    want = full[:, length - 1 : length - 1 + new_tokens].to(steps.dtype)
    assert torch.equal(out.sequences[:, length:], want.argmax(-1))
    torch.testing.assert_close(steps, want, **(tolerance or {"rtol": 1e-5, "atol": 1e-6}))
    return max_diff(steps, want)


SMOL = "smollm2-135m"
SMOL_THETA = 100000.0


def smollm2():
    """SmolLM2-135M (float32, eval) and its tokenizer, or a skip naming the fetch command."""
    pytest.importorskip("transformers")
    from posenc.pretrained.loading import fetch_command, load, model_path

    try:
        model_path(SMOL)
    except FileNotFoundError as err:
        if os.environ.get("POSENC_REQUIRE_REAL") == "1":
            pytest.fail(f"POSENC_REQUIRE_REAL=1 but {err}")
        pytest.skip(f"{SMOL} is not fetched: run `{fetch_command([SMOL])}`")
    return load(SMOL)


SMOL_PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the"


def smollm2_checks(disabled: str, enabled: str) -> tuple[float, float]:
    """SmolLM2 swapped to ``disabled`` gives HF's logits on a short prompt; swapped to ``enabled``,
    cached greedy generation equals a full pass. Returns both max differences."""
    import posenc.hf

    model, tokenizer = smollm2()
    ids = tokenizer(SMOL_PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = model(ids).logits
    posenc.hf.swap_encoding(model, disabled)
    with torch.no_grad():
        got = model(ids).logits
    disabled_diff = max_diff(got, want)
    assert disabled_diff < 2e-4, disabled_diff  # float32 over 30 layers; HF eager vs sdpa differ as much
    posenc.hf.swap_encoding(model, enabled)
    enabled_diff = cached_generate_equals_full_pass(model, ids, 6, rtol=1e-4, atol=2e-4)
    return disabled_diff, enabled_diff
