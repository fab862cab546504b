"""LongPPL (Fang et al. 2025; the ``longppl`` package's ``find_key_token`` rule) with the model as its
own evaluator (posenc.experiments.tasks.longppl, ``--longppl`` of the study; issue 45, item 5): the
key-token rule on hand-made losses, the short-context loss against forwards of exactly each token's
truncated context, and the study's key tokens against a model that reads a fixed distance back (the
key tokens are then known by hand: those whose source lies beyond the short context)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from posenc.experiments.tasks.longppl import KEY_GAP, KEY_LOSS, key_tokens, long_ppl, short_context_nll

VOCAB = 50


class Lookback(nn.Module):
    """Predicts token ``i + 1`` as the token ``period`` before it (logit 20), uniform where the input
    does not reach that far: the long context helps exactly the tokens whose source is in view."""

    def __init__(self, period: int, vocab: int = VOCAB) -> None:
        super().__init__()
        self.period, self.vocab = period, vocab
        self.config = SimpleNamespace(rope_parameters=None, max_position_embeddings=64)
        self.anchor = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, position_ids=None, **kwargs):
        batch, length = input_ids.shape
        logits = torch.zeros(batch, length, self.vocab)
        for i in range(length):
            if i + 1 - self.period >= 0:
                logits[torch.arange(batch), i, input_ids[:, i + 1 - self.period]] = 20.0
        return SimpleNamespace(logits=logits)


def test_the_key_token_rule_on_hand_made_losses():
    assert (KEY_GAP, KEY_LOSS) == (2.0, 2.0)
    long = torch.tensor([0.5, 1.9, 2.1, 0.1, 1.0, 1.99], dtype=torch.float64)
    short = torch.tensor([3.0, 3.95, 5.0, 2.0, math.nan, 3.99], dtype=torch.float64)
    # gap 2.5 and loss 0.5: key; gap 2.05, loss 1.9: key; loss 2.1: not; gap 1.9: not; no short loss:
    # not; gap exactly 2.0: not (strictly greater).
    assert key_tokens(long, short).tolist() == [True, True, False, False, False, False]
    assert long_ppl(long, key_tokens(long, short)) == pytest.approx(math.exp((0.5 + 1.9) / 2))
    assert math.isnan(long_ppl(long, torch.zeros(6, dtype=torch.bool)))


def test_the_short_context_loss_is_each_tokens_loss_from_its_block_start():
    pytest.importorskip("transformers")
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double().eval()
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    trunc, stride = 8, 5
    got = short_context_nll(model, ids, trunc, stride)
    assert got.shape == (1, 39) and torch.isnan(got[0, : trunc - 1]).all()
    for t in range(trunc, 40):  # token t sees the tokens from its block's start s on
        s = ((t - trunc) // stride) * stride
        with torch.no_grad():
            logits = model(input_ids=ids[:, s:t]).logits[0, -1].double()
        want = -torch.log_softmax(logits, -1)[ids[0, t]]
        assert got[0, t - 1] == pytest.approx(float(want), rel=1e-6), t


def test_key_tokens_are_those_whose_source_is_beyond_the_short_context():
    period, trunc, stride, length = 12, 8, 3, 40
    base = torch.randint(0, VOCAB, (period,), generator=torch.Generator().manual_seed(2))
    ids = base.repeat(4)[None, :length]
    model = Lookback(period)
    from posenc.experiments.tasks.text import position_nll

    long = position_nll(model, ids)[0].double()
    keys = key_tokens(long, short_context_nll(model, ids, trunc, stride)[0])
    # By hand: token t (t >= period) is predicted from t - period; its short context starts at
    # s = ((t - trunc) // stride) * stride, which has lost it when t - period < s.
    want = [
        t >= period and t >= trunc and t - period < ((t - trunc) // stride) * stride for t in range(1, length)
    ]
    assert keys.tolist() == want and sum(want) > 5
    assert long_ppl(long, keys) == pytest.approx(
        math.exp(math.log1p((VOCAB - 1) * math.exp(-20.0))), rel=1e-4
    )


@pytest.mark.hf
def test_the_study_reports_longppl_beside_perplexity(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    from _tiny_hf import TEXT, save_tiny_llama
    from posenc.experiments.study import hf_study
    from posenc.pretrained.loading import load

    model_dir = save_tiny_llama(tmp_path / "tiny-llama", 64)  # c = 64: trunc 32, stride 8, windows 128
    _, tokenizer = load(model_dir)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 40)
    ids = torch.tensor(tokenizer(TEXT * 40, add_special_tokens=False)["input_ids"])
    period = next(p for p in range(1, 200) if torch.equal(ids[p : p + 300], ids[:300]))  # TEXT in tokens
    model = Lookback(period, vocab=420)
    monkeypatch.setattr(hf_study, "load_model", lambda ref: (model, tokenizer, "lookback"))
    records, settings = hf_study.run_study(
        model_dir, tmp_path / "out", task="text-lm", eval_examples=2, corpus=str(corpus), longppl=True
    )
    assert settings["longppl"] == {"trunc": 32, "stride": 8}
    expected = 0
    for start in hf_study.window_starts(len(ids), 128, 2):
        window = ids[start : start + 128]
        for t in range(1, 128):
            s = ((t - 32) // 8) * 8
            expected += bool(t >= period and t >= 32 and t - period < s and window[t] == window[t - period])
    assert sum(r["key_tokens"] for r in records) == expected > 0
    table = hf_study.study_summary(settings, records)
    assert table.columns[11:13] == ["ppl all", "LongPPL (keys)"]
    assert table.rows[0][12].endswith(f"({expected})")
    assert any("LongPPL (Fang et al. 2025" in note for note in table.notes)


def test_longppl_needs_a_perplexity_task(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from _tiny_hf import save_tiny_llama
    from posenc.experiments.study import hf_study

    model_dir = save_tiny_llama(tmp_path / "tiny-llama", 64)
    monkeypatch.setattr(hf_study, "load_model", lambda ref: (_ for _ in ()).throw(AssertionError("loaded")))
    with pytest.raises(ValueError, match=r"--longppl scores perplexity windows: give --task text or text-lm"):
        hf_study.run_study(model_dir, tmp_path / "out", task="text-passkey", longppl=True)
    with pytest.raises(
        ValueError, match=r"--longppl: --eval-len 20 is no longer than LongPPL's short context"
    ):
        hf_study.run_study(model_dir, tmp_path / "out", task="text-lm", eval_len=20, longppl=True)


def test_the_command_refuses_longppl_without_a_study(tmp_path):
    from typer.testing import CliRunner

    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    result = CliRunner().invoke(
        app, ["extrapolate", "--longppl", "--out", str(tmp_path / "o"), "--no-progress"]
    )
    text = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and "--longppl applies to --hf-model with --task text" in text
    assert not (tmp_path / "o").exists()


@pytest.mark.hf
def test_submit_passes_longppl_to_its_array_tasks(tmp_path):
    pytest.importorskip("tokenizers")
    from typer.testing import CliRunner

    from _tiny_hf import TEXT, save_tiny_llama
    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    model_dir = save_tiny_llama(tmp_path / "tiny-llama", 64)
    (tmp_path / "corpus.txt").write_text(TEXT * 40)
    base = ["submit", "--hf-model", str(model_dir), "--corpus", str(tmp_path / "corpus.txt"), "--dry-run"]
    with_it = CliRunner().invoke(app, [*base, "--task", "text-lm", "--longppl", "--out", str(tmp_path / "a")])
    assert with_it.exit_code == 0, with_it.output
    assert "--longppl" in (tmp_path / "a" / "slurm" / "array.sh").read_text()
    without = CliRunner().invoke(app, [*base, "--task", "text-lm", "--out", str(tmp_path / "b")])
    assert without.exit_code == 0 and "--longppl" not in (tmp_path / "b" / "slurm" / "array.sh").read_text()
