"""The study's precision bench (posenc.benchmarks.bench_study_dtype) on a tiny random Llama: each row's
float32 NLL is HF's own loss on the window, bfloat16's is near it, the ratio is the two medians', and
the command prints the CPU with its ISA above the table."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

pytestmark = pytest.mark.hf


def test_the_rows_are_hfs_loss_in_float32_and_near_it_in_bfloat16(tmp_path, capsys):
    from _tiny_hf import save_tiny_llama
    from posenc.benchmarks.bench_study_dtype import main, measure
    from posenc.pretrained.loading import load

    folder = save_tiny_llama(tmp_path / "tiny-llama", 64)
    model, _ = load(folder)
    ids = torch.randint(0, 300, (200,))
    [row] = measure(model, ids, [96], repeats=2)
    with torch.no_grad():
        loss = float(model(input_ids=ids[None, :96], labels=ids[None, :96]).loss)
    assert row["nll_float32"] == pytest.approx(loss, rel=1e-5)
    assert abs(row["nll_diff"]) < 0.05 and row["nll_diff"] == row["nll_bfloat16"] - row["nll_float32"]
    assert row["ratio"] == pytest.approx(row["float32_s"] / row["bfloat16_s"])
    assert next(model.parameters()).dtype == torch.float32  # the float32 model was not cast in place
    main(["--model", str(folder), "--lengths", "64", "--repeats", "1"])
    printed = capsys.readouterr().out
    from posenc.experiments.study.precision import cpu_description

    assert (
        printed.startswith(cpu_description()["cpu"]) and "f32/bf16" in printed and "peak resident" in printed
    )
