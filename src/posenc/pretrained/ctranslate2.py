"""CTranslate2 model files: a reader of format version 6, and a Whisper one converted to an HF folder.

CTranslate2 (OpenNMT's inference engine) keeps a converted model as one binary file, ``model.bin``,
beside a ``config.json`` and the vocabulary. Format version 6, as :func:`read_ctranslate2` reads it
(little-endian throughout; a *string* is a ``uint16`` byte count, then the bytes, NUL-padded):

* ``uint32`` format version (6), the spec's name as a string (``WhisperSpec``), ``uint32`` spec revision;
* ``uint32`` variable count, then per variable: its name (a string, ``/``-separated:
  ``decoder/layer_0/self_attention/linear_0/weight``), ``uint8`` rank, that many ``uint32`` dims,
  ``uint8`` dtype code (0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16), ``uint32`` byte
  count and the bytes (row-major);
* ``uint32`` alias count and that many ``(alias, target)`` string pairs: a variable stored once under
  two names (Whisper's tied output projection, ``decoder/projection/weight`` ->
  ``decoder/embeddings/weight``).

:func:`convert_whisper` turns a Whisper model in this form (a folder holding ``model.bin``,
``config.json``, ``tokenizer.json`` and ``vocabulary.txt``: what the ``faster-whisper`` conversions
ship) into an HF ``WhisperForConditionalGeneration`` folder, in float32. CTranslate2 fuses the
projections: a self-attention's ``linear_0`` is ``[q; k; v]`` (``3C x C``), a cross-attention's
``linear_0`` is ``q`` and ``linear_1`` is ``[k; v]``; they are split back into HF's ``q_proj``,
``k_proj``, ``v_proj``. HF's ``k_proj`` has no bias: CTranslate2 stores zeros there, and any other
value would add ``q·b`` to every logit of a query alike, which the softmax removes, so it is dropped.
The encoder's positions are Whisper's fixed sinusoid stored as a table (``encoder/position_encodings/
encodings``, ``[1500, C]``: posenc's ``sinusoidal:layout=concat,step=whisper``, docs/conventions.md
§2.1), the decoder's a learned table (``decoder/position_encodings/encodings``, ``[448, C]``).

Needs ``transformers`` (and its ``tokenizers`` and ``safetensors``): ``pip install 'posenc[real]'``.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .catalog import OWNER_FILE, claim_scratch, remove_dead_scratch, replace_folder

__all__ = [
    "FORMAT_VERSION",
    "WHISPER_FILES",
    "WHISPER_SPEC",
    "CTranslate2File",
    "convert_whisper",
    "read_ctranslate2",
]

#: The CTranslate2 format version :func:`read_ctranslate2` reads.
FORMAT_VERSION = 6
#: The spec name of a Whisper model.
WHISPER_SPEC = "WhisperSpec"
#: The files :func:`convert_whisper` reads from its source folder.
WHISPER_FILES = ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")

#: CTranslate2's dtype codes (bfloat16, which numpy lacks, is widened to float32 exactly).
_DTYPES: dict[int, tuple[str, np.dtype]] = {
    0: ("float32", np.dtype("<f4")),
    1: ("int8", np.dtype("i1")),
    2: ("int16", np.dtype("<i2")),
    3: ("int32", np.dtype("<i4")),
    4: ("float16", np.dtype("<f2")),
    5: ("bfloat16", np.dtype("<u2")),
}

#: CTranslate2's ``ActivationType`` codes of the activations HF's Whisper can run.
_ACTIVATIONS = {3: "gelu"}


class CTranslate2File(NamedTuple):
    """What :func:`read_ctranslate2` returns (a tuple: ``spec, revision, variables, aliases``)."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str]


class _Cursor:
    """Reads the little-endian fields of ``data`` in order; a short read is a truncated-file error."""

    def __init__(self, data: bytearray, path: Path) -> None:
        self.data, self.path, self.offset = data, path, 0

    def take(self, count: int, what: str) -> int:
        """The offset of the next ``count`` bytes (``what`` they are, for the error), advanced past."""
        start, left = self.offset, len(self.data) - self.offset
        if count > left:
            raise ValueError(
                f"{self.path}: truncated CTranslate2 file: {what} needs {count} bytes at offset {start}, "
                f"but only {left} remain (the file has {len(self.data)} bytes); the download or the "
                "joining of its parts was cut short: fetch it again"
            )
        self.offset += count
        return start

    def unpack(self, fmt: str, what: str) -> int:
        start = self.take(struct.calcsize(fmt), what)
        return int(struct.unpack_from("<" + fmt, self.data, start)[0])

    def string(self, what: str) -> str:
        size = self.unpack("H", f"the length of {what}")
        start = self.take(size, what)
        raw = bytes(self.data[start : start + size]).rstrip(b"\0")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{self.path}: {what} at offset {start} is not UTF-8 text ({raw[:16]!r}...): the file is "
                "corrupt or not a CTranslate2 model"
            ) from err


