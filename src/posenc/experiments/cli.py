"""``posenc extrapolate``: train at short lengths, evaluate at longer ones, for several encodings."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..cli import app, console, print_error, print_line
from .shards import parse_shard
from .tasks import TASKS
from .train import ExperimentConfig

if TYPE_CHECKING:
    from .runner import SummaryTable

_DEFAULT = ExperimentConfig()


def _eval_positions(value: str) -> bool:
    """``--eval-positions``: True for random (drawn like training's), False for contiguous 0..n-1."""
    choices = {"random": True, "contiguous": False}
    if value not in choices:
        raise typer.BadParameter(
            f"must be random or contiguous, got {value!r}", param_hint="--eval-positions"
        )
    return choices[value]


def split_specs(text: str) -> list[str]:
    """Split ``"nope,rope:base=500000,pairing=half,alibi"`` into specs.

    An item of the form ``key=value`` (no ``:``) continues the previous spec's options.
    """
    specs: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item.split("=")[0] and specs:
            specs[-1] += ("," if ":" in specs[-1] else ":") + item
        else:
            specs.append(item)
    return specs


class _ProgressBars:
    """Rich progress bars for :func:`~posenc.experiments.run_experiment`'s callbacks: one bar for
    training and one for evaluation per run; log lines printed above them."""

    def __init__(self, console: Console, enabled: bool) -> None:
        self.enabled = enabled
        self.bars: dict[tuple[str, str], Any] = {}
        self.progress = Progress(
            TextColumn("{task.description:<28}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[note]}"),
            console=console,
            disable=not enabled,
        )

    def __enter__(self) -> _ProgressBars:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def log(self, message: str) -> None:
        self.progress.console.print(message, style="cyan", markup=False, highlight=False, soft_wrap=True)

    def report(self, label: str, phase: str, done: int, total: int, note: str) -> None:
        if not self.enabled:
            return
        key = (label, phase)
        if key not in self.bars:
            self.bars[key] = self.progress.add_task(f"{phase:<5} {label}", total=total, note=note)
        self.progress.update(self.bars[key], completed=done, total=total, note=note)


def print_table(table: Table) -> None:
    """Print ``table``; into a file or pipe at its natural width (nothing there wraps lines), on a
    terminal at the terminal's."""
    width = None
    if not console.is_terminal:
        width = max(console.width, console.measure(table).maximum)
    console.print(table, width=width, crop=width is None)


def rich_table(summary: SummaryTable) -> Table:
    """A :class:`~posenc.experiments.runner.SummaryTable` as a Rich table (numbers right-aligned)."""
    table = Table(title=summary.title, caption="\n".join(summary.notes) or None, caption_justify="left")
    names = max((len(row[0]) for row in summary.rows), default=0)
    for index, column in enumerate(summary.columns):
        if index == 0:  # encoding names stay whole; the number columns wrap their headers instead
            table.add_column(column, justify="left", min_width=min(names, 40))
        else:
            table.add_column(column, justify="right")
    for row in summary.rows:
        table.add_row(*row)
    return table


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError as err:
        raise typer.BadParameter(f"{option} must be comma-separated integers, got {text!r}") from err


@app.command("extrapolate")
def extrapolate(
    ctx: typer.Context,
    task: str = typer.Option(_DEFAULT.task, help=f"task: {', '.join(TASKS)}"),
    encodings: str = typer.Option(
        ",".join(_DEFAULT.encodings),
        help="comma-separated encoding specs, options included: nope,rope:base=500000,pairing=half,alibi; "
        "a hybrid gives one spec per layer joined by '/': t5/sinusoidal; a layer preset with its "
        "options: gemma3:window=8, llama4:chunk=8, smollm3, gpt-oss:window=8",
    ),
    train_len: int = typer.Option(
        _DEFAULT.train_len, help="largest training length L (task size; lm: context length)"
    ),
    eval_len: int = typer.Option(_DEFAULT.eval_len, help="evaluate every length 1..eval_len"),
    min_train_len: int = typer.Option(_DEFAULT.min_train_len, help="smallest training length"),
    steps: int = typer.Option(_DEFAULT.steps, help="training steps per run"),
    seeds: str = typer.Option(",".join(map(str, _DEFAULT.seeds)), help="comma-separated seeds"),
    out: Path = typer.Option(
        Path("runs/extrapolate"), help="results folder (re-run the same command to resume)"
    ),
    batch_size: int = typer.Option(_DEFAULT.batch_size),
    lr: float = typer.Option(_DEFAULT.lr, help="peak AdamW learning rate (warm-up, then cosine to 10%)"),
    d_model: int = typer.Option(_DEFAULT.d_model),
    num_layers: int = typer.Option(_DEFAULT.num_layers),
    num_heads: int = typer.Option(_DEFAULT.num_heads),
    d_ff: int = typer.Option(_DEFAULT.d_ff),
    dropout: float = typer.Option(_DEFAULT.dropout),
    num_symbols: int = typer.Option(_DEFAULT.num_symbols, help="alphabet size of the synthetic tasks"),
    distinct: bool = typer.Option(_DEFAULT.distinct, help="copy/reverse/sort: draw distinct symbols"),
    corpus: Path | None = typer.Option(None, help="lm: a text file (default: the stdlib argparse source)"),
    eval_examples: int = typer.Option(
        _DEFAULT.eval_examples, help="examples per evaluated length (lm: windows)"
    ),
    checkpoint_every: int = typer.Option(_DEFAULT.checkpoint_every, help="checkpoint every N steps"),
    backend: str = typer.Option(_DEFAULT.backend, help="attention backend (auto picks per call)"),
    workers: int | None = typer.Option(
        None, help="parallel processes (default: one per CPU core, at most one per run)"
    ),
    threads: int = typer.Option(1, help="torch threads per process"),
    device: str = typer.Option("cpu", help="cpu, cuda or auto"),
    progress: bool = typer.Option(True, help="show progress bars"),
    pack: bool = typer.Option(
        False, help="pack several training examples per row (packed documents: positions restart per example)"
    ),
    randomize_positions: int | None = typer.Option(
        None,
        help="randomized positions (Ruoss et al. 2023): train each sequence at sorted distinct positions "
        "drawn from [0, N)",
    ),
    eval_positions: str = typer.Option(
        "random",
        help="with --randomize-positions: evaluate at positions drawn the same way (random, the paper's "
        "protocol) or at 0..n-1 (contiguous)",
    ),
    fit_threshold: float = typer.Option(
        _DEFAULT.fit_threshold,
        help="a run fits when its exact match over the training lengths reaches this; encodings whose "
        "seeds do not all fit are not ranked",
    ),
    until_fit: bool = typer.Option(
        _DEFAULT.until_fit,
        help="train each run until it fits (checked every --fit-check-every steps on held-out examples) "
        "or --steps run out; the steps it took go into its iid record",
    ),
    fit_check_every: int = typer.Option(
        _DEFAULT.fit_check_every, min=1, help="with --until-fit: steps between two fit checks"
    ),
    hf_model: Path | None = typer.Option(
        None,
        help="evaluate a local HF causal LM folder (save_pretrained) without training, on --task lm or "
        "passkey at lengths 1..--eval-len beyond its max_position_embeddings",
    ),
    eval_variants: str | None = typer.Option(
        None,
        help="evaluate each trained model (or --hf-model) again under these settings, no retraining: "
        "RoPE scalings linear,ntk,dynamic,yarn,longrope (NAME:FACTOR; default eval-len / training length), "
        "prope:P, drop_rotation, temperature:BETA (any encoding); one row each",
    ),
    preset: str | None = typer.Option(
        None,
        help="run a published setup and print the paper's numbers beside ours: nope-paper (Kazemnejad et al. "
        "2023: copy, count_copy, reverse) or alibi-paper (Press et al. 2022: LM perplexity at 2x/4x/8x L); "
        "one folder per task under --out; --steps, --d-model etc. set the scale",
    ),
    shard: str | None = typer.Option(
        None,
        help="i/n: run only the i-th of n disjoint parts of the (encoding x seed) grid (0 <= i < n), e.g. "
        "--shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT; combine the folders with posenc merge",
    ),
) -> None:
    """Length generalization: train each encoding on lengths <= L, score every length up to eval-len.

    Tasks are scored by exact match (teacher-forced argmax equals the target at every output
    position); lm by perplexity at each position. Writes results.jsonl, results.csv, config.json,
    checkpoints/ and extrapolation.png into --out and prints a summary table. Interrupted runs
    resume when the same command is run again. Under `torchrun --nproc_per_node N` each run
    trains with DistributedDataParallel. `--preset NAME` runs a published setup (one folder per
    task) and prints the paper's numbers beside ours; `--shard i/n` runs one part of the grid
    (combine the parts with `posenc merge`).
    """
    from .results import read_run_records
    from .runner import Distributed, ExperimentInterrupted, WorkerDied, run_experiment, summary_table

    if hf_model is not None and (preset is not None or shard is not None):
        print_error("--preset and --shard train models; they do not apply to --hf-model")
        raise typer.Exit(2)
    if hf_model is not None:
        _extrapolate_hf(
            hf_model,
            eval_variants,
            task,
            encodings,
            eval_len,
            seeds,
            out,
            num_symbols,
            corpus,
            eval_examples,
            device,
            progress,
        )
        return
    specs = split_specs(encodings)
    config = ExperimentConfig(
        task=task,
        encodings=specs,
        train_len=train_len,
        eval_len=eval_len,
        min_train_len=min_train_len,
        steps=steps,
        seeds=_int_list(seeds, "--seeds"),
        batch_size=batch_size,
        lr=lr,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        d_ff=d_ff,
        dropout=dropout,
        num_symbols=num_symbols,
        distinct=distinct,
        corpus=None if corpus is None else str(corpus),
        eval_examples=eval_examples,
        eval_batch=min(eval_examples, _DEFAULT.eval_batch),
        checkpoint_every=checkpoint_every,
        backend=backend,
        pack=pack,
        randomize_positions=randomize_positions,
        randomize_eval_positions=_eval_positions(eval_positions) and randomize_positions is not None,
        fit_threshold=fit_threshold,
        until_fit=until_fit,
        fit_check_every=fit_check_every,
        eval_variants=[item.strip() for item in (eval_variants or "").split(",") if item.strip()],
    )
    try:
        part = None if shard is None else parse_shard(shard)
        planned = [(config, out)] if preset is None else _preset_plan(ctx, preset, config, out)
        writer = Distributed.from_env().rank == 0  # under torchrun only rank 0 shows progress and results
        for one, folder in planned:
            with _ProgressBars(console, progress and writer) as bars:
                records = run_experiment(
                    one,
                    folder,
                    workers=workers,
                    threads=threads,
                    device=device,
                    report=bars.report,
                    log=bars.log,
                    shard=part,
                    preset=preset,
                )
            if writer:
                runs = read_run_records(folder)
                print_table(rich_table(summary_table(one, records, one.make_task().metric, runs)))
        if preset is not None and writer:
            from .presets import comparison_for_folder

            print_table(rich_table(comparison_for_folder(planned[0][1])))
    except WorkerDied as err:
        print_error(f"{err}; run the same command again to resume")
        raise typer.Exit(1) from err
    except ExperimentInterrupted as err:
        print_error(f"{err}; run the same command again to resume", label=None, style="yellow")
        raise typer.Exit(130) from err
    except ValueError as err:
        print_error(str(err))
        raise typer.Exit(2) from err


def _preset_plan(
    ctx: typer.Context, name: str, config: ExperimentConfig, out: Path
) -> list[tuple[ExperimentConfig, Path]]:
    """``(config, folder)`` per task of preset ``name`` (``OUT/<task>``), every one checked before
    anything is written: an option given on the command line that contradicts the preset, a bad
    setting, or a folder holding other settings is a ``ValueError``."""
    from .presets import apply_preset
    from .runner import _check_config, check_models

    # By name: typer may bring its own copy of click's ParameterSource enum.
    given = {
        param for param in ctx.params if getattr(ctx.get_parameter_source(param), "name", "") == "COMMANDLINE"
    }
    explicit = {key: getattr(config, key) for key in given if key != "task" and hasattr(config, key)}
    configs = apply_preset(name, config, explicit, task=config.task if "task" in given else None)
    planned = []
    for one in configs:
        one.validate()
        task = one.make_task()
        for length in (one.train_len, one.eval_len):
            task.check_length(length)
        check_models(one, task)
        _check_config(out / one.task, one, task)
        planned.append((one, out / one.task))
    return planned


def _extrapolate_hf(
    hf_model: Path,
    eval_variants: str | None,
    task: str,
    encodings: str,
    eval_len: int,
    seeds: str,
    out: Path,
    num_symbols: int,
    corpus: Path | None,
    eval_examples: int,
    device: str,
    progress: bool,
) -> None:
    """``--hf-model``: evaluate a local HF causal LM (no training) and print the summary table."""
    from .hf_eval import evaluate_hf_model, parse_variants, summary

    try:
        if encodings != ",".join(_DEFAULT.encodings):
            raise ValueError("--encodings does not apply to --hf-model (the model brings its own encoding)")
        with _ProgressBars(console, progress) as bars:
            records, settings = evaluate_hf_model(
                hf_model,
                out,
                task=task,
                eval_len=eval_len,
                eval_examples=eval_examples,
                eval_batch=min(eval_examples, _DEFAULT.eval_batch),
                seeds=_int_list(seeds, "--seeds"),
                num_symbols=num_symbols,
                corpus=None if corpus is None else str(corpus),
                variants=parse_variants(eval_variants),
                device=device,
                report=bars.report,
            )
        print_table(rich_table(summary(settings, records)))
        print_line(f"results: {out / 'results.jsonl'}, {out / 'extrapolation.png'}")
    except ValueError as err:
        print_error(str(err))
        raise typer.Exit(2) from err


@app.command("compare")
def compare(
    run_dir: Path = typer.Argument(..., help="an experiment folder (posenc extrapolate --out)"),
    a: str = typer.Argument(..., help="a row of its table: an encoding, or a variant such as 'rope + yarn'"),
    b: str = typer.Argument(..., help="the row to compare A with"),
    fit_threshold: float | None = typer.Option(
        None, help="a row fits when every seed reaches this in-distribution (default: the folder's)"
    ),
) -> None:
    """Whether A beats B beyond the training length L, paired by seed: the mean per-seed difference
    of the score beyond L with its 95% Student's t interval; "cannot tell" when it contains 0. Rows
    that did not fit are not compared."""
    from .compare import compare_rows

    try:
        comparison = compare_rows(run_dir, a, b, fit_threshold)
    except (ValueError, FileNotFoundError) as err:
        print_error(str(err))
        raise typer.Exit(2) from err
    for line in comparison.lines():
        print_line(line)
