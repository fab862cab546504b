"""The HF benchmark (posenc.benchmarks.decoding.bench_hf) on tiny random models: the three implementations timed on
each mask, T5 stacks three ways, and the Gemma 3 table's rows agreeing."""

from __future__ import annotations

import pytest


@pytest.mark.hf
def test_hf_bench_times_the_three_implementations_on_each_mask(capsys, monkeypatch):
    from posenc.benchmarks.decoding import bench_hf

    monkeypatch.setattr(
        "sys.argv", ["bench_hf", "--sizes", "32", "--window", "8", "--documents", "2", "--repeats", "1"]
    )
    bench_hf.main()
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| 32 |")]
    # (fwd, fwd+bwd) x (full causal, window 8, 2 documents), then BLOOM's fwd and fwd+bwd
    assert len(rows) == 8
    assert all(row.count("ms") >= 3 and row.count("×") == 2 for row in rows[:6])
    assert all(row.count("ms") >= 2 and row.count("×") == 1 for row in rows[6:])


@pytest.mark.hf
def test_hf_bench_times_t5_stacks_three_ways(capsys, monkeypatch):
    from posenc.benchmarks.decoding import bench_hf

    monkeypatch.setattr("sys.argv", ["bench_hf", "--sizes", "40", "--repeats", "1", "--tables", "t5"])
    bench_hf.main()
    table = capsys.readouterr().out
    assert "BLOOM" not in table and "Mistral" not in table
    for stack in ("encoder", "decoder (causal)"):
        rows = [line for line in table.splitlines() if line.startswith(f"| {stack} | 40 |")]
        assert [row.split(" | ")[2] for row in rows] == ["fwd", "fwd+bwd"]  # HF eager, HF sdpa, posenc
        assert all(row.count("ms") >= 3 and row.count("×") == 2 for row in rows)
    monkeypatch.setattr("sys.argv", ["bench_hf", "--tables", "t5,gpt2"])
    with pytest.raises(SystemExit):
        bench_hf.main()
    assert "unknown ['gpt2']" in capsys.readouterr().err


@pytest.mark.hf
def test_hf_bench_gemma3_table_rows_agree_on_a_tiny_random_gemma3(tmp_path, capsys, monkeypatch):
    """The Gemma-3 prefill table's plumbing (not its timing), in this process: a tiny random Gemma 3
    saved by HF gives one row per size, the two implementations' logits agree, and posenc's backends
    are listed per layer; without the model the table is skipped, naming the fetch command."""
    import torch
    import transformers

    from posenc.benchmarks.decoding import bench_hf

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    transformers.Gemma3ForCausalLM(config).save_pretrained(tmp_path / "tiny")
    rows = bench_hf.gemma3_rows(tmp_path / "tiny", [96, 80], 2, 1, run=bench_hf.gemma3_case)
    assert [row[0] for row in rows] == ["96", "80"]
    for row in rows:
        assert row[1].endswith(" s") and row[2].endswith(" s") and row[3].endswith("×")
        assert float(row[4]) < 1e-4  # max abs logit difference, float32
        counts = [int(part.rsplit("×", 1)[1]) for part in row[7].split(", ")]
        assert sum(counts) == 2  # one backend per layer ("sdpa ×2": the dispatcher's pick at this size)
    monkeypatch.setenv("POSENC_MODELS", str(tmp_path / "empty"))
    monkeypatch.setattr("sys.argv", ["bench_hf", "--tables", "gemma3"])
    bench_hf.main()
    out = capsys.readouterr().out
    assert "skipped" in out and "`posenc models fetch gemma3-270m`" in out
