"""``posenc extend RUN_FOLDER --to L2 --recipes ... --steps N``: continue every trained run of a
folder at a longer length under each recipe (:mod:`posenc.experiments.extension`); ``--preset NAME``
runs a published comparison of recipes into RUN_FOLDER and says whether its ordering holds."""

from __future__ import annotations

from pathlib import Path

import typer

from .app import app, console, print_error, print_line
from .output import ProgressBars, print_table, rich_table


def _recipes_help() -> str:
    from ..experiments.extension.recipes import RECIPES

    return (
        "comma-separated recipes, options after a colon: "
        + ", ".join(RECIPES)
        + " (abf:base=B; pi, ntk, yarn [factor=F, layers=all|long]; pose [chunks=2, scaling=none|pi|ntk|yarn]; "
        "cream [sigma=3, scaling=...])"
    )


def _preset_help() -> str:
    from ..experiments.extension.presets import EXTENSION_PRESETS

    return (
        "a published ordering of recipes to check, trained and extended into RUN_FOLDER (base/ and "
        "base-to<L2>/): " + ", ".join(EXTENSION_PRESETS) + "; --steps then sets the extension's steps"
    )


@app.command("extend")
def extend(
    run_folder: Path = typer.Argument(
        ..., help="a finished `posenc extrapolate` folder (its checkpoints); with --preset, where it writes"
    ),
    to: int | None = typer.Option(
        None, "--to", help="the longer task size L2 to continue training at (> the run's L)"
    ),
    recipes: str = typer.Option("continue,full", help=_recipes_help()),
    steps: int | None = typer.Option(None, min=1, help="continued-training steps per run and recipe"),
    eval_len: int | None = typer.Option(None, help="evaluate every size 1..eval-len (default 2·L2)"),
    lr: float | None = typer.Option(
        None, help="peak learning rate of the continued training (default: the run's / 10)"
    ),
    warmup: int | None = typer.Option(
        None, min=0, help="warm-up steps (default: steps / 10, at most the run's)"
    ),
    out: Path | None = typer.Option(
        None, help="extension folder (default: RUN_FOLDER-to<L2>; re-run to resume)"
    ),
    preset: str | None = typer.Option(None, help=_preset_help()),
    threads: int = typer.Option(1, min=1, help="torch threads of this process"),
    progress: bool = typer.Option(True, help="show progress bars"),
) -> None:
    """Extension by training: each (encoding, seed) run of RUN_FOLDER continues at L2 under each recipe
    (also scored as trained, the row named by its encoding), then every size up to --eval-len is scored
    on the run's examples. Rank the rows beyond L2 with `posenc compare` and `posenc report` on the
    extension folder; re-run the same command to resume after an interruption."""
    import torch

    from ..experiments.train import Interrupted

    torch.set_num_threads(threads)
    try:
        with ProgressBars(console, progress) as bars:
            if preset is not None:
                _run_preset(preset, run_folder, steps, bars)
                return
            if to is None or steps is None:
                raise ValueError("give --to L2 and --steps N (or --preset NAME)")
            folder = _run_recipes(run_folder, to, recipes, steps, eval_len, lr, warmup, out, bars)
    except Interrupted as err:
        print_error(f"{err}; run the same command again to resume", label=None, style="yellow")
        raise typer.Exit(130) from err
    except ValueError as err:
        print_error(str(err))
        raise typer.Exit(2) from err
    _print_summary(folder)


def _run_recipes(
    run_folder: Path,
    to: int,
    recipes: str,
    steps: int,
    eval_len: int | None,
    lr: float | None,
    warmup: int | None,
    out: Path | None,
    bars: ProgressBars,
) -> Path:
    from ..experiments.extension.recipes import parse_recipes
    from ..experiments.extension.stage import ExtensionConfig, run_extension
    from ..viz.folder import write_figures

    config = ExtensionConfig(
        to_len=to,
        recipes=[recipe.text for recipe in parse_recipes(recipes)],
        steps=steps,
        eval_len=eval_len,
        lr=lr,
        warmup=warmup,
    )
    folder = out if out is not None else run_folder.with_name(f"{run_folder.name}-to{to}")
    run_extension(run_folder, config, folder, report=bars.report, log=bars.log, figures=write_figures)
    return folder


def _print_summary(folder: Path) -> None:
    from ..experiments.extension.stage import extension_folder_config
    from ..experiments.results.records import read_records, read_run_records
    from ..experiments.results.summary import summary_table

    config = extension_folder_config(folder)
    labels = set(config.encodings)
    records = [r for r in read_records(folder / "results.jsonl") if r["encoding"] in labels]
    table = summary_table(config, records, config.make_task().metric, read_run_records(folder))
    print_table(rich_table(table))


def _run_preset(name: str, out: Path, steps: int | None, bars: ProgressBars) -> None:
    import dataclasses

    from ..experiments.extension.presets import EXTENSION_PRESETS, mean_positions_seen, run_extension_preset

    def scale(base, extension):
        return base, extension if steps is None else dataclasses.replace(extension, steps=steps)

    folder, verdicts = run_extension_preset(name, out, scale=scale, report=bars.report, log=bars.log)
    _print_summary(folder)
    print_line(f"{name}: {EXTENSION_PRESETS[name].citation}")
    for verdict in verdicts:
        print_line(f"{verdict.outcome}: {verdict.claim.says}. {verdict.sentence}")
    seen = mean_positions_seen(folder)
    print_line("compute (positions seen per run): " + ", ".join(f"{r} {v:,.0f}" for r, v in seen.items()))
