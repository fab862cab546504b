"""``posenc extrapolate``, ``posenc compare`` and ``posenc merge``: the experiment harness's commands.

This module wires the two halves together: :mod:`posenc.experiments` writes a results folder and
draws nothing, :mod:`posenc.viz` draws figures from a folder (:func:`posenc.viz.folder.write_figures`,
passed to the harness as ``figures=``).

``extrapolate`` has one option per field of :class:`~posenc.experiments.ExperimentConfig`,
generated from the fields (:func:`config_options`): the name, default and type come from the
field, the help text and the command-line form (a comma-separated list, another name or type)
from the field's metadata. The options that are not settings (``--out``, ``--workers``, ...) are
the parameters of :func:`extrapolate` itself, placed among the generated ones by :data:`_PLACE`.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from ..experiments.study.hf_scaling import HF_TASKS
from ..experiments.tasks.catalog import TASKS
from ..experiments.train import ExperimentConfig
from .app import app, console, print_error, print_line
from .output import ProgressBars, print_table, quiet_hf_progress, rich_table
from .study import DTYPE_HELP, STUDY_MOVED, TUNING_WINDOWS_HELP, run_and_print

if TYPE_CHECKING:
    pass

_DEFAULT = ExperimentConfig()


# ---------------------------------------------------------------------------- options from the config


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError as err:
        raise typer.BadParameter(f"{option} must be comma-separated integers, got {text!r}") from err


def _str_list(text: str | None) -> list[str]:
    return [item.strip() for item in (text or "").split(",") if item.strip()]


@dataclasses.dataclass(frozen=True)
class ConfigOption:
    """One ``extrapolate`` option generated from a field of :class:`ExperimentConfig`."""

    field: str
    #: The parameter name (the option is ``--`` + the name with ``-`` for ``_``).
    name: str
    annotation: Any
    default: Any
    help: str | None
    #: The option's value (as typer gives it) -> the field's value.
    parse: Callable[[Any], Any]
    #: Other :func:`typer.Option` arguments (``min``).
    extra: dict[str, Any]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parameter(self, help: str | None = None) -> inspect.Parameter:
        help = help or self.help
        option = typer.Option(self.default, **({"help": help} if help else {}), **self.extra)
        return inspect.Parameter(
            self.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=self.annotation
        )

    def value(self, given: Any) -> Any:
        """The field's value for the option's value ``given``; a bad one is a usage error naming the option."""
        try:
            return self.parse(given)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint=self.flag) from err


def config_options() -> list[ConfigOption]:
    """The options of :class:`ExperimentConfig`'s fields, in field order.

    A field's ``metadata`` may hold ``help``, ``option`` (False: no option; a string: the option's
    name), ``type`` and ``default`` (the option's, when not the field's), ``parse`` (the option's
    text to the field's value) and ``min``. A ``list`` field is a comma-separated option
    (``--seeds 0,1,2``); an empty default list is an option that defaults to nothing.
    """
    hints = typing.get_type_hints(ExperimentConfig)
    options = []
    for field in dataclasses.fields(ExperimentConfig):
        meta = field.metadata
        if meta.get("option", True) is False:
            continue
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        annotation, parse = hints[field.name], meta.get("parse", lambda value: value)
        if typing.get_origin(annotation) is list:
            item = typing.get_args(annotation)[0]
            annotation = str if default else str | None
            default = ",".join(map(str, default)) if default else None
            flag = "--" + field.name.replace("_", "-")
            if "parse" not in meta:
                parse = (lambda text, flag=flag: _int_list(text, flag)) if item is int else _str_list
        if "type" in meta:
            annotation = meta["type"] | None if default is None else meta["type"]
            if "parse" not in meta:
                parse = lambda value: None if value is None else str(value)  # noqa: E731
        default = meta.get("default", default)
        name = meta["option"] if isinstance(meta.get("option"), str) else field.name
        extra = {"min": meta["min"]} if "min" in meta else {}
        options.append(ConfigOption(field.name, name, annotation, default, meta.get("help"), parse, extra))
    return options


CONFIG_OPTIONS = config_options()


def task_help() -> str:
    """``--task``'s help: the registered tasks, those ``--hf-model`` scores and the study's (from
    the registries, so a task added there is listed here)."""
    from ..experiments.study.plan import STUDY_TASKS

    return (
        f"task: {', '.join(TASKS)}; with --hf-model: {', '.join(HF_TASKS)}, or the context-extension "
        f"study {', '.join(STUDY_TASKS)}"
    )


def hf_model_forms() -> str:
    """What ``--hf-model`` takes, for its help: the fetchable causal LMs by name (from the catalog; the
    encoders and Whisper it refuses are left out)."""
    from ..pretrained.catalog import MODELS

    causal = [name for name, spec in MODELS.items() if spec.architecture.endswith("ForCausalLM")]
    return (
        f"an HF folder (save_pretrained), a fetched causal LM's name ({', '.join(causal)}; posenc models "
        "fetch) or a .gguf file"
    )


def study_tasks_text() -> str:
    """``text, text-lm, text-passkey or text-multikey``: the study's tasks (:data:`.study_plan.STUDY_TASKS`), for help texts."""
    from ..experiments.study.plan import STUDY_TASKS

    return f"{', '.join(STUDY_TASKS[:-1])} or {STUDY_TASKS[-1]}"


def eval_variants_help() -> str:
    """``--eval-variants``' help: the trained experiments' variants, then the piecewise-RoPE methods
    ``--hf-model`` takes with their defaults (from :data:`.hf_methods.METHODS`)."""
    from ..experiments.study.hf_methods import METHODS

    base = next(f for f in dataclasses.fields(ExperimentConfig) if f.name == "eval_variants").metadata["help"]
    methods = "; ".join(f"{name} ({method.defaults})" for name, method in METHODS.items())
    return (
        f"{base}. With --hf-model also the piecewise-RoPE methods, c the model's context and E --eval-len: "
        f"{methods}; NAME:OPTION=VALUE,OPTION=VALUE overrides them (self_extend:group_size=4 or "
        "dca:chunk_size=96,local_size=16), and scaling=linear|ntk|yarn with factor=F replaces the model's "
        "own RoPE scaling inside the method; OPTION=A|B|C (or yarn:2|3) is a grid, one row per setting, "
        "chosen with --tuning-windows"
    )


#: Help texts read at run time: the registered tasks, the --hf-model methods.
_HELP = {"task": task_help, "eval_variants": eval_variants_help}

#: Where the command's own options go among the generated ones: after the named option (the
#: options that follow one in the command's signature go with it).
_PLACE = {"out": "seeds", "workers": "backend", "hf_model": "fit_check_every", "preset": "eval_variants"}


def config_from_options(given: dict[str, Any]) -> ExperimentConfig:
    """The :class:`ExperimentConfig` of the generated options' values (by option name)."""
    values = {option.field: option.value(given[option.name]) for option in CONFIG_OPTIONS}
    values["eval_batch"] = min(values["eval_examples"], _DEFAULT.eval_batch)
    # How to evaluate randomized positions applies only with randomized positions.
    values["randomize_eval_positions"] = (
        values["randomize_eval_positions"] and values["randomize_positions"] is not None
    )
    return ExperimentConfig(**values)


def with_config_options(command: Callable[..., None]) -> Callable[..., None]:
    """``command(ctx, <its own options>, **options)`` as a typer command that also takes every
    option of :data:`CONFIG_OPTIONS` (handed over in ``options``, by option name)."""
    own = [
        p
        for p in inspect.signature(command, eval_str=True).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    placed: dict[str | None, list[inspect.Parameter]] = {}
    anchor = None
    for param in own[1:]:  # own[0]: the typer.Context
        anchor = _PLACE.get(param.name, anchor)
        placed.setdefault(anchor, []).append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY))
    params = [own[0], *placed.get(None, [])]
    for option in CONFIG_OPTIONS:
        params.append(option.parameter(_HELP[option.name]() if option.name in _HELP else None))
        params += placed.get(option.name, [])

    def wrapper(ctx: typer.Context, **kwargs: Any) -> None:
        command(ctx, **kwargs)

    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    wrapper.__doc__, wrapper.__name__ = command.__doc__, command.__name__
    return wrapper


