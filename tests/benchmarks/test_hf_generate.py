"""The plumbing of ``posenc bench hf --tables smollm2`` on a tiny random Llama (nothing timed here)."""

from __future__ import annotations

import argparse

import pytest
import torch

transformers = pytest.importorskip("transformers")

from posenc.benchmarks.decoding import _hf_generate  # noqa: E402


def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def test_time_generate_runs_both_and_checks_the_tokens():
    ids = torch.randint(0, 64, (1, 5))
    seconds = _hf_generate.time_generate(_tiny_llama(), ids, new=3, repeats=2)
    assert set(seconds) == {"sdpa", "posenc"} and all(len(v) == 2 for v in seconds.values())
    rows = _hf_generate.generate_rows(seconds, new=3)
    assert [row[0] for row in rows] == ["sdpa", "posenc"] and rows[0][-1] == "1.000×"


def test_different_tokens_are_an_error(monkeypatch):
    model = _tiny_llama()
    real = model.generate
    calls = iter(range(100))

    def generate(ids, **options):  # posenc's calls (every second one) return other tokens
        out = real(ids, **options)
        return out + 1 if next(calls) % 2 else out

    monkeypatch.setattr(model, "generate", generate)
    with pytest.raises(AssertionError, match="differ from HF sdpa"):
        _hf_generate.time_generate(model, torch.randint(0, 64, (1, 5)), new=2, repeats=1)


def test_rows_divide_sdpa_by_posenc():
    rows = _hf_generate.generate_rows({"sdpa": [1.0, 1.2, 1.1], "posenc": [2.2, 2.0, 2.4]}, new=10)
    assert rows[1][1].startswith("220.0 ms") and rows[1][2] == "4.5" and rows[1][3] == "0.500×"


def test_a_missing_model_is_one_line_naming_the_fetch(monkeypatch):
    import posenc.pretrained.loading as pretrained

    def absent(name):
        raise FileNotFoundError(f"{name} is not fetched: fetch it with `posenc models fetch {name}`")

    monkeypatch.setattr(pretrained, "model_path", absent)
    line = _hf_generate.smollm2_table(argparse.Namespace(prompt=8, new=2, repeats=1))
    assert "skipped" in line and "posenc models fetch" in line


def test_time_steps_interleaves_both_and_checks_the_tokens():
    ids = torch.randint(0, 64, (1, 5))
    seconds = _hf_generate.time_steps(_tiny_llama(), ids, new=3, rounds=2)
    assert set(seconds) == {"sdpa", "posenc"} and all(len(v) == 2 for v in seconds.values())
    assert all(s > 0 for v in seconds.values() for s in v)


def test_step_decodes_that_choose_other_tokens_are_an_error(monkeypatch):
    real = _hf_generate._one_round

    def one_round(models, ids, new, cache_class):  # the posenc copy's weights changed: other tokens
        with torch.no_grad():
            models["posenc"].lm_head.weight.neg_()
        return real(models, ids, new, cache_class)

    monkeypatch.setattr(_hf_generate, "_one_round", one_round)
    with pytest.raises(AssertionError, match="differ from HF sdpa"):
        _hf_generate.time_steps(_tiny_llama(), torch.randint(0, 64, (1, 5)), new=4, rounds=1)


def test_step_rows_give_the_ratio_of_medians_and_the_median_paired_ratio():
    rows = _hf_generate.step_rows({"sdpa": [1.0, 2.0, 3.0], "posenc": [2.0, 2.0, 6.0]})
    # medians 2.0 / 2.0; paired ratios 0.5, 1.0, 0.5 -> median 0.5
    assert rows[0][2] == "1.000×" and rows[1][1].startswith("2000.00 ms")
    assert rows[1][2] == "1.000× (paired 0.500×)"
