"""``posenc bench`` works from any directory: the benchmarks ship in the package (``posenc.benchmarks``)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import posenc.benchmarks

POSENC = str(Path(sys.executable).with_name("posenc"))


def _run_outside_checkout(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [POSENC, *args],
        cwd=tmp_path,
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_benchmark_module_imports():
    modules = [info.name for info in pkgutil.iter_modules(posenc.benchmarks.__path__)]
    assert {"_harness", "bench_bias", "bench_rope", "bench_shaw", "bench_train_speed"} <= set(modules)
    for name in modules:
        module = importlib.import_module(f"posenc.benchmarks.{name}")
        if name.startswith("bench_"):
            assert callable(module.main), f"{name} has no main()"


def test_bench_help_outside_the_checkout(tmp_path):
    done = _run_outside_checkout(tmp_path, "bench", "--help")
    assert done.returncode == 0, done.stderr
    for name in ("bias", "shaw", "rope"):
        assert name in done.stdout


def test_tiny_bench_runs_outside_the_checkout(tmp_path):
    out = tmp_path / "tables.md"
    done = _run_outside_checkout(
        tmp_path, "bench", "rope", "--args", "--shape 1,2,16,8 --repeats 1 --no-compile", "-o", str(out)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    table = out.read_text()
    assert "RoPE on q and k (1, 2, 16, 8)" in table
    assert "| posenc apply_rotary (out of place) |" in table and "| HF apply_rotary_pos_emb |" in table


@pytest.mark.hf
def test_hf_bench_times_the_three_implementations_on_each_mask(capsys, monkeypatch):
    from posenc.benchmarks import bench_hf

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
    from posenc.benchmarks import bench_hf

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

    from posenc.benchmarks import bench_hf

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


def test_split_bench_prints_its_rows():
    done = subprocess.run(
        [sys.executable, "-m", "posenc.benchmarks.bench_split", "--sizes", "300", "--repeats", "1",
         "--encodings", "alibi causal", "--window", "64", "--documents", "3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for row in (
        "| alibi causal | 300 | fwd+bwd | split (auto now) |",
        "| window (64) | 300 | fwd |",
        "| documents (3) |",
    ):
        assert row in done.stdout, done.stdout


@pytest.mark.hf
def test_decode_bench_prints_the_step_split_and_generation_tables(capsys, monkeypatch):
    from posenc.benchmarks import bench_decode

    monkeypatch.setattr(
        "sys.argv",
        [
            "bench_decode",
            "--caches",
            "16",
            "--steps",
            "3",
            "--repeats",
            "1",
            "--prompt",
            "4",
            "--new",
            "3",
            "--no-compile",
        ],
    )
    bench_decode.main()
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("| 16 |")]
    assert [row.split("|")[2].strip() for row in steps] == [
        "plain loop",
        "posenc KVCache()",
        "posenc KVCache(max_length)",
    ]
    split = {row.split("|")[1].strip(): row for row in out.splitlines() if "µs |" in row and "%" in row}
    parts = {
        "cache check (writer, batch, device)",
        "cache write (in place)",
        "nan test (q, new key and value)",
    }
    parts |= {"projections q, k, v", "rotation (RoPE)", "kernel (sdpa)", "one step, all of it"}
    assert parts <= set(split)
    generation = [
        line for line in out.splitlines() if line.startswith(("| HF Llama", "| posenc TransformerLM"))
    ]
    assert len(generation) == 4 and all("×" in row for row in generation)


class _Parsed(Exception):
    """Raised in place of running a benchmark once its arguments are parsed."""


@pytest.mark.parametrize("name", sorted(__import__("posenc.cli.bench", fromlist=["BENCHMARKS"]).BENCHMARKS))
def test_every_bench_takes_threads_and_sets_them(name, monkeypatch):
    """``posenc bench NAME --threads N`` passes ``--threads N`` to the script: each must accept it and
    set torch's threads before timing anything."""
    import argparse

    import torch

    from posenc.cli.bench import BENCHMARKS

    module = importlib.import_module(f"posenc.benchmarks.{BENCHMARKS[name][0]}")
    parse = argparse.ArgumentParser.parse_args
    threads: list[int] = []

    def parse_then_stop(self, args=None, namespace=None):
        parsed = parse(self, args, namespace)
        threads.append(parsed.threads)
        return parsed

    def stop(count: int) -> None:  # the first call after parsing: record it, stop the run
        raise _Parsed(count)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(torch, "set_num_threads", stop)
    monkeypatch.setattr(sys, "argv", [name, *BENCHMARKS[name][1], "--threads", "3"])
    with pytest.raises(_Parsed) as stopped:
        module.main()
    assert threads == [3] and stopped.value.args == (3,)


def test_masks_bench_dense_baseline_is_the_bidirectional_window():
    """The bidirectional-window row's baseline (the layer on SDPA with a dense bool ``attn_mask``)
    computes what the windowed layer computes, on a size where ``auto`` picks a window backend."""
    import torch

    from posenc.benchmarks import bench_masks

    length, window = 256, 16
    rule = torch.tensor([[abs(i - j) < window for j in range(length)] for i in range(length)])
    assert torch.equal(bench_masks.band_mask(length, window), rule[None, None])
    windowed = bench_masks._layer(causal=False, window=window)
    dense = bench_masks._layer(causal=False, backend="sdpa")
    x = torch.randn(1, length, bench_masks.EMBED, requires_grad=True)
    out = windowed(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    expected = dense(x, attn_mask=rule[None, None])
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    assert windowed.last_backend != "sdpa" and dense.last_backend == "sdpa"
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)


def test_masks_bench_prints_the_bidirectional_window_row(capsys, monkeypatch):
    from posenc.benchmarks import bench_masks

    argv = ["bench_masks", "--sizes", "256", "--window", "32", "--repeats", "1", "--threads", "1"]
    monkeypatch.setattr("sys.argv", [*argv, "--bidirectional-window", "16", "--patterns", "bidirectional"])
    bench_masks.main()
    out = capsys.readouterr().out
    assert "full causal" not in out  # only the asked-for table
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 256 |")]
    assert [row[1] for row in rows] == ["fwd", "fwd+bwd"]
    assert all(row[2].startswith("window 16 (") and "sdpa" not in row[2] for row in rows)
    assert all(row[3].count("ms") == 3 and row[4].count("ms") == 3 and row[5].endswith("×") for row in rows)
    assert rows[0][6:] == ["—", "— |"] and all(cell.split()[1] == "MiB" for cell in rows[1][6:])

    monkeypatch.setattr("sys.argv", [*argv, "--no-memory"])  # default patterns: both tables
    bench_masks.main()
    out = capsys.readouterr().out
    patterns = [
        line.split(" | ")[2].split(" (")[0] for line in out.splitlines() if line.startswith("| 256 |")
    ]
    assert patterns == ["window 32", "8 documents", "sinks"] * 2 + ["window 256"] * 2
    monkeypatch.setattr("sys.argv", [*argv, "--patterns", "window,bidirectionl"])
    with pytest.raises(SystemExit):
        bench_masks.main()
    assert "unknown ['bidirectionl']" in capsys.readouterr().err
