"""The model ``posenc inspect`` reads: :func:`read_model` resolves ``MODEL`` once into a
:class:`ModelView` (its HF config and a lazy reader of its weights), and refuses bad input with an
:class:`InspectError` naming the file at fault and what was expected.

``MODEL`` is one of

* a fetched model's name (``posenc models list``): its converted HF folder
  (:func:`posenc.pretrained.loading.convert`);
* an HF folder: ``config.json`` and the weights (``model.safetensors``, a sharded index, or
  ``pytorch_model.bin``), read tensor by tensor without building the model;
* a GGUF file: its config from the file's metadata, its weights dequantized by HF's GGUF loader.

The sections that need the model run (RoPE's queries and keys) call :meth:`ModelView.module` and
:meth:`ModelView.token_ids`; the rest read only the tensors they name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...pretrained.loading import MODELS, WEIGHT_FILES, convert, reference_text

__all__ = ["InspectError", "ModelView", "Weights", "read_model"]

#: What ``MODEL`` may be, said in every error about it.
EXPECTED = (
    "a fetched model's name (posenc models list), an HF folder (config.json and its weights) or a GGUF file"
)

#: The first four bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"


class InspectError(ValueError):
    """``MODEL`` is not something ``posenc inspect`` can read (the command exits with status 2)."""


class Weights:
    """The tensors of a checkpoint by name, read on demand: ``names``, :meth:`shape`, :meth:`tensor`.

    Args:
        shapes: every tensor's name and shape.
        read: returns the tensor of a name (as stored; callers convert).
        where: the file(s) they come from, for messages.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str], Tensor], where: str) -> None:
        self.shapes = shapes
        self._read = read
        self.where = where

    @property
    def names(self) -> list[str]:
        return list(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def tensor(self, name: str) -> Tensor:
        """The tensor ``name``, as float32 on the CPU."""
        return self._read(name).float()

    def ending(self, *suffixes: str) -> list[str]:
        """The names ending in one of ``suffixes`` (after a ``.`` or as the whole name), in file order."""
        return [n for n in self.shapes if any(n == s or n.endswith("." + s) for s in suffixes)]


@dataclass
class ModelView:
    """One model as ``posenc inspect`` reads it.

    Attributes:
        label: what it is called on the page (the fetched name, the folder's or the file's name).
        path: the HF folder or the GGUF file read.
        config: its HF config (``transformers.PretrainedConfig``).
        weights: its tensors (:class:`Weights`).
        source: ``"hf folder"`` or ``"gguf"``.
    """

    label: str
    path: Path
    config: Any
    weights: Weights
    source: str
    _module: nn.Module | None = field(default=None, repr=False)

    def module(self) -> nn.Module:
        """The model built by HF (``AutoModel``, float32, eval mode), loaded once."""
        if self._module is None:
            self._module = _load_module(self.path)
        return self._module

    def token_ids(self, count: int) -> tuple[Tensor, str]:
        """``(ids [1, count], how)``: the first ``count`` tokens of
        :func:`~posenc.pretrained.loading.reference_text` by the model's own tokenizer (special tokens
        added as it adds them); without a tokenizer, the text's UTF-8 bytes modulo the vocabulary."""
        text = reference_text()[: 16 * count]
        tokenizer = _tokenizer(self.path)
        vocab = int(self.config.get_text_config().vocab_size)
        if tokenizer is None:
            ids = [byte % vocab for byte in text.encode("utf-8")[:count]]
            how = f"no tokenizer in {self.path}: the reference text's UTF-8 bytes modulo the vocabulary ({vocab})"
        else:
            ids = list(tokenizer(text)["input_ids"])[:count]
            how = f"Python's language reference, tokenized by the model's {type(tokenizer).__name__}"
        return torch.tensor(ids, dtype=torch.long)[None], how


def read_model(model: str | Path, *, log: Callable[[str], None] | None = None) -> ModelView:
    """The :class:`ModelView` of ``model`` (see the module docstring); :class:`InspectError` for input
    that is no model posenc can read, ``FileNotFoundError`` for a fetched model's name whose file is
    not fetched (with the command that fetches it). ``log`` gets a fetched model's conversion lines
    (its first use converts a GGUF or CTranslate2 file: minutes)."""
    if str(model) in MODELS:
        folder = convert(str(model), log=log)
        return _read_folder(folder, str(model))
    path = Path(model)
    if not path.exists():
        raise InspectError(
            f"model {model}: no such file or folder, and no fetched model of that name ({', '.join(MODELS)}); "
            f"expected {EXPECTED}"
        )
    if path.is_dir():
        return _read_folder(path, _label(path))
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise InspectError(
            f"{path}: not a model: a file must be a GGUF file, and this one does not start with GGUF's "
            f"magic bytes; expected {EXPECTED}"
        )
    return _read_gguf(path)


# ---------------------------------------------------------------------------- an HF folder

#: Folder names that say nothing of the model: the page names their parent too (``minilm/model``).
GENERIC_NAMES = frozenset({"model", "models", "hf", "checkpoint", "weights", "final", "latest"})


def _label(folder: Path) -> str:
    resolved = folder.resolve()
    if resolved.name.lower() in GENERIC_NAMES and resolved.parent.name:
        return f"{resolved.parent.name}/{resolved.name}"
    return resolved.name


def _read_folder(folder: Path, label: str) -> ModelView:
    config = _folder_config(folder)
    return ModelView(label, folder, config, _folder_weights(folder), "hf folder")


def _folder_config(folder: Path) -> Any:
    """The folder's HF config, each way it can be wrong refused by name."""
    from transformers import AutoConfig

    path = folder / "config.json"
    if not path.is_file():
        raise InspectError(
            f"{folder}: no config.json in the folder; expected an HF model folder (config.json and the "
            "weights, as save_pretrained writes them)"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InspectError(
            f"{path}: not readable JSON ({err}); expected the HF config save_pretrained writes"
        ) from err
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise InspectError(
            f"{path}: names no model_type; expected an HF config (save_pretrained writes model_type)"
        )
    _check_fields(path, raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as err:  # HF's validators raise their own types (ZeroDivisionError, StrictDataclass...)
        if raw["model_type"] in CONFIG_MAPPING:
            raise InspectError(
                f"{path}: transformers {_transformers_version()} refuses this {raw['model_type']} config "
                f"({type(err).__name__}: {err}); fix the field it names"
            ) from err
        raise InspectError(
            f"{path}: model_type {raw['model_type']!r} is an architecture transformers "
            f"{_transformers_version()} does not know, so posenc inspect cannot read it ({err})"
        ) from err


def _check_fields(path: Path, raw: dict[str, Any]) -> None:
    """The fields ``posenc inspect`` reads, checked by name before HF reads them (HF answers some with
    a bare ``ZeroDivisionError``, and takes an unknown ``rope_type`` or a context of 0 in silence)."""
    heads, width = raw.get("num_attention_heads"), raw.get("hidden_size")
    if heads is not None and (not isinstance(heads, int) or heads < 1):
        raise InspectError(f"{path}: num_attention_heads {heads!r}: a model needs at least 1 attention head")
    if isinstance(heads, int) and isinstance(width, int) and not raw.get("head_dim") and width % heads:
        raise InspectError(
            f"{path}: hidden_size {width} is not a multiple of num_attention_heads {heads} (and no head_dim "
            "is given): the heads cannot split the width"
        )
    context = raw.get("max_position_embeddings")
    if context is not None and (not isinstance(context, int) or context < 1):
        raise InspectError(
            f"{path}: max_position_embeddings {context!r}: a context below 1 position; give the training context"
        )
    _check_rope_types(path, raw.get("rope_parameters") or raw.get("rope_scaling"))


def _check_rope_types(path: Path, parameters: Any) -> None:
    """Each ``rope_type`` of ``rope_parameters`` (flat or per layer type) one HF knows."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not isinstance(parameters, dict):
        return
    nested = all(isinstance(v, dict) or v is None for v in parameters.values()) and parameters
    for where, entry in parameters.items() if nested else [("", parameters)]:
        if not isinstance(entry, dict):
            continue
        kind = entry.get("rope_type", entry.get("type", "default"))
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            field = f"rope_parameters[{where!r}].rope_type" if where else "rope_parameters.rope_type"
            raise InspectError(
                f"{path}: {field} {kind!r} is no RoPE type transformers {_transformers_version()} knows "
                f"({', '.join(['default', *ROPE_INIT_FUNCTIONS])})"
            )


def _folder_weights(folder: Path) -> Weights:
    """The weights of ``folder``: the first of :data:`WEIGHT_FILES` there."""
    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        raise InspectError(
            f"{folder}: a config.json but no weights: none of {', '.join(WEIGHT_FILES)} is in the folder "
            "(save the model with save_pretrained, or copy its weight files there)"
        )
    name = present[0]
    path = folder / name
    try:
        if name.endswith(".index.json"):
            return _sharded_weights(path)
        if name.endswith(".safetensors"):
            return _safetensors_weights({None: path})
        return _bin_weights(path)
    except InspectError:
        raise
    except Exception as err:  # a torn or foreign file: safetensors, torch and json raise their own kinds
        raise InspectError(f"{path}: the weights cannot be read ({type(err).__name__}: {err})") from err


def _safetensors_weights(files: dict[str | None, Path], owner: dict[str, Path] | None = None) -> Weights:
    """Weights from one safetensors file (``files[None]``) or shards (``owner`` maps each name to its file)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    paths = sorted(set(files.values()))
    for path in paths:
        with safe_open(str(path), framework="pt") as handle:
            for key in list(handle.keys()):  # safe_open is not iterable
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    where = {key: (owner or {}).get(key, paths[0]) for key in shapes}

    def read(key: str) -> Tensor:
        with safe_open(str(where[key]), framework="pt") as handle:
            return handle.get_tensor(key)

    return Weights(shapes, read, ", ".join(str(p) for p in paths))


def _sharded_weights(index: Path) -> Weights:
    weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    owner = {key: index.parent / file for key, file in weight_map.items()}
    if str(index).endswith(".safetensors.index.json"):
        return _safetensors_weights({str(p): p for p in owner.values()}, owner)
    tensors: dict[str, Tensor] = {}
    for path in sorted(set(owner.values())):
        tensors.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    return _dict_weights(tensors, str(index))


def _bin_weights(path: Path) -> Weights:
    return _dict_weights(torch.load(path, map_location="cpu", weights_only=True, mmap=True), str(path))


def _dict_weights(tensors: dict[str, Tensor], where: str) -> Weights:
    return Weights({k: tuple(v.shape) for k, v in tensors.items()}, tensors.__getitem__, where)


# ---------------------------------------------------------------------------- a GGUF file


def _read_gguf(path: Path) -> ModelView:
    """Config and weights of a GGUF file (HF dequantizes the weights; the model stays loaded)."""
    from transformers import AutoConfig

    from ...pretrained.loading import _unsupported_gguf

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as err:
        if "not supported" in str(err):
            raise InspectError(
                _unsupported_gguf(path) + "; posenc inspect reads what transformers loads"
            ) from err
        raise InspectError(f"{path}: a GGUF file whose metadata cannot be read ({err})") from err
    except Exception as err:  # a torn file: gguf's reader raises what numpy raises
        raise InspectError(
            f"{path}: a GGUF file whose metadata cannot be read ({type(err).__name__}: {err})"
        ) from err
    module = _load_module(path)
    state = {name: tensor.detach() for name, tensor in module.state_dict().items()}
    view = ModelView(path.stem, path, config, _dict_weights(state, str(path)), "gguf")
    view._module = module
    return view


# ---------------------------------------------------------------------------- HF's loaders


def _where(path: Path) -> dict[str, str]:
    if path.is_file():
        return {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    return {"pretrained_model_name_or_path": str(path)}


def _load_module(path: Path) -> nn.Module:
    """HF's ``AutoModel`` (the bare model, no head) of the folder or GGUF ``path``, float32, eval."""
    from transformers import AutoModel
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # a causal LM's head weights are unused by the bare model: said, not an error
    logging.disable_progress_bar()
    try:
        return AutoModel.from_pretrained(**_where(path), dtype=torch.float32).eval()
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


#: The files one of which an HF folder's tokenizer is saved in (HF builds an empty tokenizer without them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model")


def _tokenizer(path: Path) -> Any:
    """The model's tokenizer (a GGUF file's own vocabulary), or None when the folder holds none."""
    from transformers import AutoTokenizer

    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(**_where(path))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)
