"""What ``--hf-model`` refuses when the command starts (posenc.experiments.study.hf_scaling), on tiny random
models saved to tmp folders: an encoder's config, a folder without weights, a learned position table
shorter than ``--eval-len``, a variant factor that is not finite or would be below 1; ntk's inverse
frequencies equal the formula."""

from __future__ import annotations

import shutil

import pytest
import torch
from typer.testing import CliRunner

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")

tokenizers = pytest.importorskip("tokenizers")


from _hf_inputs import TEXT, _run, _tokenizer  # noqa: E402
from _tiny_hf import save_tiny_llama  # noqa: E402
from posenc.cli.app import app, load_command_modules  # noqa: E402

CONTEXT = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", CONTEXT)


def _load(model_dir):
    from posenc.pretrained.loading import load

    return load(model_dir)


def test_ntk_inverse_frequencies_equal_the_formula(model_dir):
    from posenc.experiments.study.hf_scaling import apply_scaling as _apply_scaling
    from posenc.experiments.study.hf_scaling import rope_parameters_for

    model, _ = _load(model_dir)
    original = dict(model.config.rope_parameters)
    base, d, factor = float(original["rope_theta"]), 16, 3.0  # head_dim 32 / 2 heads
    _apply_scaling(model, rope_parameters_for("ntk:3", CONTEXT, 2 * CONTEXT), original)
    expected = 1.0 / (base * factor ** (d / (d - 2))) ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq.double(), expected, rtol=1e-6, atol=0)
    assert not torch.allclose(
        model.model.rotary_emb.inv_freq.double(),
        1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d),
    )
    # posenc's own ntk scaling gives the same frequencies.
    from posenc.encodings.rope_scaling import ntk_inv_freq

    ours, _ = ntk_inv_freq({"rope_theta": base, "factor": factor, "head_dim": d})
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=0)
    _apply_scaling(model, None, original)
    torch.testing.assert_close(
        model.model.rotary_emb.inv_freq.double(),
        1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d),
    )


# ----------------------------------------------------------------------------
# What ``--hf-model`` refuses when the command starts, on tiny random models saved to tmp folders (issue 49,
# items 4, 5, 7 and 14): an encoder's config, a folder without weights, a learned position table shorter
# than ``--eval-len``, a variant factor that is not finite or would be below 1; and the ``--help`` of
# ``extrapolate`` and ``submit`` listing the registered tasks and the forms of ``--hf-model``.


#: GPT-2's learned position table (n_positions) in the tiny model.
GPT2_POSITIONS = 32


LLAMA_CONTEXT = 64


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Folders with a tokenizer each: ``bert`` (a BertModel), ``gpt2`` (GPT2LMHeadModel, 32 learned
    positions), ``noweights`` (gpt2's config and tokenizer, no weight file) and ``llama``."""
    import torch

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hf-inputs")
    tokenizer = _tokenizer()
    bert = transformers.BertConfig(
        vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    gpt2 = transformers.GPT2Config(vocab_size=300, n_embd=16, n_layer=1, n_head=2, n_positions=GPT2_POSITIONS)
    llama = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=LLAMA_CONTEXT,
    )
    transformers.BertModel(bert).save_pretrained(root / "bert")
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2")
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "llama")
    (root / "noweights").mkdir()
    shutil.copy(root / "gpt2" / "config.json", root / "noweights" / "config.json")
    for name in ("bert", "gpt2", "llama", "noweights"):
        tokenizer.save_pretrained(root / name)
    (root / "corpus.txt").write_text(TEXT * 40)
    return root


