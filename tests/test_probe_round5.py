"""Findings of a hostile probe of issue 49's fixes (round 5), one test each.

* A study variant over a model that ships its own scaling (Llama 3.1's ``llama3``) carried that
  scaling's options into the variant, which the new key check refuses: ``--eval-variants linear``
  failed on every Llama 3.1. Expected: HF's own frequencies for the variant alone.
* RoPE scaling accepted ``factor=inf`` (zero, nan or infinitely scaled frequencies) and lengths that
  are no positive int (dynamic NTK with ``max_position_embeddings=-5`` returned complex
  frequencies; 0 a ZeroDivisionError; nan a bare ``int()`` error; 1.5 truncated to 1).
* ``--eval-variants`` over a context of 0 was a bare ZeroDivisionError.
* Two copies of one record whose value is nan (a diverged run) were refused as "two different
  results (nan vs nan)".
* On a terminal narrower than a long encoding name plus one number column, the Rich summary
  dropped every number column (only the names were printed).
"""

from __future__ import annotations

import io
import json
import math
import warnings

import pytest
import torch

import posenc.functional as F
from posenc.experiments.results.records import differing_fields, read_records
from posenc.experiments.results.summary import SummaryTable
from posenc.experiments.study.hf_scaling import rope_parameters_for

HEAD_DIM, BASE = 16, 10000.0


# ---------------------------------------------------------------------------- study variants


def _tiny_llama(rope_parameters):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rope_parameters=rope_parameters,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


LLAMA_31 = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.hf
@pytest.mark.parametrize("variant", ["linear", "dynamic", "yarn"])
def test_a_variant_replaces_the_models_own_scaling(variant):
    """The variant's frequencies are HF's for the variant's parameters on the model's base: the
    llama3 band options are not carried into it (they were, and were refused)."""
    from posenc.experiments.study.hf_scaling import apply_scaling

    model = _tiny_llama(dict(LLAMA_31))
    original = dict(model.config.rope_parameters)
    parameters = rope_parameters_for(variant, 128, 512)
    apply_scaling(model, parameters, original)
    reference = _tiny_llama({"rope_theta": 5e5, **parameters}).model.rotary_emb
    ours = model.model.rotary_emb
    torch.testing.assert_close(ours.inv_freq, reference.inv_freq, rtol=0, atol=0)
    assert ours.attention_scaling == reference.attention_scaling


def test_a_context_of_zero_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"--eval-variants 'linear'.*max_position_embeddings"):
        rope_parameters_for("linear", 0, 10)


# ---------------------------------------------------------------------------- scaling values


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "llama3"])
def test_an_infinite_factor_is_refused(rope_type):
    scaling = {"rope_type": rope_type, "factor": math.inf}
    if rope_type != "linear":
        scaling["original_max_position_embeddings"] = 64
    if rope_type == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0)
    with pytest.raises(ValueError, match="factor must be finite"):
        F.rope_inv_freq(HEAD_DIM, BASE, scaling, 300)


@pytest.mark.parametrize(
    ("rope_type", "key", "value"),
    [
        ("dynamic", "max_position_embeddings", -5),  # returned complex frequencies
        ("dynamic", "max_position_embeddings", 0),  # ZeroDivisionError
        ("dynamic", "original_max_position_embeddings", math.nan),  # int(nan): no key named
        ("yarn", "original_max_position_embeddings", 1.5),  # truncated to 1
        ("yarn", "original_max_position_embeddings", math.inf),  # OverflowError
        ("longrope", "original_max_position_embeddings", True),  # read as 1: ZeroDivisionError
    ],
)
def test_a_length_that_is_no_positive_int_is_refused_naming_it(rope_type, key, value):
    scaling = {"rope_type": rope_type, "factor": 2.0, key: value}
    if rope_type == "longrope":
        scaling.update(short_factor=[1.0] * (HEAD_DIM // 2), long_factor=[2.0] * (HEAD_DIM // 2))
    with pytest.raises(ValueError, match=f"{key} must be a positive int"):
        F.rope_inv_freq(HEAD_DIM, BASE, scaling, 300)


def test_a_whole_float_length_is_that_length():
    """Dynamic NTK at 300 tokens of a model of 128.0 (a saved config's float): the formula
    ``b' = b (s L'/L - (s - 1))^(d/(d-2))`` written here."""
    got, scale = F.rope_inv_freq(
        HEAD_DIM, BASE, {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 128.0}, 300
    )
    base = BASE * ((2.0 * 300 / 128) - 1.0) ** (HEAD_DIM / (HEAD_DIM - 2))
    want = 1.0 / base ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    assert scale == 1.0


# ---------------------------------------------------------------------------- records


def test_a_nan_record_read_twice_is_one_result(tmp_path):
    record = {
        "run": "rope-s0",
        "encoding": "rope",
        "seed": 0,
        "metric": "ppl",
        "length": 128,
        "value": math.nan,
    }
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    assert differing_fields(json.loads(json.dumps(record)), json.loads(json.dumps(record))) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = read_records(path)
    assert len(records) == 1 and math.isnan(records[0]["value"])
    assert differing_fields(record, {**record, "value": 1.0}) == ["value"]


# ---------------------------------------------------------------------------- terminal table


@pytest.mark.parametrize("width", [40, 30, 20])
def test_a_narrow_terminal_still_shows_every_number(width):
    rich = pytest.importorskip("rich.console")
    table = SummaryTable(
        "title",
        ["encoding", "ppl@128", "ppl@256"],
        [["rope", "1.25", "2.5"], ["a" * 40, "10.5", "7.75"]],
    )
    buffer = io.StringIO()
    console = rich.Console(file=buffer, width=width)
    for part in table.rich_tables(width):
        console.print(part)
    text = buffer.getvalue()
    headers = ("ppl@128", "ppl@256") if width >= 30 else ()  # (narrower: a header folds, as it may)
    for cell in ("1.25", "2.5", "10.5", "7.75", *headers):
        assert cell in text, f"{cell!r} missing at width {width}:\n{text}"
    assert max(len(line) for line in text.splitlines()) <= width
