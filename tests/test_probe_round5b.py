"""A second probe of round 5's changed paths (issue 49): which configs are causal decoders, the
study's options given at the trained experiments' defaults, ``--eval-len`` below 2, a passkey
length too short, and the study table of a shard.

Expected values come from outside the code under test: whether a model is causal is measured on
HF's own model (a later token changed, the earlier logits compared); the options' values are the
ones typed on the command line; the table's cells are decided by hand from the records."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from _hf_inputs import TEXT, _run, _tokenizer  # noqa: E402
from posenc.experiments.study import hf_study  # noqa: E402
from posenc.experiments.study.plan import unit_id  # noqa: E402
from posenc.pretrained.loading import check_causal_decoder  # noqa: E402

LLAMA_CONTEXT = 64
GPT2_POSITIONS = 32


# ---------------------------------------------------------------------------- causal decoders

_SMALL = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
_XLNET = {"vocab_size": 50, "d_model": 16, "n_layer": 1, "n_head": 2, "d_inner": 32}
_XLM = {"vocab_size": 50, "emb_dim": 16, "n_layers": 1, "n_heads": 2}
_CPMANT = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}

#: (model_type, config options): families whose causal LM has a causality setting of its own.
SWITCHED = [
    ("bert-generation", {**_SMALL, "intermediate_size": 32}),
    ("bert-generation", {**_SMALL, "intermediate_size": 32, "is_decoder": True}),
    ("xlnet", _XLNET),
    ("xlnet", {**_XLNET, "attn_type": "uni"}),
    ("xlm", _XLM),
    ("xlm", {**_XLM, "causal": True}),
    ("xlm", {**_XLM, "is_decoder": True}),
    ("cpmant", {**_CPMANT, "dim_head": 8, "dim_ff": 32}),
    ("gpt2", {"vocab_size": 50, "n_embd": 16, "n_layer": 1, "n_head": 2}),
]


def _attends_left_to_right(config) -> bool:
    """Measured on HF's own model: changing token 6 of 8 leaves the logits of tokens 0..4 as they were."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 50, (1, 8))
    changed = ids.clone()
    changed[0, 6] = 3 + (ids[0, 6] - 2) % 47
    with torch.no_grad():
        before, after = model(ids).logits[0, :5], model(changed).logits[0, :5]
    return torch.allclose(before, after, atol=1e-5)


@pytest.mark.parametrize(("model_type", "options"), SWITCHED, ids=lambda v: str(v)[:40])
def test_a_config_is_accepted_exactly_when_its_model_attends_left_to_right(model_type, options):
    """BertGenerationDecoder without is_decoder, XLNet's default attn_type 'bi', XLM without causal
    and CPM-Ant were accepted and scored text they could see; XLM's CLM form (causal true) was refused."""
    config = transformers.AutoConfig.for_model(model_type, **options)
    causal = _attends_left_to_right(config)
    if causal:
        check_causal_decoder(config, "m")
    else:
        with pytest.raises(ValueError, match=rf"model m: .*model_type '{model_type}'.* not a causal decoder"):
            check_causal_decoder(config, "m")


# ---------------------------------------------------------------------------- study options


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``llama`` (context 64, RoPE) and ``gpt2`` (32 learned positions), each with a tokenizer."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("probe-round5b")
    llama = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=LLAMA_CONTEXT,
    )  # fmt: skip
    gpt2 = transformers.GPT2Config(vocab_size=300, n_embd=16, n_layer=1, n_head=2, n_positions=GPT2_POSITIONS)
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "llama")
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2")
    tokenizer = _tokenizer()
    for name in ("llama", "gpt2"):
        tokenizer.save_pretrained(root / name)
    (root / "corpus.txt").write_text(TEXT * 40)
    return root


@pytest.fixture
def planned(monkeypatch):
    """The options ``run_study`` was called with; the study itself does not run."""
    calls: list[dict] = []

    def capture(model, out, **options):
        calls.append(options)
        raise ValueError("planned")

    monkeypatch.setattr(hf_study, "run_study", capture)
    return calls