@pytest.fixture
def no_weights_load(monkeypatch):
    """Loading any model's weights fails the test: what is refused must be refused from the config."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


# ---------------------------------------------------------------------------- item 14: --help


def _option_help(command: str, option: str, monkeypatch) -> str:
    """The help text of ``option`` in ``posenc COMMAND --help`` on a terminal wide enough for one line."""
    monkeypatch.setenv("COLUMNS", "3000")
    load_command_modules()
    result = CliRunner().invoke(app, [command, "--help"], terminal_width=3000)
    assert result.exit_code == 0, result.output
    lines = [" ".join(line.replace("│", " ").split()) for line in result.output.splitlines()]
    return next(line for line in lines if line.startswith(option + " "))


# ---------------------------------------------------------------------------- item 4: an encoder


@pytest.mark.parametrize("task", ["lm", "passkey", "text", "text-lm"])
def test_a_bert_folder_is_refused_before_its_weights_load(folders, tmp_path, no_weights_load, task):
    out = tmp_path / "out"
    result, text = _run(
        "extrapolate", "--hf-model", str(folders / "bert"), "--task", task, "--eval-len", "1024",
        "--corpus", str(folders / "corpus.txt"), "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"model {folders / 'bert'}:" in text and "not a causal decoder" in text
    assert "model_type 'bert'" in text and "BertModel" in text
    assert not out.exists()


def test_which_configs_are_causal_decoders():
    """Hand-decided: the decoder-only families and an encoder configured as a decoder are; BERT,
    RoBERTa (bidirectional encoders) and T5 (an encoder-decoder with no causal LM) are not."""
    from posenc.pretrained.loading import check_causal_decoder

    decoders = [
        transformers.GPT2Config(),
        transformers.LlamaConfig(),
        transformers.BertConfig(is_decoder=True),
    ]
    for config in decoders:
        check_causal_decoder(config, "m")
    for config in (transformers.BertConfig(), transformers.RobertaConfig(), transformers.T5Config()):
        with pytest.raises(ValueError, match=rf"model m: .*model_type '{config.model_type}'"):
            check_causal_decoder(config, "m")


# ---------------------------------------------------------------------------- item 7: no weights, short table


@pytest.mark.parametrize("task", ["lm", "text"])
def test_a_folder_without_weights_names_the_folder_and_the_files(folders, tmp_path, no_weights_load, task):
    out = tmp_path / "out"
    result, text = _run(
        "extrapolate", "--hf-model", str(folders / "noweights"), "--task", task, "--eval-len", "96",
        "--corpus", str(folders / "corpus.txt"), "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"model {folders / 'noweights'}: a config.json but no weights" in text
    assert "model.safetensors" in text and "pytorch_model.bin" in text
    assert not out.exists()


def test_submit_refuses_a_folder_without_weights_before_writing_scripts(folders, tmp_path):
    out = tmp_path / "out"
    result, text = _run(
        "submit", "--hf-model", str(folders / "noweights"), "--task", "text", "--eval-len", "96",
        "--corpus", str(folders / "corpus.txt"), "--out", str(out), "--dry-run",
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "no weights" in text and not out.exists()


def test_a_study_past_a_learned_position_table_is_refused_before_any_unit(folders, tmp_path, monkeypatch):
    from posenc.experiments.study import hf_study

    def no_unit(*args, **kwargs):
        raise AssertionError("a unit ran")

    monkeypatch.setattr(hf_study, "_run_unit", no_unit)
    out = tmp_path / "out"
    result, text = _run(
        "extrapolate", "--hf-model", str(folders / "gpt2"), "--task", "text", "--eval-len", "96",
        "--lengths", "64,96", "--corpus", str(folders / "corpus.txt"), "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "GPT2LMHeadModel cannot take position 96" in text
    assert f"max_position_embeddings {GPT2_POSITIONS}" in text and "--eval-len" in text
    assert not out.exists()


def test_a_study_inside_the_learned_table_runs(folders, tmp_path):
    """The check refuses only what the table cannot reach: --eval-len 32 over 32 positions runs."""
    out = tmp_path / "out"
    result, _ = _run(
        "extrapolate", "--hf-model", str(folders / "gpt2"), "--task", "text-lm", "--eval-len",
        str(GPT2_POSITIONS), "--corpus", str(folders / "corpus.txt"), "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (out / "results.jsonl").read_text().count('"perplexity"') >= 1


# ---------------------------------------------------------------------------- item 5: variant factors


@pytest.mark.parametrize("variant", ["linear:inf", "yarn:1e309", "ntk:nan", "yarn:2/inf", "none:2"])
@pytest.mark.parametrize("task", ["lm", "text"])
def test_a_factor_that_is_not_finite_is_refused_when_the_command_starts(
    folders, tmp_path, no_weights_load, variant, task
):
    out = tmp_path / "out"
    result, text = _run(
        "extrapolate", "--hf-model", str(folders / "llama"), "--task", task, "--eval-len", "128",
        "--corpus", str(folders / "corpus.txt"), "--eval-variants", f"none,{variant}", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "--eval-variants" in text and not out.exists()


@pytest.mark.parametrize("eval_len", [LLAMA_CONTEXT // 2, LLAMA_CONTEXT])
def test_a_default_factor_that_stretches_nothing_names_eval_len_and_the_context(
    folders, tmp_path, no_weights_load, eval_len
):
    """--eval-len at or below the context: the default factor eval_len / c is not above 1 (it was
    raised to 1 silently, so the yarn row equalled none's)."""
    out = tmp_path / "out"
    result, text = _run(
        "extrapolate", "--hf-model", str(folders / "llama"), "--task", "text", "--eval-len", str(eval_len),
        "--lengths", str(eval_len), "--corpus", str(folders / "corpus.txt"), "--eval-variants", "none,yarn",
        "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"--eval-len / context = {eval_len}/{LLAMA_CONTEXT}" in text
    assert f"above {LLAMA_CONTEXT}" in text and not out.exists()


def test_a_given_factor_at_or_below_the_context_is_kept():
    """With the factor written, --eval-len below the context is fine: yarn:2 stays 2."""
    from posenc.experiments.study.hf_scaling import rope_parameters_for

    assert rope_parameters_for("yarn:2", LLAMA_CONTEXT, LLAMA_CONTEXT // 2)["factor"] == 2.0
    assert rope_parameters_for("linear", LLAMA_CONTEXT, 3 * LLAMA_CONTEXT)["factor"] == 3.0
    assert rope_parameters_for("none", LLAMA_CONTEXT, LLAMA_CONTEXT // 2) is None


@pytest.mark.parametrize("command", ["extrapolate", "submit"])
def test_the_help_lists_every_registered_task_and_the_forms_of_hf_model(command, monkeypatch):
    from posenc.experiments.study.hf_scaling import HF_TASKS
    from posenc.experiments.study.plan import STUDY_TASKS
    from posenc.experiments.tasks.catalog import TASKS
    from posenc.pretrained.loading import MODELS

    task = _option_help(command, "--task", monkeypatch)
    listed = {word.strip(",;:") for word in task.split()}
    assert {*TASKS, *HF_TASKS, *STUDY_TASKS} <= listed, task
    hf_model = _option_help(command, "--hf-model", monkeypatch)
    # The causal LMs it takes, not the encoders and Whisper it refuses (issue 62 item 10).
    causal = {name for name, spec in MODELS.items() if spec.architecture.endswith("ForCausalLM")}
    assert causal and ".gguf" in hf_model and all(name in hf_model for name in causal), hf_model
    assert not any(name in hf_model for name in set(MODELS) - causal), hf_model
    assert all(name in hf_model for name in STUDY_TASKS), hf_model