# ---------------------------------------------------------------------------- the commands

# extrapolate's longer help texts, kept here so that its signature reads as the list of its options.
_THREADS_HELP = "torch threads per process (default: 1 per training process; with --hf-model, torch's own default, every core)"
_HF_MODEL_HELP = (
    f"evaluate a pretrained causal LM without training: {hf_model_forms()}; --task "
    f"{' or '.join(HF_TASKS)} scores it at lengths 1..--eval-len beyond its max_position_embeddings, "
    f"--task {study_tasks_text()} runs the context-extension study"
)
_LENGTHS_HELP = (
    "--hf-model --task text/text-passkey/text-multikey: prompt lengths of the passkey (default: c/2, c, 1.5c, 2c up "
    "to --eval-len, c the model's context); perplexity is read from --eval-len windows"
)
_LONGPPL_HELP = (
    "--hf-model --task text/text-lm: also LongPPL (Fang et al. 2025) with the model as its own evaluator: "
    "perplexity over the key tokens, whose loss with a short context (c/2 tokens, blocks of c/8) exceeds "
    "their loss in the window by more than 2 while below 2; beside the plain perplexity"
)
_PRESET_HELP = (
    "run a published setup and print the paper's numbers beside ours: nope-paper (Kazemnejad et al. "
    "2023: copy, count_copy, reverse) or alibi-paper (Press et al. 2022: LM perplexity at 2x/4x/8x L); "
    "one folder per task under --out; nope-paper trains each run until it fits (at most 6000 steps, "
    "4 layers, lr 1e-3) unless --steps, --lr etc. say otherwise; --seeds 0 and --task reverse give its "
    "reduced form"
)
_SHARD_HELP = (
    "i/n: run only the i-th of n disjoint parts of the (encoding x seed) grid (0 <= i < n); 'slurm' "
    "in a Slurm array task reads i/n from SLURM_ARRAY_TASK_ID and the array's size; combine the folders "
    "with posenc merge (posenc submit does all of it)"
)


