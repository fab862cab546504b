"""The study's precision (posenc.experiments.study.precision; issue 58, item 6): ``--dtype`` names
checked before any weight loads, the weights cast while the rotary tables stay float32 (where
``model.to(torch.bfloat16)`` rounds them), a bfloat16 study's NLL near float32's on a tiny random
Llama, the CPU and its ISA recorded beside the results, and a folder never mixing precisions."""

from __future__ import annotations

import json

import pytest
import torch

from posenc.experiments.study.precision import cast_weights, check_dtype_runs, cpu_description, study_dtype

transformers = pytest.importorskip("transformers")

CONTEXT = 64


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, rope_theta=10000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_a_dtype_is_named_and_checked_on_the_device():
    assert study_dtype("bfloat16") is torch.bfloat16 and study_dtype("float32") is torch.float32
    with pytest.raises(
        ValueError, match=r"--dtype 'fp8': the study runs in one of float32, bfloat16, float16"
    ):
        study_dtype("fp8")
    check_dtype_runs("bfloat16", torch.device("cpu"))  # every CPU torch runs on multiplies bfloat16


def test_the_weights_are_cast_and_the_rotary_table_stays_float32():
    model = _llama()
    table = model.model.rotary_emb.inv_freq.clone()
    assert table.dtype == torch.float32
    rounded = _llama().to(torch.bfloat16).model.rotary_emb.inv_freq
    assert rounded.dtype == torch.bfloat16 and not torch.equal(rounded.float(), table)  # what is avoided
    cast_weights(model, torch.device("cpu"), torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.rotary_emb.inv_freq, table)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 16)))  # it runs


def test_the_cpu_is_described():
    described = cpu_description()
    assert isinstance(described["cpu"], str) and described["cpu"]
    assert set(described["isa"]) <= {
        "avx2",
        "avx512f",
        "avx512_bf16",
        "avx512_fp16",
        "amx_tile",
        "amx_bf16",
        "amx_fp16",
    }
    assert described["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()


@pytest.mark.hf
def test_a_bfloat16_study_is_near_float32_records_its_machine_and_never_mixes_with_one(tmp_path):
    pytest.importorskip("tokenizers")
    from _tiny_hf import TEXT, save_tiny_llama
    from posenc.experiments.study.hf_study import run_study
    from posenc.experiments.study.plan import study_command

    model_dir = save_tiny_llama(tmp_path / "tiny-llama", CONTEXT)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 40)
    options = dict(task="text-lm", eval_examples=2, corpus=str(corpus), variants=["none", "yarn"])
    exact, _ = run_study(model_dir, tmp_path / "f32", **options)
    half, settings = run_study(model_dir, tmp_path / "bf16", dtype="bfloat16", **options)
    assert settings["dtype"] == "bfloat16"
    pairs = {(r["encoding"], tuple(r["bucket"])): r["nll"] for r in exact}
    assert max(abs(r["nll"] - pairs[r["encoding"], tuple(r["bucket"])]) for r in half) < 0.05
    assert any(r["nll"] != pairs[r["encoding"], tuple(r["bucket"])] for r in half)  # it did run in bfloat16
    runtime = json.loads((tmp_path / "bf16" / "config.json").read_text())["runtime"]
    assert runtime["cpu"] == cpu_description()["cpu"] and runtime["isa"] == cpu_description()["isa"]
    assert "--dtype bfloat16" in study_command(settings, tmp_path / "again")
    # A float32 folder is not resumed in bfloat16 (nor the other way round): the settings differ.
    with pytest.raises(ValueError, match="holds another experiment"):
        run_study(model_dir, tmp_path / "f32", dtype="bfloat16", **options)
    with pytest.raises(ValueError, match=r"--dtype 'int8'"):
        run_study(model_dir, tmp_path / "int8", dtype="int8", **options)
    assert not (tmp_path / "int8").exists()


@pytest.mark.parametrize(
    ("name", "isa", "emulated"),
    [
        ("bfloat16", ["avx2"], True),
        ("bfloat16", ["avx2", "avx512f", "avx512_bf16"], False),
        ("bfloat16", ["avx2", "avx512f", "amx_tile", "amx_bf16"], False),
        ("float16", ["avx2", "avx512f", "avx512_bf16"], True),
        ("float32", ["avx2"], False),
    ],
)
def test_a_half_precision_without_its_instructions_is_named_as_emulated(monkeypatch, name, isa, emulated):
    from posenc.experiments.study import precision

    monkeypatch.setattr(precision, "cpu_description", lambda: {"cpu": "Some CPU", "isa": isa})
    note = precision.emulated_note(name, "cpu")
    assert (note is not None) == emulated
    if emulated:
        assert note.startswith(f"--dtype {name}: this CPU (Some CPU; {', '.join(isa)}) has no ")
        assert "--dtype float32 is faster here" in note
    assert precision.emulated_note(name, "meta") is None
