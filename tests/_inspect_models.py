"""Tiny random HF models saved to folders, one per family ``posenc inspect`` reads (the tests of
``tests/viz/test_inspection.py`` and ``tests/cli/test_inspection.py``): BERT and MPNet (learned
tables; MPNet's bucketed bias), a Llama with a tokenizer (RoPE, GQA), a Gemma 3 with sliding and
global layers (RoPE per layer type, q/k norms before rotation), a Whisper (a fixed sinusoid in the
encoder, a learned table in the decoder) and a T5 (bucketed bias per stack). Seed 0 throughout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from _tiny_hf import byte_level_tokenizer

#: Special token ids inside every tiny vocabulary (HF's defaults point past it).
SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _save(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def bert(path: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40,
    )  # fmt: skip
    return _save(transformers.BertModel(config), path)


def mpnet(path: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MPNetConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=42, **SPECIAL,  # 32 buckets: HF's MPNet forward buckets with 32 whatever the config says
    )  # fmt: skip
    model = transformers.MPNetModel(config)
    with torch.no_grad():  # HF initialises the bias near zero: give every head a shape of its own
        model.encoder.relative_attention_bias.weight.normal_(0, 1)
    return _save(model, path)


def llama(path: Path) -> Path:
    """Three layers, 4 query heads and 2 kv heads of 8, RoPE theta 500, a 300-token tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=96, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        **SPECIAL,
    )  # fmt: skip
    _save(transformers.LlamaForCausalLM(config), path)
    byte_level_tokenizer(300).save_pretrained(path)
    return path


#: The tiny Gemma 3's layer types and window.
GEMMA_TYPES = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
]
GEMMA_WINDOW = 8


def gemma3(path: Path) -> Path:
    """Five layers (sliding, sliding, full, sliding, full), window 8, theta 1e4 local and 1e6 global,
    4 query heads and 2 kv heads of 16, no tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=GEMMA_WINDOW, max_position_embeddings=64,
        layer_types=GEMMA_TYPES,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        **SPECIAL,
    )  # fmt: skip
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():  # HF initialises the q/k norms at zero (a scale of 1): make them count
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(0, 0.5)
            layer.self_attn.k_norm.weight.normal_(0, 0.5)
    return _save(model, path)


def whisper(path: Path) -> Path:
    """Two encoder and two decoder layers of width 32, 30 source and 20 target positions."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=30,
        max_target_positions=20, num_mel_bins=8, decoder_start_token_id=1, **SPECIAL,
    )  # fmt: skip
    return _save(transformers.WhisperForConditionalGeneration(config), path)


def t5(path: Path) -> Path:
    """Two layers per stack, 4 heads of 8, 8 buckets, max distance 20."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=20, decoder_start_token_id=0,
    )  # fmt: skip
    model = transformers.T5Model(config)
    with torch.no_grad():
        for stack in (model.encoder, model.decoder):
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 1)
    return _save(model, path)


#: Every tiny model by the name the tests use.
BUILDERS = {"bert": bert, "mpnet": mpnet, "llama": llama, "gemma3": gemma3, "whisper": whisper, "t5": t5}


# ---------------------------------------------------------------------------- independent references


def raw_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return {k: v.astype(np.float64) for k, v in load_file(path / "model.safetensors").items()}


def numpy_cosine(table: np.ndarray) -> np.ndarray:
    unit = table / np.linalg.norm(table, axis=1, keepdims=True)
    return unit @ unit.T


def pair_means(x: np.ndarray) -> np.ndarray:
    """Mean over tokens of each half-split pair's norm of ``x`` ``[T, H, D]``: ``[H, D/2]``."""
    half = x.shape[-1] // 2
    return np.hypot(x[..., :half], x[..., half:]).mean(axis=0)


def layer_inputs(model_class, path: Path, ids: torch.Tensor) -> tuple[object, list[np.ndarray]]:
    """The HF model and the input of each decoder layer after its input norm, ``[T, hidden]``."""
    model = model_class.from_pretrained(path).eval()
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        normed = [
            layer.input_layernorm(states[i])[0].double().numpy() for i, layer in enumerate(model.model.layers)
        ]
    return model, normed


def gemma_rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Gemma's RMSNorm written out: ``x / sqrt(mean(x²) + eps) · (1 + w)`` over the last axis."""
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * (1 + weight)