@pytest.mark.parametrize(
    ("option", "value", "key"),
    [("--eval-len", "48", "eval_len"), ("--eval-examples", "100", "eval_examples")],
)
def test_a_study_option_given_at_the_trained_default_is_kept(folders, tmp_path, planned, option, value, key):
    """48 and 100 are ExperimentConfig's defaults of --eval-len and --eval-examples: given on the
    command line they were read as not given and replaced by the study's (2c = 128, and 1)."""
    result, _ = _run(
        "extrapolate", "--hf-model", str(folders / "llama"), "--task", "text-lm", "--eval-len", "96",
        option, value, "--corpus", str(folders / "corpus.txt"), "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.exit_code == 2 and planned, result.output
    assert planned[0][key] == int(value)


def test_a_study_option_left_out_gets_the_study_default(folders, tmp_path, planned):
    result, _ = _run(
        "extrapolate", "--hf-model", str(folders / "llama"), "--task", "text-lm",
        "--corpus", str(folders / "corpus.txt"), "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.exit_code == 2 and planned, result.output
    assert planned[0]["eval_len"] is None and planned[0]["eval_examples"] == 1


def test_submit_plans_an_eval_len_given_at_the_trained_default(folders, tmp_path, monkeypatch):
    """posenc submit plans the grid with the same options: --eval-len 48, not the study's 2c = 128."""
    from posenc.experiments.study import plan

    planned_grids: list = []
    study_grid = plan.study_grid

    def capture(model, **options):
        planned_grids.append(study_grid(model, **options))
        return planned_grids[-1]

    monkeypatch.setattr(plan, "study_grid", capture)
    result, _ = _run(
        "submit", "--hf-model", str(folders / "llama"), "--task", "text-lm", "--eval-len", "48",
        "--corpus", str(folders / "corpus.txt"), "--out", str(tmp_path / "out"), "--dry-run",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert planned_grids[0].settings()["eval_len"] == 48


@pytest.mark.parametrize("eval_len", ["0", "1", "-5"])
def test_an_eval_len_below_two_is_refused_by_name(folders, tmp_path, eval_len):
    """0 reached the model as an empty window (a RuntimeError traceback, a folder written)."""
    out = tmp_path / "out"
    result, text = _run(
        "extrapolate", "--hf-model", str(folders / "llama"), "--task", "text-lm", "--eval-len", eval_len,
        "--corpus", str(folders / "corpus.txt"), "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"--eval-len {eval_len}:" in text and "at least 2" in text
    assert not out.exists()


def test_a_passkey_length_too_short_names_lengths(folders, tmp_path):
    """GPT-2's context 32 makes the default lengths 16 and 32, below the passkey prompt's minimum:
    the error named no option the user had given."""
    out = tmp_path / "out"
    result, text = _run(
        "extrapolate", "--hf-model", str(folders / "gpt2"), "--task", "text", "--eval-len", "32",
        "--corpus", str(folders / "corpus.txt"), "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "--lengths: the shortest passkey length 16 is too short" in text
    assert not out.exists()


# ---------------------------------------------------------------------------- a shard's table


def _shard_of_a_study() -> tuple[dict, list[dict]]:
    """Settings of a study of two lengths (48, 96) and one variant, and the records of the shard
    that ran only the unit at 48: passkey 0.5 there, nothing at 96."""
    settings = {
        "task": "text-passkey", "hf_model": "/m/llama", "train_len": 64, "eval_len": 96,
        "lengths": [48, 96], "depths": [0.0, 1.0], "eval_examples": 2, "encodings": ["llama"],
        "variant_names": {"llama": "none"}, "seeds": [0],
    }  # fmt: skip
    record = {
        "run": unit_id("none", 48), "encoding": "llama", "task": "text-passkey", "metric": "exact_match",
        "length": 48, "value": 0.5, "examples": 4, "seed": 0,
    }  # fmt: skip
    return settings, [record]


def test_the_table_of_a_shard_shows_no_passkey_over_all_lengths_and_says_what_is_missing():
    """The shard's "passkey all" was 0.50, the mean of the one length it ran, with no note: every
    row had some records, and only a row with none was called incomplete."""
    settings, records = _shard_of_a_study()
    table = hf_study.study_summary(settings, records)
    row = dict(zip(table.columns, table.rows[0], strict=True))
    assert row["passkey 48"] == "0.50" and row["passkey 96"] == "-"
    assert row["passkey all"] == "-"
    assert any("incomplete: 1 unit(s)" in note and "llama @ 96" in note for note in table.notes)


def test_the_table_of_a_complete_study_has_passkey_over_all_lengths_and_no_note():
    settings, records = _shard_of_a_study()
    records.append({**records[0], "run": unit_id("none", 96), "length": 96, "value": 0.0})
    table = hf_study.study_summary(settings, records)
    row = dict(zip(table.columns, table.rows[0], strict=True))
    assert row["passkey all"] == "0.25"  # (0.5 * 4 + 0.0 * 4) / 8, by hand
    assert not any("incomplete" in note for note in table.notes)
    assert json.dumps(table.notes)  # plain strings
