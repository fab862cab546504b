"""The cost of a study's forward by precision: the study's own perplexity forward
(:func:`posenc.experiments.tasks.text.position_nll`) of one window of ``L`` tokens in float32 and in
bfloat16 (:func:`posenc.experiments.study.precision.cast_weights`: rotary tables kept float32), on
the same model and tokens, in one process, interleaved (float32, bfloat16, float32, ...).

Reported per length: the median seconds of each and the ratio float32 / bfloat16 (> 1: bfloat16 is
faster), peak resident memory, and the mean NLL of the window in each precision with their
difference; the CPU and its ISA head the table (AMX and AVX-512 BF16 decide bfloat16's speed).

    python -m posenc.benchmarks.bench_study_dtype --model smollm2-135m --lengths 2048,4096 --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import time

import torch

from ..experiments.study.precision import cast_weights, cpu_description
from ..experiments.tasks.text import position_nll


def _timed(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    start = time.perf_counter()
    nll = position_nll(model, ids)
    return time.perf_counter() - start, float(nll.mean())


def measure(
    model: torch.nn.Module, ids: torch.Tensor, lengths: list[int], repeats: int
) -> list[dict[str, float]]:
    """One row per length: float32 and bfloat16 median seconds, their ratio, each NLL and the difference."""
    exact = model.eval()
    half = cast_weights(copy.deepcopy(model), torch.device("cpu"), torch.bfloat16).eval()
    rows = []
    for length in lengths:
        window = ids[None, :length]
        times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
        nll: dict[str, float] = {}
        for _ in range(repeats):
            for name, net in (("float32", exact), ("bfloat16", half)):
                seconds, nll[name] = _timed(net, window)
                times[name].append(seconds)
        f32, bf16 = statistics.median(times["float32"]), statistics.median(times["bfloat16"])
        rows.append(
            {
                "length": length,
                "float32_s": f32,
                "bfloat16_s": bf16,
                "ratio": f32 / bf16,
                "nll_float32": nll["float32"],
                "nll_bfloat16": nll["bfloat16"],
                "nll_diff": nll["bfloat16"] - nll["float32"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="smollm2-135m", help="a fetched name, a .gguf file or an HF folder"
    )
    parser.add_argument("--lengths", default="2048", help="comma-separated window lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from ..pretrained.loading import load, reference_text

    model, tokenizer = load(args.model)
    lengths = [int(n) for n in args.lengths.split(",")]
    ids = torch.tensor(tokenizer(reference_text(), add_special_tokens=False)["input_ids"])
    if len(ids) < max(lengths):
        raise SystemExit(f"--lengths: the reference text has {len(ids)} tokens, fewer than {max(lengths)}")
    machine = cpu_description()
    print(
        f"{machine['cpu']} ({', '.join(machine['isa']) or 'no AVX-512 or AMX'}; torch {torch.__version__}, "
        f"capability {machine['torch_cpu_capability']}, {torch.get_num_threads()} threads), model {args.model}"
    )
    print("length  float32 s  bfloat16 s  f32/bf16  NLL f32  NLL bf16  bf16 - f32")
    for row in measure(model, ids, lengths, args.repeats):
        print(
            f"{row['length']:>6}  {row['float32_s']:>9.3f}  {row['bfloat16_s']:>10.3f}  {row['ratio']:>7.2f}x  "
            f"{row['nll_float32']:>7.4f}  {row['nll_bfloat16']:>8.4f}  {row['nll_diff']:>+10.4f}"
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak resident memory: {peak:.0f} MiB")


if __name__ == "__main__":
    main()
