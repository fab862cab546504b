"""``posenc study MODEL``: the context-extension study of a trained model, in its own words
(:class:`posenc.experiments.study.config.StudyConfig`); ``extrapolate --hf-model`` with a study task
still runs it, with a message naming this command."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from .app import app, console, print_error, print_line
from .output import ProgressBars, print_table, quiet_hf_progress, rich_table

__all__ = ["DTYPE_HELP", "STUDY_MOVED", "TUNING_WINDOWS_HELP", "in_study_words", "run_and_print", "study"]

#: What ``extrapolate --hf-model`` with a study task (and ``submit --hf-model``) says: the study has
#: its own command and words now; this form keeps working.
STUDY_MOVED = (
    "the context-extension study is `posenc study MODEL` now (--windows for --eval-examples, --variants for "
    "--eval-variants, --tasks for --task); `extrapolate --hf-model` keeps running it"
)

#: ``--tuning-windows``' help (``posenc study``, ``extrapolate`` and ``submit``).
TUNING_WINDOWS_HELP = (
    "--hf-model study with a grid in --eval-variants (self_extend:group_size=2|4|8): K of the --eval-examples "
    "windows, drawn with the seed before any score, choose each grid's setting; every reported number and "
    "paired test reads the other windows (at least 2)"
)


#: ``--dtype``' help (``posenc study``, ``extrapolate`` and ``submit``).
DTYPE_HELP = (
    "--hf-model study: the precision of the model's weights and activations, float32 (exact, the default), "
    "bfloat16 or float16; the NLL is taken in float32 and the rotary tables stay float32"
)

#: The study's checks name the options of ``extrapolate --hf-model``, which ran it first; this command's
#: own names for the same options.
STUDY_WORDS = {
    "--eval-variants": "--variants",
    "--eval-examples": "--windows",
    "--task ": "--tasks ",
    "--seeds": "--seed",
}


def in_study_words(message: str) -> str:
    """``message`` with the options named as ``posenc study`` names them."""
    for old, new in STUDY_WORDS.items():
        message = message.replace(old, new)
    return message


@app.command("study")
def study(
    model: str = typer.Argument(
        ..., help="a fetched model's name (posenc models), a .gguf file, an HF folder, or a hub id (org/name)"
    ),
    tasks: str = typer.Option(
        "text", help="text (perplexity and the passkey), text-lm, text-passkey or text-multikey"
    ),
    variants: str = typer.Option(
        "none",
        help="ways past the context: none, linear, ntk, dynamic, yarn[:F], self_extend, rerope, leaky_rerope, "
        "string_shift, dca, dpe "
        "(METHOD:OPTION=VALUE,...; OPTION=A|B is a grid chosen on --tuning-windows)",
    ),
    eval_len: int | None = typer.Option(None, help="perplexity windows' length in tokens (default 2c)"),
    lengths: str | None = typer.Option(None, help="needle prompt lengths (default c/2, c, 1.5c, 2c)"),
    depths: str | None = typer.Option(None, help="needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)"),
    windows: int = typer.Option(1, min=1, help="perplexity windows, evenly spaced over the corpus"),
    trials: int | None = typer.Option(
        None, min=1, help="needle prompts per (length, depth) cell (default --windows)"
    ),
    tuning_windows: int = typer.Option(
        0, min=0, help=in_study_words(TUNING_WINDOWS_HELP).replace("--hf-model study with a grid", "A grid")
    ),
    dtype: str = typer.Option("float32", help=in_study_words(DTYPE_HELP).replace("--hf-model study: t", "T")),
    seed: int = typer.Option(0, help="draws the needles' keys and the tuning windows"),
    corpus: str | None = typer.Option(
        None, help="evaluation text: a file, or python-reference (the default)"
    ),
    longppl: bool = typer.Option(False, "--longppl", help="also LongPPL, the model its own evaluator"),
    out: Path | None = typer.Option(
        None, help="the study folder (default runs/study/<model>); a rerun resumes"
    ),
    shard: str | None = typer.Option(
        None, help="i/n: run every n-th (variant, length) unit; posenc merge joins"
    ),
    threads: int | None = typer.Option(None, min=1, help="torch threads (default: torch's own, every core)"),
    device: str = typer.Option("cpu", help="cpu, cuda or auto"),
    progress: bool = typer.Option(True, help="show progress bars"),
) -> None:
    """Score a trained model past its context under each variant, on the same windows and prompts,
    and decide between them with paired tests (the verdict table first, then perplexity by position
    and retrieval by length); writes results.jsonl, comparisons.jsonl, config.json and figures."""
    from ..experiments.study.config import StudyConfig, split_items, variant_items

    try:
        config = StudyConfig(
            model=model,
            tasks=tasks,
            variants=variant_items(variants),
            eval_len=eval_len,
            lengths=split_items(lengths, int, "--lengths"),
            depths=split_items(depths, float, "--depths"),
            windows=windows,
            trials=trials,
            tuning_windows=tuning_windows,
            dtype=dtype,
            seed=seed,
            corpus=corpus,
            longppl=longppl,
        )
    except ValueError as err:
        print_error(in_study_words(str(err)))
        raise typer.Exit(2) from err
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    with quiet_hf_progress():
        run_and_print(
            str(config.model),
            config.run_options(),
            out or config.default_out(),
            device,
            progress,
            shard,
            in_study_words,
        )


def run_and_print(
    model: str,
    options: dict[str, Any],
    out: Path,
    device: str,
    progress: bool,
    shard: str | None,
    words: Callable[[str], str] = str,
) -> None:
    """Run (or resume) the study of ``model`` into ``out`` (``options``:
    :func:`~posenc.experiments.study.hf_study.run_study`'s) and print its verdict and its table; a
    bad option or file ends the command with its message in the command's ``words`` (exit 2)."""
    from ..experiments.cluster.shards import parse_shard
    from ..experiments.study.hf_study import run_study, study_summary
    from ..experiments.study.reading import verdict_table
    from ..viz.folder import write_figures

    try:
        with ProgressBars(console, progress) as bars:
            records, settings = run_study(
                model,
                out,
                **options,
                shard=None if shard is None else parse_shard(shard),
                device=device,
                report=bars.report,
                log=bars.log,
                figures=write_figures,
            )
    except (ValueError, FileNotFoundError) as err:
        print_error(words(str(err)))
        raise typer.Exit(2) from err
    verdict = verdict_table(settings, records)
    if verdict is not None:
        print_table(rich_table(verdict))
    print_table(rich_table(study_summary(settings, records)))
    print_line(f"results: {out / 'results.jsonl'}, {out / 'comparisons.jsonl'}, {out / 'extrapolation.png'}")
