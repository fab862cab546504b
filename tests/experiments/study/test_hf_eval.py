"""``posenc extrapolate --hf-model``: a tiny random Llama saved with save_pretrained, evaluated without
training; perplexity checked against HF's own loss, identity scalings reproduce the records."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

pytestmark = pytest.mark.hf  # the posenc.hf seam: CI runs these at both ends of the transformers range

transformers = pytest.importorskip("transformers")

from posenc.experiments.results.records import read_run_records  # noqa: E402
from posenc.experiments.study.hf_eval import HFCausalLM, evaluate_hf_model  # noqa: E402
from posenc.experiments.tasks.catalog import ByteLM, mix_seed  # noqa: E402
from posenc.viz.folder import write_figures  # noqa: E402

CONTEXT = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=CONTEXT,
    )
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _by(records, metric):
    return {(r["encoding"], r["length"]): r for r in records if r["metric"] == metric}


def test_lm_perplexity_equals_hf_loss_on_the_same_windows(model_dir, tmp_path):
    records, settings = evaluate_hf_model(
        model_dir, tmp_path, task="lm", eval_len=40, eval_examples=6, eval_batch=6, figures=write_figures
    )
    assert settings["train_len"] == CONTEXT and not settings["tokenizer"]
    ppl = [r["value"] for r in sorted(records, key=lambda r: r["length"])]
    assert [r["length"] for r in sorted(records, key=lambda r: r["length"])] == list(range(1, 41))
    assert all(r["train_len"] == CONTEXT and r["steps"] == 0 for r in records)
    # The same windows (bytes as token ids), scored by HF's own shifted cross-entropy.
    windows = ByteLM().batch(40, 6, torch.Generator().manual_seed(mix_seed(0, "lm-eval")))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.cat([windows.inputs, windows.targets[:, -1:]], dim=1)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert sum(math.log(p) for p in ppl) / 40 == pytest.approx(float(loss), rel=1e-5)
    assert (tmp_path / "extrapolation.png").is_file() and (tmp_path / "results.csv").is_file()


def test_identity_scaling_reproduces_the_records_and_real_scalings_change_them(model_dir, tmp_path):
    records, _ = evaluate_hf_model(
        model_dir,
        tmp_path,
        task="lm",
        eval_len=32,
        eval_examples=4,
        variants=["none", "linear:1", "yarn", "dynamic"],
    )
    ppl = _by(records, "perplexity")
    name = model_dir.name
    for n in range(1, 33):
        assert ppl[(f"{name} + linear:1", n)]["value"] == ppl[(name, n)]["value"]
    assert any(ppl[(f"{name} + yarn", n)]["value"] != ppl[(name, n)]["value"] for n in range(1, 33))
    # Dynamic NTK rescales by the length of the call: 32-token windows are past the context, so it acts.
    assert any(ppl[(f"{name} + dynamic", n)]["value"] != ppl[(name, n)]["value"] for n in range(1, 33))
    # One per-run iid record per variant and seed: the perplexity at the trained context.
    runs = {r["encoding"]: r for r in read_run_records(tmp_path)}
    assert len(runs) == 4 and runs[f"{name} + yarn"]["value"] == ppl[(f"{name} + yarn", CONTEXT)]["value"]
    assert runs[name]["metric"] == "iid" and runs[name]["fit"] is None
    config = json.loads((tmp_path / "config.json").read_text())["experiment"]
    assert config["variants"][f"{name} + yarn"] == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": CONTEXT,
    }


def test_passkey_through_the_model_matches_a_direct_greedy_check(model_dir, tmp_path):
    records, _ = evaluate_hf_model(
        model_dir,
        tmp_path,
        task="passkey",
        eval_len=20,
        eval_examples=5,
        num_symbols=16,
        figures=write_figures,
    )
    exact = _by(records, "exact_match")
    assert sorted(n for _, n in exact) == list(range(1, 21))
    assert all(sum(c["examples"] for c in r["by_depth"]) == 5 for r in exact.values())
    assert (tmp_path / "depth.png").is_file()
    # Direct: the model's argmax at the key positions equals the key, for the harness's examples.
    from posenc.experiments.tasks.retrieval import Passkey

    task = Passkey(num_symbols=16)
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval())
    for length in (3, 20):
        batch, _ = task.eval_batch(length, 5, torch.Generator().manual_seed(mix_seed(0, length, "eval")))
        with torch.no_grad():
            predicted = model(batch.inputs).argmax(-1)
        key = slice(task.input_length(length) + 1, task.input_length(length) + 1 + task.key_length)
        right = (predicted[:, key] == batch.targets[:, key]).all(1) & (
            predicted[:, -1] == batch.targets[:, -1]
        )
        assert exact[(model_dir.name, length)]["value"] == pytest.approx(float(right.float().mean()))


def test_a_tokenizer_in_the_folder_tokenizes_the_corpus(model_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(
        ["def parse_args(self, args=None, namespace=None):"] * 20,
        trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>"]),
    )
    folder = tmp_path / "with-tokenizer"
    transformers.AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(folder)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")
    fast.save_pretrained(folder)
    records, settings = evaluate_hf_model(folder, tmp_path / "out", task="lm", eval_len=24, eval_examples=2)
    assert settings["tokenizer"] and len(records) == 24
    from posenc.experiments.study.hf_eval import TokenizedLM

    task = TokenizedLM(fast)
    assert task.vocab_size == len(fast) <= 300
    text = ByteLM().train_data[:200].tolist()
    assert (
        task.train_data[:10].tolist()
        == fast(bytes(text).decode(), add_special_tokens=False)["input_ids"][:10]
    )


def test_bad_input_is_refused_before_anything_is_written(model_dir, tmp_path):
    cases = [
        (dict(task="lm", eval_len=CONTEXT), r"must exceed the model's training context 16"),
        (dict(task="copy", eval_len=32), r"evaluates the tasks lm, passkey"),
        (dict(task="passkey", eval_len=32, num_symbols=400), r"vocabulary has 300; lower --num-symbols"),
        (dict(task="lm", eval_len=32, variants=["longish"]), r"--eval-variants 'longish'"),
        (dict(task="lm", eval_len=32, variants=["yarn:0.5"]), r"factor must be >= 1"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            evaluate_hf_model(model_dir, tmp_path / "out", **options)
        assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"no config\.json"):
        evaluate_hf_model(tmp_path, tmp_path / "out")


def test_cli_hf_model_prints_the_table_and_refuses_variants_without_it(model_dir, tmp_path):
    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    out = tmp_path / "run"
    args = ["extrapolate", "--hf-model", str(model_dir), "--task", "passkey", "--num-symbols", "16"]
    args += [
        "--eval-len",
        "24",
        "--eval-examples",
        "3",
        "--out",
        str(out),
        "--no-progress",
        "--eval-variants",
        "none,yarn",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "trained context <= 16" in result.output and f"{model_dir.name} + yarn" in result.output
    report = CliRunner().invoke(app, ["report", str(out)])
    assert report.exit_code == 0, report.output
    assert 'id="depth"' in (out / "report.html").read_text()
    again = CliRunner().invoke(
        app, ["extrapolate", "--task", "copy", "--eval-variants", "yarn", "--out", str(tmp_path / "x")]
    )
    # Without --hf-model, variants apply to the trained runs (issue 14): yarn is no setting of nope.
    assert again.exit_code == 2 and "'yarn' does not apply to --encodings 'nope'" in " ".join(
        again.output.split()
    )
    assert not (tmp_path / "x").exists()
    other = CliRunner().invoke(app, [*args[:-2], "--eval-variants", "none", "--seeds", "1"])
    assert other.exit_code == 2 and "holds another experiment" in " ".join(other.output.split())


def test_a_model_without_rope_or_past_its_table_is_refused_before_writing(tmp_path):
    config = transformers.GPT2Config(vocab_size=300, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    folder = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has no rope_parameters"):
        evaluate_hf_model(folder, tmp_path / "out", task="lm", eval_len=17, variants=["none", "yarn"])
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel cannot run 17 tokens"):
        evaluate_hf_model(folder, tmp_path / "out", task="lm", eval_len=17)
    assert not (tmp_path / "out").exists()