def _check_header(path: Path, data: bytearray) -> None:
    """Refuse a file that is no CTranslate2 model, or one of another format version, by what it holds."""
    what = "a CTranslate2 model.bin starts with a little-endian uint32 format version, then the spec's name"
    if len(data) < 4:
        raise ValueError(f"{path}: not a CTranslate2 model file: it has {len(data)} bytes ({what})")
    version = struct.unpack_from("<I", data, 0)[0]
    if not 1 <= version < 100:
        raise ValueError(
            f"{path}: not a CTranslate2 model file: it starts with bytes {bytes(data[:8]).hex(' ')} "
            f"({what}; a GGUF starts with 'GGUF', a safetensors file with its header's length)"
        )
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path}: CTranslate2 format version {version}; posenc reads version {FORMAT_VERSION} "
            "(ctranslate2 3.x and 4.x write it: convert the model again with a current ct2-transformers-converter)"
        )


def read_ctranslate2(path: str | Path) -> CTranslate2File:
    """Read a CTranslate2 ``model.bin`` of format version 6 (the layout in this module's docstring).

    Returns:
        ``(spec, revision, variables, aliases)``: the spec's name (``"WhisperSpec"``), its revision,
        every variable by name as a numpy array of its stored dtype and shape (scalars have shape ``()``;
        bfloat16 comes back as float32, exactly), and the aliases (``alias -> target``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: naming the file: not a CTranslate2 model, a format version other than 6, a file cut
            short (with the offset and the bytes missing), an unknown dtype code, a variable whose byte
            count does not match its shape, an alias to a variable the file lacks, or bytes after the
            aliases.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a CTranslate2 model.bin)")
    data = bytearray(path.read_bytes())  # writable: the arrays are views of it
    _check_header(path, data)
    cursor = _Cursor(data, path)
    cursor.offset = 4
    spec = cursor.string("the spec name")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", spec):
        raise ValueError(
            f"{path}: not a CTranslate2 model file: the spec name after the version is {spec[:40]!r}, "
            "not an identifier such as 'WhisperSpec'"
        )
    revision = cursor.unpack("I", "the spec revision")
    count = cursor.unpack("I", "the variable count")
    variables: dict[str, np.ndarray] = {}
    for index in range(count):
        name = cursor.string(f"the name of variable {index}")
        rank = cursor.unpack("B", f"the rank of {name!r}")
        shape = tuple(cursor.unpack("I", f"dim {axis} of {name!r}") for axis in range(rank))
        code = cursor.unpack("B", f"the dtype of {name!r}")
        if code not in _DTYPES:
            raise ValueError(
                f"{path}: variable {name!r} has dtype code {code}; CTranslate2's codes are "
                + ", ".join(f"{c} {label}" for c, (label, _) in _DTYPES.items())
            )
        label, dtype = _DTYPES[code]
        size = cursor.unpack("I", f"the byte count of {name!r}")
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if size != expected:
            raise ValueError(
                f"{path}: variable {name!r} ({label}, shape {list(shape)}) states {size} bytes, but that "
                f"shape holds {expected}: the file is corrupt"
            )
        start = cursor.take(size, f"the data of {name!r} ({label}, shape {list(shape)})")
        array = np.frombuffer(data, dtype=dtype, count=size // dtype.itemsize, offset=start).reshape(shape)
        if label == "bfloat16":  # the high half of a float32: widen exactly
            array = (array.astype(np.uint32) << 16).view(np.float32)
        variables[name] = array
    aliases: dict[str, str] = {}
    for index in range(cursor.unpack("I", "the alias count")):
        alias = cursor.string(f"alias {index}")
        target = cursor.string(f"the target of alias {alias!r}")
        if target not in variables:
            raise ValueError(f"{path}: alias {alias!r} names {target!r}, which the file does not hold")
        aliases[alias] = target
    if cursor.offset != len(data):
        raise ValueError(
            f"{path}: {len(data) - cursor.offset} bytes follow the aliases, which end a CTranslate2 file at "
            f"offset {cursor.offset}: the file is corrupt (parts joined twice, or in the wrong order?)"
        )
    return CTranslate2File(spec, revision, variables, aliases)


# ----------------------------------------------------------------------------------------- Whisper


class _Variables:
    """A Whisper file's variables, aliases resolved; a missing one is an error naming the file."""

    def __init__(self, model: CTranslate2File, path: Path) -> None:
        self.model, self.path = model, path

    def __contains__(self, name: str) -> bool:
        return name in self.model.variables or name in self.model.aliases

    def __getitem__(self, name: str) -> np.ndarray:
        found = self.model.variables.get(self.model.aliases.get(name, name))
        if found is None:
            raise ValueError(
                f"{self.path}: no variable {name!r} in this {self.model.spec} (revision "
                f"{self.model.revision}); posenc reads the variables of ctranslate2's WhisperSpec revision 3"
            )
        return found

    def scalar(self, name: str) -> int:
        value = self[name]
        if value.shape != ():
            raise ValueError(f"{self.path}: {name!r} should be a scalar, has shape {list(value.shape)}")
        return int(value)

    def float32(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self[name], dtype=np.float32)

    def layers(self, stack: str) -> int:
        found = {
            int(m.group(1)) for n in self.model.variables if (m := re.match(rf"{stack}/layer_(\d+)/", n))
        }
        if not found or found != set(range(len(found))):
            raise ValueError(
                f"{self.path}: the {stack}'s layers are {sorted(found)}; expected {stack}/layer_0 ... layer_N"
            )
        return len(found)


