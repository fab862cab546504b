"""The masks benchmark (posenc.benchmarks.bench_masks): its dense baseline is the bidirectional window, and
it prints the window's row."""

from __future__ import annotations

import pytest


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
