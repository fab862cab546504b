"""Tiny random HF models for the bridge's tests (nothing downloaded): Llama, Mistral (a sliding window
shorter than the sequence), Qwen2, gpt-oss (sinks, alternating layers), Gemma 3 (local and global layers),
registered with posenc's attention; their inputs (left padding), a run under an attn_implementation, and
swapped models."""

from __future__ import annotations

import pytest
import torch

import posenc.hf as posenc_hf

transformers = pytest.importorskip("transformers")


VOCAB, LEN = 50, 19


def _llama(**kw):
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, **kw,
        )
    )  # fmt: skip


def _mistral():  # a sliding window shorter than the sequence
    return transformers.MistralForCausalLM(
        transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=128, sliding_window=6,
        )
    )  # fmt: skip


def _qwen2():
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128,
        )
    )  # fmt: skip


def _gpt_oss():  # attention sinks (s_aux) and alternating sliding / full layers
    return transformers.GptOssForCausalLM(
        transformers.GptOssConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
            max_position_embeddings=128, layer_types=["sliding_attention", "full_attention"],
        )
    )  # fmt: skip


def _gemma3():  # local (sliding) and global layers
    return transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
        )
    )  # fmt: skip


MODELS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "gpt_oss": _gpt_oss, "gemma3": _gemma3}


#: name: (HF implementation to compare with, dtype, tolerance)
EXACT = {"rtol": 1e-9, "atol": 1e-9}


REFERENCE = {name: ("sdpa", torch.float64, EXACT) for name in MODELS}


REFERENCE["gpt_oss"] = ("eager", torch.float32, {"rtol": 1e-4, "atol": 1e-5})


def _model(name: str, dtype=None):
    dtype = dtype or REFERENCE[name][1]
    torch.manual_seed(0)
    model = MODELS[name]().to(dtype)
    with torch.no_grad():  # gpt-oss initialises its sinks to zero: give them values that matter
        for param_name, param in model.named_parameters():
            if param_name.endswith("sinks"):
                param.normal_(0.0, 1.0)
    return model.eval()


def _inputs():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, LEN), generator=generator)
    mask = torch.ones(2, LEN, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    return ids, mask


def _run(model, impl: str, ids, mask, grads: bool = False):
    model.set_attn_implementation(impl)
    model.zero_grad()
    logits = model(ids, attention_mask=mask).logits
    real = mask.bool()
    if not grads:
        return logits.detach()[real], []
    (logits[real] * torch.linspace(-1, 1, logits[real].numel()).view_as(logits[real])).sum().backward()
    return logits.detach()[real], [p.grad.clone() for p in model.parameters() if p.grad is not None]


# ---------------------------------------------------------------------------- swap_encoding, set_rope_scaling
def _logits(model, ids, mask):
    return model(ids, attention_mask=mask).logits.detach()[mask.bool()]


def _swapped(name: str, spec: str, seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[name]().to(torch.float64).eval()
    return posenc_hf.swap_encoding(model, spec)
