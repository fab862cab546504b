"""``posenc submit`` and ``posenc slurm-torchrun``: the experiment harness on a Slurm cluster
(:mod:`posenc.experiments.cluster.slurm`). ``submit`` takes every option of ``posenc extrapolate``
(:func:`posenc.cli.experiments.with_config_options`) and hands the ones given on to its array tasks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from .app import app, print_error, print_line
from .experiments import (
    CONFIG_OPTIONS,
    config_from_options,
    given_options,
    hf_model_forms,
    preset_configs,
    study_options,
    study_tasks_text,
    with_config_options,
)
from .study import DTYPE_HELP, STUDY_MOVED, TUNING_WINDOWS_HELP

if TYPE_CHECKING:
    from ..experiments.cluster.slurm import Submission


def _command_line_args(ctx: typer.Context, names: set[str]) -> list[str]:
    """The options among ``names`` that were given on the command line, as command-line words
    again (a flag as ``--flag`` or ``--no-flag``): what an array task passes on to ``extrapolate``."""
    args: list[str] = []
    for param in ctx.command.params:
        if (
            param.name not in names
            or getattr(ctx.get_parameter_source(param.name), "name", "") != "COMMANDLINE"
        ):
            continue
        value = ctx.params[param.name]
        if getattr(param, "is_flag", False):
            if value:
                args.append(param.opts[0])
            elif param.secondary_opts:
                args.append(param.secondary_opts[0])
            continue
        args += [param.opts[0], str(getattr(value, "value", value))]
    return args


def submit_command(
    ctx: typer.Context,
    out: Path = typer.Option(
        Path("runs/extrapolate"),
        help="results folder: the merge job writes it, array task i writes OUT/shards/<i>of<n> (rerun the "
        "same command to resubmit what is missing)",
    ),
    workers: int | None = typer.Option(None, help="processes per array task (default: --cpus, or 1)"),
    threads: int | None = typer.Option(None, help="torch threads per process (extrapolate's --threads)"),
    device: str | None = typer.Option(None, help="cpu, cuda or auto (extrapolate's --device)"),
    array_size: int | None = typer.Option(
        None, help="array tasks (shards of the grid; default one per run); a rerun must keep it"
    ),
    partition: str | None = typer.Option(None, help="sbatch --partition"),
    time: str | None = typer.Option(None, help="sbatch --time per task, e.g. 2:00:00"),
    cpus: int | None = typer.Option(None, min=1, help="sbatch --cpus-per-task"),
    mem: str | None = typer.Option(None, help="sbatch --mem per node, e.g. 8G"),
    gpus: str | None = typer.Option(None, help="sbatch --gpus-per-node, e.g. 1 or a100:2"),
    account: str | None = typer.Option(None, help="sbatch --account"),
    nodes: int = typer.Option(
        1, min=1, help="nodes per array task: each run trains with DDP across them (srun + torchrun)"
    ),
    nproc_per_node: int = typer.Option(1, min=1, help="DDP processes per node under torchrun (one per GPU)"),
    dry_run: bool = typer.Option(
        False, help="write the sbatch scripts and print the commands; submit nothing"
    ),
    preset: str | None = typer.Option(
        None,
        help="submit a published setup (nope-paper, alibi-paper) as extrapolate --preset runs it: array task "
        "i runs shard i/n of every task, the merge job writes OUT/<task>",
    ),
    hf_model: str | None = typer.Option(
        None,
        help=f"submit the context-extension study of a pretrained model ({hf_model_forms()}; with --task "
        f"{study_tasks_text()}): array task i runs the (variant, length) units i, i+n, ...; the model must "
        "be readable at the same path on the compute nodes",
    ),
    lengths: str | None = typer.Option(None, help="--hf-model: the passkey's prompt lengths (extrapolate's)"),
    depths: str | None = typer.Option(None, help="--hf-model: the passkey's needle depths (extrapolate's)"),
    longppl: bool = typer.Option(False, "--longppl", help="--hf-model: also LongPPL (extrapolate's)"),
    tuning_windows: int = typer.Option(0, help="--hf-model: " + TUNING_WINDOWS_HELP),
    dtype: str = typer.Option("float32", help=DTYPE_HELP),
    **options: Any,
) -> None:
    """Run the experiment on a Slurm cluster: the (encoding x seed) grid as one job array (task i
    trains shard i/n) plus a merge job that runs when every task succeeded (afterok). Takes
    extrapolate's options, --preset included. Prints the job ids and the folder. Run the same
    command again after a task failed or was cancelled: it submits only the shards that lack runs
    (resuming from their checkpoints) and the merge."""
    from ..experiments.cluster.slurm import SlurmOptions, submit

    config = None if hf_model is not None else config_from_options(options)
    passed = _passed_args(ctx, preset, threads, device)
    try:
        scheduler = SlurmOptions(partition, time, cpus, mem, gpus, account, nodes, nproc_per_node)
        options.update(longppl=longppl, tuning_windows=tuning_windows, dtype=dtype)
        if hf_model is not None:
            study = (lengths, depths, given_options(ctx))
            configs, passed = _study_submission(hf_model, study, preset, passed, options)
        else:
            _refuse_study_options(options)
            # submit checks each task's folder itself (check_experiment), so only the configs here
            configs = config if preset is None else preset_configs(ctx, preset, config)
        done = submit(
            configs,
            out,
            passed,
            preset=preset,
            array_size=array_size,
            options=scheduler,
            workers=workers,
            dry_run=dry_run,
        )
    except (ValueError, FileNotFoundError) as err:
        print_error(str(err))
        raise typer.Exit(2) from err
    if dry_run:
        _print_dry_run(done)
    else:
        _print_submission(done, studied=bool(hf_model), preset=preset)


def _passed_args(
    ctx: typer.Context, preset: str | None, threads: int | None, device: str | None
) -> list[str]:
    """The ``extrapolate`` arguments each array task runs: the config options given on the command
    line, after ``--preset`` and before ``--threads`` and ``--device`` when given."""
    names = {option.name for option in CONFIG_OPTIONS}
    passed = _command_line_args(ctx, names)
    if preset is not None:
        passed = ["--preset", preset, *passed]
    if threads is not None:
        passed += ["--threads", str(threads)]
    if device is not None:
        passed += ["--device", device]
    return passed


def _print_dry_run(done: Submission) -> None:
    """``--dry-run``: the scripts written and the ``sbatch`` commands that would submit them."""
    import shlex

    print_line(f"scripts: {done.array_script}, {done.merge_script}")
    for command in done.commands:
        print_line(shlex.join(command))


def _print_submission(done: Submission, *, studied: bool, preset: str | None) -> None:
    """What was submitted (``studied``: a study's units rather than trained runs), where the results
    go, and how to watch the jobs."""
    if done.complete:
        print_line(f"complete: {done.out} holds every run of the grid, merged; nothing to submit")
        return
    if done.earlier_array:
        print_line(
            f"array job {done.array_job} of the earlier posenc submit is still queued (shard(s) "
            f"{', '.join(map(str, done.shards))} of {done.count} lack runs); its merge job had not been submitted"
        )
        print_line(f"submitted merge job {done.merge_job} (afterok:{done.array_job})")
    elif done.array_job is not None:
        print_line(
            f"submitted array job {done.array_job}: shard(s) {', '.join(map(str, done.shards))} of "
            f"{done.count}, {len(done.missing)} {'unit(s) to run' if studied else 'run(s) to train'}; "
            f"logs in {done.out / 'slurm' / 'logs'}"
        )
        print_line(f"submitted merge job {done.merge_job} (afterok:{done.array_job})")
    else:
        print_line(
            f"every {'unit is run' if studied else 'run is trained'}; submitted merge job {done.merge_job}"
        )
    print_line(f"results: {done.out}" + ("/<task>" if preset is not None else ""))
    jobs = ",".join(job for job in (done.array_job, done.merge_job) if job)
    print_line(f"watch: squeue --jobs {jobs}; rerun this command if a task fails")


def _refuse_study_options(options: dict[str, Any]) -> None:
    """The study's own options given to a submission that trains: refused by name."""
    if options["longppl"] or options["tuning_windows"] or options["dtype"] != "float32":
        raise ValueError(
            "--longppl, --tuning-windows and --dtype apply to --hf-model (the context-extension study)"
        )


def _study_submission(
    hf_model: str,
    study: tuple[str | None, str | None, set[str]],
    preset: str | None,
    passed: list[str],
    options: Any,
) -> tuple[Any, list[str]]:
    """``posenc submit --hf-model``: the study's grid (read from the model's config) and the
    ``extrapolate`` arguments of its array tasks; ``study``: ``(--lengths, --depths, the options
    given on the command line)``."""
    from ..experiments.study.plan import STUDY_TASKS, study_grid

    if preset is not None:
        raise ValueError("--preset trains models; it does not apply to --hf-model")
    if options["task"] not in STUDY_TASKS:
        raise ValueError(
            f"posenc submit --hf-model runs the context-extension study: --task {', '.join(STUDY_TASKS)}, "
            f"not {options['task']!r} (run that evaluation with posenc extrapolate --hf-model)"
        )
    print_line(f"note: {STUDY_MOVED}; submit --hf-model submits it as a job array")
    lengths, depths, given = study
    grid = study_grid(hf_model, **study_options(lengths, depths, options, given))
    extra = ["--hf-model", hf_model]
    extra += [] if lengths is None else ["--lengths", lengths]
    extra += [] if depths is None else ["--depths", depths]
    extra += ["--longppl"] if options.get("longppl") else []
    extra += ["--tuning-windows", str(options["tuning_windows"])] if options.get("tuning_windows") else []
    extra += ["--dtype", options["dtype"]] if options.get("dtype", "float32") != "float32" else []
    return grid, [*extra, *passed]


app.command("submit")(with_config_options(submit_command))


@app.command(
    "slurm-torchrun",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def slurm_torchrun(
    ctx: typer.Context,
    nproc_per_node: int = typer.Option(1, min=1, help="processes on this node (one per GPU)"),
    master_port: int | None = typer.Option(
        None, help="rendezvous port (default 15000 + SLURM_JOB_ID % 20000, the same on every node)"
    ),
) -> None:
    """Under srun, one task per node: start torchrun for this node's share of one DDP run.

    Reads the rendezvous from Slurm (SLURM_JOB_NODELIST: the first node hosts it; SLURM_NTASKS:
    the nodes; SLURM_PROCID: this node's rank; SLURM_JOB_ID: the port) and runs the posenc command
    after `--` under torchrun, e.g. `srun --nodes 2 --ntasks-per-node 1 posenc slurm-torchrun --
    extrapolate --out runs/big`."""
    import os
    import sys

    from ..experiments.cluster.slurm import rendezvous_from_slurm

    if not ctx.args:
        print_error(
            "give the posenc command to run after --, e.g. posenc slurm-torchrun -- extrapolate --out DIR"
        )
        raise typer.Exit(2)
    try:
        rendezvous = rendezvous_from_slurm(master_port=master_port)
        torchrun = rendezvous.torchrun_args(nproc_per_node)
    except ValueError as err:
        print_error(str(err))
        raise typer.Exit(2) from err
    argv = [sys.executable, "-m", "torch.distributed.run", *torchrun, "-m", "posenc", *ctx.args]
    print(f"slurm-torchrun: {' '.join(torchrun)}", file=sys.stderr, flush=True)
    os.execv(sys.executable, argv)
