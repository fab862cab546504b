"""``posenc bench``: run the speed/memory benchmarks of :mod:`posenc.benchmarks`, print markdown tables.

The benchmarks ship in the package, so the installed command works from any directory; the
baselines they compare with (HF transformers, x-transformers, rotary-embedding-torch) are the
``bench`` extra. Each selected benchmark runs as ``python -m posenc.benchmarks.<module>`` in a
subprocess so that one benchmark's memory does not affect the next.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer

from posenc.cli.app import app, console

#: The modules' home: ``python -m PACKAGE.<module>`` runs a benchmark.
PACKAGE = "posenc.benchmarks"

#: benchmark name -> (module of :data:`PACKAGE`, default arguments, what it measures)
BENCHMARKS: dict[str, tuple[str, list[str], str]] = {
    "bias": (
        "bench_bias",
        [],
        "T5/ALiBi bias attention: posenc auto (rows name its backend) vs SDPA floor, HF T5, x-transformers, seed",
    ),
    "alibi": (
        "bench_bias",
        ["--encoding", "alibi"],
        "ALiBi: posenc auto (rows name its backend) vs SDPA floor and x-transformers",
    ),
    "shaw": ("bench_shaw", [], "Shaw k=16 key+value: posenc vs eager floor and the seed's (L,L,d) einsum"),
    "masks": (
        "bench_masks",
        [],
        "sliding window, packed documents and sinks vs full causal attention; bidirectional window vs dense-mask SDPA",
    ),
    "split": (
        "bench_split",
        [],
        "exact splits: near/far for T5 and ALiBi, mask segments for windows and documents, vs SDPA floor",
    ),
    "piecewise": (
        "bench_piecewise",
        [],
        "Self-Extend, ReRoPE, Leaky ReRoPE, DCA at 4k and 16k: piecewise tiles vs causal SDPA, relative, reference form",
    ),
    "rope": (
        "bench_rope",
        [],
        "RoPE on q,k (4,32,2048,128): fused kernel vs HF and rotary-embedding-torch",
    ),
    "families": (
        "bench_families",
        [],
        "HoPE, FoPE, ComRoPE, LieRE, STRING, GRAPE, GRAPE-A, PaTH, M-RoPE: auto vs eager at 2048 and 8192, 1 thread",
    ),
    "hf": (
        "decoding.bench_hf",
        [],
        "HF eager / sdpa vs attn_implementation='posenc' on HF's masks; BLOOM and T5 via use_posenc_attention"
        " (Gemma-3-270M prefill: --args '--tables gemma3'; SmolLM2-135M generate: --args '--tables smollm2')",
    ),
    "decode": (
        "decoding.bench_decode",
        [],
        "decode steps vs the plain loop (growing, preallocated, compiled); HF Llama and TransformerLM generate",
    ),
    "compile": (
        "decoding.bench_compile",
        [],
        "HF generate with a static cache and torch.compile: sdpa vs attn_implementation='posenc' (and eager)",
    ),
    "denormals": (
        "bench_denormals",
        [],
        "ALiBi, a bias far below the row maximum: denormals flushed (posenc's scope) and kept, side by side",
    ),
    "study-dtype": (
        "bench_study_dtype",
        [],
        "the study's perplexity forward in float32 and bfloat16 on a fetched model (default smollm2-135m), CPU and ISA named",
    ),
    "gpu": (
        "gpu.bench_gpu",
        [],
        "on a CUDA device: every encoding x backend x dtype against float64 eager, flex vs SDPA, RoPE, HF generate",
    ),
}
#: What ``posenc bench`` runs without names, and what its help says it runs: the three core
#: comparisons (bias attention, Shaw, RoPE), a few minutes on a laptop. The others are slower or
#: need more (HF models, a CUDA device): name them.
DEFAULT_BENCHMARKS: tuple[str, ...] = ("bias", "shaw", "rope")

QUICK_ARGS: dict[str, list[str]] = {
    "bias": ["--sizes", "512,1024", "--repeats", "2", "--no-memory"],
    "alibi": ["--sizes", "512,1024", "--repeats", "2", "--no-memory"],
    "shaw": ["--sizes", "512,1024", "--long", "", "--repeats", "2", "--no-memory"],
    "rope": ["--shape", "2,8,1024,128", "--repeats", "3", "--no-compile"],
    "masks": ["--sizes", "1024", "--window", "128", "--repeats", "2", "--no-memory"],
    "hf": ["--sizes", "512", "--window", "64", "--repeats", "2"],
    "split": ["--sizes", "1024", "--window", "128", "--repeats", "2"],
    "piecewise": ["--sizes", "1024", "--repeats", "2"],
    "denormals": ["--sizes", "1024", "--repeats", "2"],
    "decode": ["--caches", "256", "--steps", "32", "--repeats", "2", "--new", "16", "--prompt", "32"],
    "families": ["--sizes", "512", "--long", "", "--repeats", "2", "--no-memory"],
    "compile": ["--prompt", "16", "--new", "8", "--repeats", "1"],
    "gpu": ["--quick"],
}


@app.command("bench")
def bench(
    names: list[str] = typer.Argument(
        None,
        help=f"benchmarks to run: {', '.join(BENCHMARKS)} (default: {', '.join(DEFAULT_BENCHMARKS)})",
    ),
    quick: bool = typer.Option(False, "--quick", help="small sizes, no memory runs (about a minute)"),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="also write the markdown tables to this file"
    ),
    threads: int | None = typer.Option(None, "--threads", help="torch threads (default: torch's default)"),
    extra: str = typer.Option("", "--args", help="extra arguments passed to every benchmark script"),
) -> None:
    """Run benchmarks side by side with their baselines; print ratios as markdown tables."""
    selected = names or list(DEFAULT_BENCHMARKS)
    unknown = [n for n in selected if n not in BENCHMARKS]
    if unknown:
        raise typer.BadParameter(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    tables = []
    for name in selected:
        module, defaults, what = BENCHMARKS[name]
        args = list(defaults) + (QUICK_ARGS[name] if quick else []) + (extra.split() if extra else [])
        if threads:
            args += ["--threads", str(threads)]
        console.print(f"[bold]{name}[/bold]: {what}")
        done = subprocess.run(
            [sys.executable, "-m", f"{PACKAGE}.{module}", *args], capture_output=True, text=True
        )
        if done.returncode != 0:
            hint = (
                '\n(a baseline is missing: pip install "posenc[bench]")'
                if "ModuleNotFoundError" in done.stderr
                else ""
            )
            console.print(f"[red]{name} failed[/red]:")
            console.print(done.stderr[-3000:] + hint, markup=False, highlight=False)
            raise typer.Exit(1)
        typer.echo(done.stdout)
        tables.append(done.stdout.strip())
    if output is not None:
        output.write_text("\n\n".join(tables) + "\n")
        console.print(f"wrote {output}")
