"""``posenc bench``: run the speed/memory benchmarks in ``benchmarks/`` and print markdown tables.

The benchmark scripts live in the repository's ``benchmarks/`` folder (they import baselines such as
HF transformers, x-transformers and rotary-embedding-torch that the library itself does not need).
This command finds that folder next to the source tree, or where ``--dir`` points, and runs each
selected benchmark in a subprocess so that one benchmark's memory does not affect the next.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import typer

from posenc.cli import app, console

#: benchmark name -> (script, default arguments, what it measures)
BENCHMARKS: dict[str, tuple[str, list[str], str]] = {
    "bias": (
        "bench_bias.py",
        [],
        "T5/ALiBi bias attention: blocked backend vs SDPA floor, HF T5, x-transformers, seed",
    ),
    "alibi": (
        "bench_bias.py",
        ["--encoding", "alibi"],
        "ALiBi: blocked backend vs SDPA floor and x-transformers",
    ),
    "shaw": ("bench_shaw.py", [], "Shaw k=16 key+value: posenc vs eager floor and the seed's (L,L,d) einsum"),
    "rope": (
        "bench_rope.py",
        [],
        "RoPE on q,k (4,32,2048,128): fused kernel vs HF and rotary-embedding-torch",
    ),
}
QUICK_ARGS: dict[str, list[str]] = {
    "bias": ["--sizes", "512,1024", "--repeats", "2", "--no-memory"],
    "alibi": ["--sizes", "512,1024", "--repeats", "2", "--no-memory"],
    "shaw": ["--sizes", "512,1024", "--long", "", "--repeats", "2", "--no-memory"],
    "rope": ["--shape", "2,8,1024,128", "--repeats", "3", "--no-compile"],
}


def _benchmarks_dir(given: Path | None) -> Path:
    candidates = (
        [given] if given else [Path.cwd() / "benchmarks", Path(__file__).resolve().parents[2] / "benchmarks"]
    )
    for candidate in candidates:
        if candidate is not None and (candidate / "_harness.py").is_file():
            return candidate
    raise typer.BadParameter(
        "cannot find the benchmarks/ folder (it ships with the source repository, not the wheel); "
        "run from the repository root or pass --dir",
        param_hint="--dir",
    )


@app.command("bench")
def bench(
    names: list[str] = typer.Argument(
        None, help=f"benchmarks to run: {', '.join(BENCHMARKS)} (default: all)"
    ),
    quick: bool = typer.Option(False, "--quick", help="small sizes, no memory runs (about a minute)"),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="also write the markdown tables to this file"
    ),
    threads: int | None = typer.Option(None, "--threads", help="torch threads (default: torch's default)"),
    directory: Path | None = typer.Option(None, "--dir", help="the benchmarks/ folder"),
    extra: str = typer.Option("", "--args", help="extra arguments passed to every benchmark script"),
) -> None:
    """Run benchmarks side by side with their baselines; print ratios as markdown tables."""
    selected = names or ["bias", "shaw", "rope"]
    unknown = [n for n in selected if n not in BENCHMARKS]
    if unknown:
        raise typer.BadParameter(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    folder = _benchmarks_dir(directory)
    tables = []
    for name in selected:
        script, defaults, what = BENCHMARKS[name]
        args = list(defaults) + (QUICK_ARGS[name] if quick else []) + (extra.split() if extra else [])
        if threads:
            args += ["--threads", str(threads)]
        console.print(f"[bold]{name}[/bold]: {what}")
        env = dict(os.environ, PYTHONPATH=str(folder) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        done = subprocess.run(
            [sys.executable, str(folder / script), *args], capture_output=True, text=True, env=env
        )
        if done.returncode != 0:
            console.print(f"[red]{name} failed[/red]:\n{done.stderr[-3000:]}")
            raise typer.Exit(1)
        typer.echo(done.stdout)
        tables.append(done.stdout.strip())
    if output is not None:
        output.write_text("\n\n".join(tables) + "\n")
        console.print(f"wrote {output}")
