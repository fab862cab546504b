"""Loading a trained checkpoint (posenc.pretrained.loading): the reference text, and a GGUF of an
architecture HF cannot load, or a path that is neither a GGUF nor a folder, refused by name."""

from __future__ import annotations

import pytest

from _gguf_fixtures import unloadable_gguf
from posenc.pretrained import loading as pretrained


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
