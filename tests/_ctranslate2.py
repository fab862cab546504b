"""CTranslate2 files made in tmp for the reader and converter tests (tests/pretrained/test_ctranslate2.py,
tests/hf/test_whisper.py): a writer of format version 6, written here from the format's description
(not from posenc's reader), a tiny random HF Whisper put into CTranslate2's form as ctranslate2's
Whisper converter does (fused ``[q; k; v]`` and ``[k; v]`` projections, a zero k bias, the output
projection an alias of the embeddings), and the side files of a faster-whisper folder."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

#: dtype codes of CTranslate2's format (``bfloat16`` is written from float32 by dropping its low half).
CODES = {"float32": 0, "int8": 1, "int16": 2, "int32": 3, "float16": 4, "bfloat16": 5}
_NUMPY = {"float32": "<f4", "int8": "i1", "int16": "<i2", "int32": "<i4", "float16": "<f2"}


def _string(text: str, pad: int = 1) -> bytes:
    raw = text.encode() + b"\0" * pad  # ctranslate2 writes a NUL after each string
    return struct.pack("<H", len(raw)) + raw


def ct2_bytes(
    variables: dict[str, tuple[str, np.ndarray]],
    aliases: dict[str, str] | None = None,
    *,
    spec: str = "WhisperSpec",
    revision: int = 3,
    version: int = 6,
) -> bytes:
    """A model.bin: ``variables`` maps a name to ``(dtype name, array)``."""
    out = [
        struct.pack("<I", version),
        _string(spec),
        struct.pack("<I", revision),
        struct.pack("<I", len(variables)),
    ]
    for name, (dtype, array) in variables.items():
        array = np.asarray(array)
        if dtype == "bfloat16":
            raw = (np.ascontiguousarray(array, dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes()
        else:
            raw = np.ascontiguousarray(array, dtype=_NUMPY[dtype]).tobytes()
        out.append(_string(name) + struct.pack("<B", array.ndim))
        out.append(b"".join(struct.pack("<I", d) for d in array.shape))
        out.append(struct.pack("<B", CODES[dtype]) + struct.pack("<I", len(raw)) + raw)
    aliases = aliases or {}
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        out.append(_string(alias) + _string(target))
    return b"".join(out)


def tiny_whisper(seed: int = 0, vocab: int | None = None, weight_std: float | None = None):
    """A tiny random HF Whisper (2 + 2 layers, width 32, 4 heads, 8 mel bins, 12 source and 16 target
    positions), float32, eval mode; biases drawn at random so no split can hide behind zeros.
    ``weight_std``: the weight matrices drawn from ``N(0, weight_std²)`` instead of HF's init (1.0 makes
    greedy decoding pick varied tokens rather than one token repeated)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.WhisperConfig(
        vocab_size=len(tiny_vocabulary()) if vocab is None else vocab,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=40,
        max_source_positions=12,
        max_target_positions=16,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        suppress_tokens=[],
        begin_suppress_tokens=[],
    )
    model = transformers.WhisperForConditionalGeneration(config).eval()
    # Seeded again after construction: HF's own init draws a different amount from the generator in
    # different releases (5.15 against 5.24), and the draws below must not depend on it.
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                parameter.normal_(0, 0.5)
            elif weight_std is not None and parameter.dim() >= 2:
                parameter.normal_(0, weight_std)
        # Whisper's encoder table is its fixed sinusoid; a random one here tells the tables apart.
        model.model.encoder.embed_positions.weight.normal_(0, 1)
    return model


