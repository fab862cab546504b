"""A GGUF file of an architecture HF transformers cannot load, written with ``gguf`` (the ``real``
extra), shared by the tests of ``posenc.pretrained.loading.load`` and of ``posenc extrapolate --hf-model``."""

from __future__ import annotations

from pathlib import Path

import pytest


def unloadable_gguf(folder: Path, architecture: str = "rwkv6") -> Path:
    """``folder/tiny.gguf``: one tensor, ``general.architecture = architecture``."""
    gguf = pytest.importorskip("gguf")
    numpy = pytest.importorskip("numpy")
    path = folder / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", numpy.zeros((4, 8), dtype=numpy.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