def _vocabulary(path: Path) -> list[str]:
    """``vocabulary.txt``: one token a line, line ``i`` the token of id ``i``."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); a CTranslate2 vocabulary.txt is one "
            "UTF-8 token a line"
        ) from None
    return lines[:-1] if lines and lines[-1] == "" else lines


def _check_token_ids(values: Any, key: str, size: int, path: Path) -> None:
    """``config.json``'s ``key``: a list of whole token ids inside the vocabulary, else named."""
    bad = (
        [values]
        if not isinstance(values, list)
        else [v for v in values if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < size]
    )
    if bad:
        raise ValueError(
            f"{path}: {key} holds {bad[0]!r}; it must be a list of whole token ids in [0, {size}) (the "
            "vocabulary's size)"
        )


def _token_id(vocabulary: list[str], token: str, path: Path) -> int:
    try:
        return vocabulary.index(token)
    except ValueError:
        raise ValueError(f"{path}: no token {token!r} (a Whisper vocabulary holds it)") from None


def _whisper_config(
    variables: _Variables, ct2_config: dict[str, Any], vocabulary: list[str], folder: Path
) -> Any:
    """The HF ``WhisperConfig`` of a CTranslate2 Whisper: sizes from the tensors' shapes, special tokens
    from ``vocabulary.txt`` (the suppressed tokens go to the generation config)."""
    from transformers import WhisperConfig

    for name, want in (("decoder/pre_norm", 1), ("decoder/scale_embeddings", 0), ("decoder/alibi", 0)):
        if name in variables and variables.scalar(name) != want:
            raise ValueError(
                f"{folder / 'model.bin'}: {name} is {variables.scalar(name)}, Whisper's is {want}: "
                "this is not a Whisper model HF's WhisperForConditionalGeneration can hold"
            )
    activation = variables.scalar("decoder/activation") if "decoder/activation" in variables else 3
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"{folder / 'model.bin'}: decoder/activation is CTranslate2 activation {activation}; "
            "Whisper's is 3 (GELU), the one posenc converts"
        )
    for key in ("suppress_ids", "suppress_ids_begin", "lang_ids"):
        if key not in ct2_config:
            raise ValueError(
                f"{folder / 'config.json'}: no {key!r}; a CTranslate2 Whisper config.json lists "
                "lang_ids, suppress_ids and suppress_ids_begin"
            )
        _check_token_ids(ct2_config[key], key, len(vocabulary), folder / "config.json")
    embeddings = variables["decoder/embeddings/weight"]
    if len(vocabulary) != embeddings.shape[0]:
        raise ValueError(
            f"{folder / 'vocabulary.txt'}: {len(vocabulary)} tokens, but decoder/embeddings/weight has "
            f"{embeddings.shape[0]} rows: the vocabulary belongs to another model"
        )
    vocab = folder / "vocabulary.txt"
    end = _token_id(vocabulary, "<|endoftext|>", vocab)
    conv1 = variables["encoder/conv1/weight"]
    tied = variables.model.aliases.get("decoder/projection/weight") == "decoder/embeddings/weight"
    return WhisperConfig(
        vocab_size=embeddings.shape[0],
        num_mel_bins=conv1.shape[1],
        d_model=conv1.shape[0],
        encoder_layers=variables.layers("encoder"),
        decoder_layers=variables.layers("decoder"),
        encoder_attention_heads=variables.scalar("encoder/num_heads"),
        decoder_attention_heads=variables.scalar("decoder/num_heads"),
        encoder_ffn_dim=variables["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=variables["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=variables["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=variables["decoder/position_encodings/encodings"].shape[0],
        activation_function=_ACTIVATIONS[activation],
        scale_embedding=False,
        tie_word_embeddings=tied,
        decoder_start_token_id=_token_id(vocabulary, "<|startoftranscript|>", vocab),
        bos_token_id=end,
        eos_token_id=end,
        pad_token_id=end,
        # (the suppressed tokens belong to the generation config: in the model's, generate() warns)
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )


def _split_rows(array: np.ndarray, parts: int, name: str, path: Path) -> list[np.ndarray]:
    if array.shape[0] % parts:
        raise ValueError(f"{path}: {name!r} has {array.shape[0]} rows, not {parts} equal projections")
    return np.split(array, parts, axis=0)


def _whisper_state_dict(variables: _Variables, config: Any) -> dict[str, np.ndarray]:
    """The float32 weights of ``WhisperForConditionalGeneration`` by HF name, from CTranslate2's
    variables (fused projections split, the zero k bias dropped: module docstring)."""
    path = variables.path
    out: dict[str, np.ndarray] = {}

    def linear(hf: str, ct2: str, bias: bool = True) -> None:
        out[f"{hf}.weight"] = variables.float32(f"{ct2}/weight")
        if bias:
            out[f"{hf}.bias"] = variables.float32(f"{ct2}/bias")

    def norm(hf: str, ct2: str) -> None:
        out[f"{hf}.weight"] = variables.float32(f"{ct2}/gamma")
        out[f"{hf}.bias"] = variables.float32(f"{ct2}/beta")

    def projections(hf: str, names: tuple[str, ...], weight: np.ndarray, bias: np.ndarray, ct2: str) -> None:
        for part, w, b in zip(
            names,
            _split_rows(weight, len(names), f"{ct2}/weight", path),
            _split_rows(bias, len(names), f"{ct2}/bias", path),
            strict=True,
        ):
            out[f"{hf}.{part}.weight"] = np.ascontiguousarray(w)
            if part != "k_proj":  # HF's k_proj has no bias (CTranslate2 stores zeros: softmax-invariant)
                out[f"{hf}.{part}.bias"] = np.ascontiguousarray(b)

    def attention(hf: str, ct2: str, cross: bool) -> None:
        if cross:
            linear(f"{hf}.q_proj", f"{ct2}/linear_0")
            fused = f"{ct2}/linear_1"
            names: tuple[str, ...] = ("k_proj", "v_proj")
            linear(f"{hf}.out_proj", f"{ct2}/linear_2")
        else:
            fused = f"{ct2}/linear_0"
            names = ("q_proj", "k_proj", "v_proj")
            linear(f"{hf}.out_proj", f"{ct2}/linear_1")
        weight, bias = variables.float32(f"{fused}/weight"), variables.float32(f"{fused}/bias")
        projections(hf, names, weight, bias, fused)

    enc, dec = "model.encoder", "model.decoder"
    linear(f"{enc}.conv1", "encoder/conv1")
    linear(f"{enc}.conv2", "encoder/conv2")
    out[f"{enc}.embed_positions.weight"] = variables.float32("encoder/position_encodings/encodings")
    for i in range(config.encoder_layers):
        ct2, hf = f"encoder/layer_{i}", f"{enc}.layers.{i}"
        attention(f"{hf}.self_attn", f"{ct2}/self_attention", cross=False)
        norm(f"{hf}.self_attn_layer_norm", f"{ct2}/self_attention/layer_norm")
        linear(f"{hf}.fc1", f"{ct2}/ffn/linear_0")
        linear(f"{hf}.fc2", f"{ct2}/ffn/linear_1")
        norm(f"{hf}.final_layer_norm", f"{ct2}/ffn/layer_norm")
    norm(f"{enc}.layer_norm", "encoder/layer_norm")
    out[f"{dec}.embed_tokens.weight"] = variables.float32("decoder/embeddings/weight")
    out[f"{dec}.embed_positions.weight"] = variables.float32("decoder/position_encodings/encodings")
    for i in range(config.decoder_layers):
        ct2, hf = f"decoder/layer_{i}", f"{dec}.layers.{i}"
        attention(f"{hf}.self_attn", f"{ct2}/self_attention", cross=False)
        norm(f"{hf}.self_attn_layer_norm", f"{ct2}/self_attention/layer_norm")
        attention(f"{hf}.encoder_attn", f"{ct2}/attention", cross=True)
        norm(f"{hf}.encoder_attn_layer_norm", f"{ct2}/attention/layer_norm")
        linear(f"{hf}.fc1", f"{ct2}/ffn/linear_0")
        linear(f"{hf}.fc2", f"{ct2}/ffn/linear_1")
        norm(f"{hf}.final_layer_norm", f"{ct2}/ffn/layer_norm")
    norm(f"{dec}.layer_norm", "decoder/layer_norm")
    if config.tie_word_embeddings:
        out["proj_out.weight"] = out[f"{dec}.embed_tokens.weight"]
    else:
        out["proj_out.weight"] = variables.float32("decoder/projection/weight")
    return out


def _generation_config(config: Any, ct2_config: dict[str, Any], vocabulary: list[str], folder: Path) -> Any:
    """What HF's Whisper ``generate()`` reads: the language and task tokens, the no-timestamps token."""
    from transformers import GenerationConfig

    vocab = folder / "vocabulary.txt"
    languages = {vocabulary[int(i)]: int(i) for i in ct2_config["lang_ids"]}
    fields: dict[str, Any] = {
        "decoder_start_token_id": config.decoder_start_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "max_length": config.max_target_positions,
        "suppress_tokens": [int(i) for i in ct2_config["suppress_ids"]],
        "begin_suppress_tokens": [int(i) for i in ct2_config["suppress_ids_begin"]],
        "no_timestamps_token_id": _token_id(vocabulary, "<|notimestamps|>", vocab),
        "prev_sot_token_id": _token_id(vocabulary, "<|startofprev|>", vocab),
        "max_initial_timestamp_index": 50,  # Whisper's max_initial_timestamp, 1 s in 0.02 s steps
        "is_multilingual": bool(languages),
    }
    if languages:
        fields["lang_to_id"] = languages
        fields["task_to_id"] = {
            task: _token_id(vocabulary, f"<|{task}|>", vocab) for task in ("transcribe", "translate")
        }
    if ct2_config.get("alignment_heads"):
        fields["alignment_heads"] = [[int(a), int(b)] for a, b in ct2_config["alignment_heads"]]
    return GenerationConfig(**fields)


def _write_tokenizer(folder: Path, vocabulary: list[str], config: Any, into: Path) -> None:
    """``tokenizer.json`` (CTranslate2's, with the tokens ``vocabulary.txt`` adds after it: the
    timestamps ``<|0.00|>`` ... ``<|30.00|>``) and a ``tokenizer_config.json`` naming HF's
    ``WhisperTokenizer``, so ``AutoTokenizer`` loads every id the model emits."""
    from tokenizers import AddedToken, Tokenizer

    source = folder / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(source))
        specials = [
            t["content"]
            for t in json.loads(source.read_text(encoding="utf-8"))["added_tokens"]
            if t["special"]
        ]
    except Exception as err:  # the tokenizers library's own error type is not public
        raise ValueError(f"{source}: not a tokenizers tokenizer.json ({type(err).__name__}: {err})") from err
    known = tokenizer.get_vocab_size(with_added_tokens=True)
    mismatched = [i for i in range(min(known, len(vocabulary))) if tokenizer.id_to_token(i) != vocabulary[i]]
    if known > len(vocabulary) or mismatched:
        first = mismatched[0] if mismatched else len(vocabulary)
        raise ValueError(
            f"{source} and {folder / 'vocabulary.txt'} disagree at id {first} ({tokenizer.id_to_token(first)!r} "
            f"against {vocabulary[first] if first < len(vocabulary) else 'nothing'!r}): they belong to different models"
        )
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token in vocabulary[known:]])
    tokenizer.save(str(into / "tokenizer.json"))
    end = vocabulary[config.eos_token_id]
    settings = {
        "tokenizer_class": "WhisperTokenizer",
        "bos_token": end,
        "eos_token": end,
        "unk_token": end,
        "pad_token": end,
        "additional_special_tokens": specials,
        "model_max_length": config.max_target_positions,
        "clean_up_tokenization_spaces": False,
    }
    (into / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def _save_model(config: Any, weights: dict[str, np.ndarray], into: Path) -> None:
    """``config.json`` and ``model.safetensors`` (float32), loaded into HF's class first so a name or
    a shape that does not fit fails here, naming it."""
    import torch
    from transformers import WhisperForConditionalGeneration

    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    tensors = {name: torch.from_numpy(array) for name, array in weights.items()}
    if config.tie_word_embeddings:
        tensors["proj_out.weight"] = tensors["model.decoder.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if missing or unexpected:  # (a converter bug or an HF change: named, never saved half-filled)
        raise ValueError(
            f"the converted weights do not fit HF's WhisperForConditionalGeneration: missing {missing}, "
            f"unexpected {unexpected}"
        )
    if config.tie_word_embeddings:
        model.proj_out.weight = model.model.decoder.embed_tokens.weight
    model.save_pretrained(into, safe_serialization=True)


def _read_source(source: Path) -> tuple[CTranslate2File, dict[str, Any], list[str]]:
    missing = [name for name in WHISPER_FILES if not (source / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{source}: no {', '.join(missing)} in the folder; a CTranslate2 Whisper folder holds "
            f"{', '.join(WHISPER_FILES)} (a faster-whisper model's files, model.bin joined from its parts)"
        )
    model = read_ctranslate2(source / "model.bin")
    if model.spec != WHISPER_SPEC:
        raise ValueError(
            f"{source / 'model.bin'}: a CTranslate2 {model.spec} (revision {model.revision}); "
            f"convert_whisper reads a {WHISPER_SPEC}"
        )
    try:
        ct2_config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{source / 'config.json'}: not JSON ({err})") from err
    if not isinstance(ct2_config, dict):
        raise ValueError(f"{source / 'config.json'}: a JSON {type(ct2_config).__name__}, not an object")
    return model, ct2_config, _vocabulary(source / "vocabulary.txt")


def convert_whisper(source: str | Path, out: str | Path, *, log: Callable[[str], Any] | None = None) -> None:
    """Convert the CTranslate2 Whisper in the folder ``source`` to an HF folder ``out``, atomically.

    Args:
        source: a folder holding :data:`WHISPER_FILES` (``model.bin``, ``config.json``,
            ``tokenizer.json``, ``vocabulary.txt``).
        out: the HF folder to write: ``config.json``, ``model.safetensors`` (float32),
            ``generation_config.json`` (the language, task and no-timestamps tokens ``generate()``
            needs), ``tokenizer.json`` and ``tokenizer_config.json`` (``AutoTokenizer`` loads HF's
            ``WhisperTokenizer``) and ``preprocessor_config.json`` (``WhisperFeatureExtractor``).
            Everything is written into a temporary folder beside ``out`` and renamed to it only once
            complete; an ``out`` already there is replaced whole, and is left as it was if anything fails.
        log: called with a line of progress, or None.

    Raises:
        FileNotFoundError: a file of :data:`WHISPER_FILES` is missing (all the missing ones named).
        ValueError: naming the file at fault: ``model.bin`` not a CTranslate2 file of format version 6,
            truncated, or of a spec other than ``WhisperSpec``; a variable missing; ``config.json``,
            ``tokenizer.json`` or ``vocabulary.txt`` not matching the model.
    """
    from transformers import WhisperFeatureExtractor

    say = log or (lambda line: None)
    source, out = Path(source), Path(out)
    start = time.perf_counter()
    say(f"whisper: reading {source / 'model.bin'}")
    model, ct2_config, vocabulary = _read_source(source)
    variables = _Variables(model, source / "model.bin")
    config = _whisper_config(variables, ct2_config, vocabulary, source)
    weights = _whisper_state_dict(variables, config)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_scratch(out.parent, f".{out.name}-", say)
    scratch = claim_scratch(Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent)))
    try:
        _save_model(config, weights, scratch)
        _generation_config(config, ct2_config, vocabulary, source).save_pretrained(scratch)
        _write_tokenizer(source, vocabulary, config, scratch)
        hop, rate = 160, 16000  # Whisper's STFT hop and sampling rate: 100 frames a second
        WhisperFeatureExtractor(
            feature_size=config.num_mel_bins,
            chunk_length=config.max_source_positions * 2 * hop // rate,
        ).save_pretrained(scratch)
        (scratch / OWNER_FILE).unlink()  # the folder is the model's now, not a run's scratch
        replace_folder(scratch, out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    say(f"whisper: converted in {time.perf_counter() - start:.1f} s -> {out}")