def extrapolate(
    ctx: typer.Context,
    out: Path = typer.Option(
        Path("runs/extrapolate"), help="results folder (re-run the same command to resume)"
    ),
    workers: int | None = typer.Option(
        None, help="parallel processes (default: one per CPU core, at most one per run)"
    ),
    threads: int | None = typer.Option(None, min=1, help=_THREADS_HELP),
    device: str = typer.Option("cpu", help="cpu, cuda or auto"),
    progress: bool = typer.Option(True, help="show progress bars"),
    hf_model: Path | None = typer.Option(None, help=_HF_MODEL_HELP),
    lengths: str | None = typer.Option(None, help=_LENGTHS_HELP),
    depths: str | None = typer.Option(
        None,
        help="--hf-model --task text/text-passkey/text-multikey: needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)",
    ),
    longppl: bool = typer.Option(False, "--longppl", help=_LONGPPL_HELP),
    tuning_windows: int = typer.Option(0, help=TUNING_WINDOWS_HELP),
    dtype: str = typer.Option("float32", help=DTYPE_HELP),
    preset: str | None = typer.Option(None, help=_PRESET_HELP),
    shard: str | None = typer.Option(None, help=_SHARD_HELP),
    **options: Any,
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
    # One command, three forms: train encodings on a task, evaluate a pretrained HF model, or run
    # the context-extension study of one. The checks that tell the forms apart come first.
    from ..experiments.study.plan import STUDY_TASKS

    study = hf_model is not None and options["task"] in STUDY_TASKS
    if longppl and not study:
        print_error(f"--longppl applies to --hf-model with --task {study_tasks_text()}")
        raise typer.Exit(2)
    options["longppl"] = longppl
    options.update(tuning_windows=tuning_windows, dtype=dtype)
    if (tuning_windows or dtype != "float32") and not study:
        print_error(f"--tuning-windows and --dtype apply to --hf-model with --task {study_tasks_text()}")
        raise typer.Exit(2)
    if hf_model is not None and (preset is not None or (shard is not None and not study)):
        print_error("--preset and --shard train models; they do not apply to --hf-model (but to --task text)")
        raise typer.Exit(2)
    if hf_model is not None and threads is not None:
        import torch

        torch.set_num_threads(threads)  # one process evaluates: the threads are its own
    if study:
        console.print(f"[yellow]note:[/yellow] {STUDY_MOVED}", soft_wrap=True)
        with quiet_hf_progress():
            _study_pretrained(
                hf_model, out, device, progress, shard, lengths, depths, options, given_options(ctx)
            )
        return
    if hf_model is not None:
        with quiet_hf_progress():
            _evaluate_hf_model(hf_model, out, device, progress, options)
        return
    if lengths is not None or depths is not None:
        print_error(f"--lengths and --depths apply to --hf-model with --task {study_tasks_text()}")
        raise typer.Exit(2)
    _train_on_task(ctx, out, workers, threads, device, progress, preset, shard, options)


def _train_on_task(
    ctx: typer.Context,
    out: Path,
    workers: int | None,
    threads: int | None,
    device: str,
    progress: bool,
    preset: str | None,
    shard: str | None,
    options: dict[str, Any],
) -> None:
    """``extrapolate`` without ``--hf-model``: train the (encoding x seed) grid on the task (each task
    of ``preset``), write the results folder(s) and print the summary table(s)."""
    from ..experiments.cluster.shards import parse_shard
    from ..experiments.results.records import read_run_records
    from ..experiments.results.summary import summary_table
    from ..experiments.runner import ExperimentInterrupted, WorkerDied, run_experiment
    from ..experiments.runtime.distributed import Distributed
    from ..viz.folder import write_figures

    config = config_from_options(options)
    try:
        part = None if shard is None else parse_shard(shard)
        planned = [(config, out)] if preset is None else _preset_plan(ctx, preset, config, out)
        writer = Distributed.from_env().rank == 0  # under torchrun only rank 0 shows progress and results
        for one, folder in planned:
            with ProgressBars(console, progress and writer) as bars:
                records = run_experiment(
                    one,
                    folder,
                    workers=workers,
                    threads=threads or 1,
                    device=device,
                    report=bars.report,
                    log=bars.log,
                    shard=part,
                    preset=preset,
                    figures=write_figures,
                )
            if writer:
                runs = read_run_records(folder)
                print_table(rich_table(summary_table(one, records, one.make_task().metric, runs)))
        if preset is not None and writer:
            from ..experiments.presets import comparison_for_folder

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


app.command("extrapolate")(with_config_options(extrapolate))


def _preset_plan(
    ctx: typer.Context, name: str, config: ExperimentConfig, out: Path
) -> list[tuple[ExperimentConfig, Path]]:
    """``(config, folder)`` per task of preset ``name`` (``OUT/<task>``), every one checked before
    anything is written: an option given on the command line that contradicts the preset, a bad
    setting, or a folder holding other settings is a ``ValueError``."""
    from ..experiments.plan import check_experiment

    configs = preset_configs(ctx, name, config)
    for one in configs:
        check_experiment(one, out / one.task)
    return [(one, out / one.task) for one in configs]


def preset_configs(ctx: typer.Context, name: str, config: ExperimentConfig) -> list[ExperimentConfig]:
    """One config per task of preset ``name``: ``config`` with the preset's settings, the options
    given on the command line kept (one that contradicts the preset is a ``ValueError``)."""
    from ..experiments.presets import apply_preset

    given = given_options(ctx)
    explicit = {key: getattr(config, key) for key in given if key != "task" and hasattr(config, key)}
    return apply_preset(name, config, explicit, task=config.task if "task" in given else None)


def _evaluate_hf_model(
    hf_model: Path, out: Path, device: str, progress: bool, options: dict[str, Any]
) -> None:
    """``--hf-model``: evaluate a local HF causal LM (no training) and print the summary table."""
    from ..experiments.study.hf_eval import evaluate_hf_model, parse_variants, summary
    from ..viz.folder import write_figures

    corpus = options["corpus"]
    try:
        if options["encodings"] != ",".join(_DEFAULT.encodings):
            raise ValueError("--encodings does not apply to --hf-model (the model brings its own encoding)")
        with ProgressBars(console, progress) as bars:
            records, settings = evaluate_hf_model(
                hf_model,
                out,
                task=options["task"],
                eval_len=options["eval_len"],
                eval_examples=options["eval_examples"],
                eval_batch=min(options["eval_examples"], _DEFAULT.eval_batch),
                seeds=_int_list(options["seeds"], "--seeds"),
                num_symbols=options["num_symbols"],
                corpus=None if corpus is None else str(corpus),
                variants=parse_variants(options["eval_variants"]),
                device=device,
                report=bars.report,
                figures=write_figures,
            )
        print_table(rich_table(summary(settings, records)))
        print_line(f"results: {out / 'results.jsonl'}, {out / 'extrapolation.png'}")
    except (ValueError, FileNotFoundError) as err:
        print_error(str(err))
        raise typer.Exit(2) from err


def given_options(ctx: typer.Context) -> set[str]:
    """The names of the parameters given on the command line (not left at their defaults)."""
    # By name: typer may bring its own copy of click's ParameterSource enum.
    return {
        param for param in ctx.params if getattr(ctx.get_parameter_source(param), "name", "") == "COMMANDLINE"
    }


def study_options(
    lengths: str | None, depths: str | None, options: dict[str, Any], given: set[str]
) -> dict[str, Any]:
    """:func:`.study_plan.plan_study`'s options from the command's (``ValueError`` names the bad one);
    ``given``: the options given on the command line (:func:`given_options`)."""
    from ..experiments.study.hf_eval import parse_variants

    if options["encodings"] != ",".join(_DEFAULT.encodings):
        raise ValueError("--encodings does not apply to --hf-model (the model brings its own encoding)")
    corpus = options["corpus"]
    # Whether an option was given, not whether it differs from the trained experiments' default:
    # --eval-len 48 or --eval-examples 100 were replaced by the study's own defaults (2c, 1).
    return {
        "task": options["task"],
        "eval_len": options["eval_len"] if "eval_len" in given else None,
        "lengths": None if lengths is None else _int_list(lengths, "--lengths"),
        "depths": depths,
        "eval_examples": options["eval_examples"] if "eval_examples" in given else 1,
        "seeds": _int_list(options["seeds"], "--seeds"),
        "corpus": None if corpus is None else str(corpus),
        "variants": parse_variants(options["eval_variants"]),
        "longppl": bool(options.get("longppl", False)),
        "tuning_windows": int(options.get("tuning_windows", 0)),
        "dtype": str(options.get("dtype", "float32")),
    }


def _study_pretrained(
    hf_model: Path,
    out: Path,
    device: str,
    progress: bool,
    shard: str | None,
    lengths: str | None,
    depths: str | None,
    options: dict[str, Any],
    given: set[str],
) -> None:
    """``--hf-model M --task text``: the context-extension study, as ``posenc study`` runs it
    (:func:`posenc.cli.study.run_and_print`); ``given``: the options given on the command line."""
    try:
        study = study_options(lengths, depths, options, given)
    except ValueError as err:
        print_error(str(err))
        raise typer.Exit(2) from err
    run_and_print(str(hf_model), study, out, device, progress, shard)


@app.command("compare")
def compare(
    run_dir: Path = typer.Argument(
        ..., help="an experiment folder (posenc extrapolate --out), or a study folder (--hf-model)"
    ),
    a: str = typer.Argument(..., help="a row of its table: an encoding, or a variant such as 'rope + yarn'"),
    b: str = typer.Argument(..., help="the row to compare A with"),
    fit_threshold: float | None = typer.Option(
        None, help="a row fits when every seed reaches this in-distribution (default: the folder's)"
    ),
) -> None:
    """Whether A beats B beyond the training length L, paired by seed: the mean per-seed difference
    of the score beyond L with its 95% Student's t interval; "cannot tell" when it contains 0. Rows
    that did not fit are not compared. On a study folder: A − B per perplexity bucket (paired t over
    the windows) and per retrieval cell (McNemar's exact test on the same prompts), Holm-corrected."""
    from ..experiments.results.compare import compare_rows
    from ..experiments.study.paired import compare_variants, is_study_folder

    try:
        if is_study_folder(run_dir):
            lines = compare_variants(run_dir, a, b)
        else:
            lines = compare_rows(run_dir, a, b, fit_threshold).lines()
    except (ValueError, FileNotFoundError) as err:
        print_error(str(err))
        raise typer.Exit(2) from err
    for line in lines:
        print_line(line)


@app.command("merge")
def merge(
    out: Path = typer.Argument(
        ..., help="folder to write the merged experiment into (new, empty, or one of FOLDERS)"
    ),
    folders: list[Path] = typer.Argument(
        ..., help="the --out folders of the shards (posenc extrapolate --shard i/n)"
    ),
) -> None:
    """Combine experiment folders (the shards of one command) into one.

    Refuses folders whose settings differ (naming the field) and two different results of the same
    measurement (in results.jsonl and runs.jsonl); keeps one copy of exact duplicates. Writes
    results.jsonl, runs.jsonl, results.csv, config.json and extrapolation.png into OUT and copies
    the runs' checkpoints; says which runs of the grid are still missing.
    """
    from ..experiments.cluster.shards import merge_folders
    from ..viz.folder import write_figures

    try:
        summary = merge_folders(out, folders, figures=write_figures)
    except ValueError as err:
        print_error(str(err))
        raise typer.Exit(2) from err
    dropped = f", {summary.duplicates} exact duplicate(s) dropped" if summary.duplicates else ""
    runs = f", {summary.runs} per-run records (runs.jsonl)" if summary.runs else ""
    print_line(f"merged {len(folders)} folder(s) into {out}: {summary.records} records{runs}{dropped}")
    if summary.missing:
        labels = ", ".join(run.label for run in summary.missing)
        console.print(
            f"[yellow]incomplete:[/yellow] {len(summary.missing)} run(s) have no results yet: {escape(labels)}"
        )
    else:
        console.print("complete: every (encoding, seed) run of the grid has results")


# ---------------------------------------------------------------------------- Slurm