def whisper_variables(
    model, dtype: str = "float32"
) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str]]:
    """``model`` (an HF Whisper) in CTranslate2's names and fused layout, weights stored as ``dtype``."""
    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    config = model.config
    out: dict[str, tuple[str, np.ndarray]] = {}

    def put(name: str, array: np.ndarray) -> None:
        out[name] = (dtype, array)

    def linear(ct2: str, hf: str) -> None:
        put(f"{ct2}/weight", state[f"{hf}.weight"])
        put(f"{ct2}/bias", state[f"{hf}.bias"])

    def norm(ct2: str, hf: str) -> None:
        put(f"{ct2}/gamma", state[f"{hf}.weight"])
        put(f"{ct2}/beta", state[f"{hf}.bias"])

    def fused(ct2: str, hf: str, parts: list[str]) -> None:
        weights = [state[f"{hf}.{p}.weight"] for p in parts]
        biases = [state.get(f"{hf}.{p}.bias", np.zeros(weights[0].shape[0], np.float32)) for p in parts]
        put(f"{ct2}/weight", np.concatenate(weights, 0))
        put(f"{ct2}/bias", np.concatenate(biases, 0))

    out["encoder/num_heads"] = ("int16", np.array(config.encoder_attention_heads))
    linear("encoder/conv1", "model.encoder.conv1")
    linear("encoder/conv2", "model.encoder.conv2")
    put("encoder/position_encodings/encodings", state["model.encoder.embed_positions.weight"])
    for i in range(config.encoder_layers):
        ct2, hf = f"encoder/layer_{i}", f"model.encoder.layers.{i}"
        fused(f"{ct2}/self_attention/linear_0", f"{hf}.self_attn", ["q_proj", "k_proj", "v_proj"])
        linear(f"{ct2}/self_attention/linear_1", f"{hf}.self_attn.out_proj")
        norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1")
        linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2")
        norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")
    norm("encoder/layer_norm", "model.encoder.layer_norm")
    out["decoder/num_heads"] = ("int16", np.array(config.decoder_attention_heads))
    out["decoder/activation"] = ("int8", np.array(3))  # GELU
    out["decoder/pre_norm"] = ("int8", np.array(1))
    out["decoder/scale_embeddings"] = ("int8", np.array(0))
    out["decoder/alibi"] = ("int8", np.array(0))
    put("decoder/embeddings/weight", state["model.decoder.embed_tokens.weight"])
    put("decoder/position_encodings/encodings", state["model.decoder.embed_positions.weight"])
    for i in range(config.decoder_layers):
        ct2, hf = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        fused(f"{ct2}/self_attention/linear_0", f"{hf}.self_attn", ["q_proj", "k_proj", "v_proj"])
        linear(f"{ct2}/self_attention/linear_1", f"{hf}.self_attn.out_proj")
        norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        linear(f"{ct2}/attention/linear_0", f"{hf}.encoder_attn.q_proj")
        fused(f"{ct2}/attention/linear_1", f"{hf}.encoder_attn", ["k_proj", "v_proj"])
        linear(f"{ct2}/attention/linear_2", f"{hf}.encoder_attn.out_proj")
        norm(f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
        linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1")
        linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2")
        norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")
    norm("decoder/layer_norm", "model.decoder.layer_norm")
    return out, {"decoder/projection/weight": "decoder/embeddings/weight"}


#: The special tokens of a multilingual Whisper vocabulary, in Whisper's order (two languages here).
SPECIALS = [
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|en|>",
    "<|de|>",
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nocaptions|>",
    "<|notimestamps|>",
]
#: What vocabulary.txt adds after tokenizer.json's tokens (Whisper's timestamps).
TIMESTAMPS = ["<|0.00|>", "<|0.02|>", "<|0.04|>"]
#: The byte-level BPE part: single characters (Ġ is a space) and three merges.
_BPE = ["a", "b", "c", "d", "e", "h", "l", "o", "r", "w", "Ġ", "he", "ll", "Ġw"]


def tiny_vocabulary() -> list[str]:
    return [*_BPE, *SPECIALS, *TIMESTAMPS]


def write_side_files(folder: Path, *, lang_ids: list[int] | None = None) -> None:
    """config.json, tokenizer.json and vocabulary.txt of the tiny vocabulary, as faster-whisper ships them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = tiny_vocabulary()
    bpe = {token: i for i, token in enumerate(_BPE)}
    tokenizer = Tokenizer(models.BPE(bpe, [("h", "e"), ("l", "l"), ("Ġ", "w")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "vocabulary.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    en, de = vocab.index("<|en|>"), vocab.index("<|de|>")
    config = {
        "alignment_heads": [[1, 0], [1, 3]],
        "lang_ids": [en, de] if lang_ids is None else lang_ids,
        "suppress_ids": [2, 5],
        "suppress_ids_begin": [10, vocab.index("<|endoftext|>")],
    }
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")


def write_whisper_folder(folder: Path, model, dtype: str = "float32") -> Path:
    """A faster-whisper folder of ``model``: model.bin and the side files."""
    write_side_files(folder)
    variables, aliases = whisper_variables(model, dtype)
    (folder / "model.bin").write_bytes(ct2_bytes(variables, aliases))
    return folder
