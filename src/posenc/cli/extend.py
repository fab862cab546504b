"""``posenc extend RUN_FOLDER --to L2 --recipes ... --steps N``: continue every trained run of a
folder at a longer length under each recipe (:mod:`posenc.experiments.extension`)."""

from __future__ import annotations

from pathlib import Path

import typer

from .app import app, console, print_error
from .output import ProgressBars, print_table, rich_table


def _recipes_help() -> str:
    from ..experiments.extension.recipes import RECIPES

    return (
        "comma-separated recipes, options after a colon: "
        + ", ".join(RECIPES)
        + " (abf:base=B; pi, ntk, yarn [factor=F, layers=all|long]; pose [chunks=2, scaling=none|pi|ntk|yarn]; "
        "cream [sigma=3, scaling=...])"
    )


@app.command("extend")
def extend(
    run_folder: Path = typer.Argument(..., help="a finished `posenc extrapolate` folder (its checkpoints)"),
    to: int = typer.Option(
        ..., "--to", help="the longer task size L2 to continue training at (> the run's L)"
    ),
    recipes: str = typer.Option("continue,full", help=_recipes_help()),
    steps: int = typer.Option(..., min=1, help="continued-training steps per run and recipe"),
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
    threads: int = typer.Option(1, min=1, help="torch threads of this process"),
    progress: bool = typer.Option(True, help="show progress bars"),
) -> None:
    """Extension by training: each (encoding, seed) run of RUN_FOLDER continues at L2 under each recipe
    (also scored as trained, the row named by its encoding), then every size up to --eval-len is scored
    on the run's examples. Rank the rows beyond L2 with `posenc compare` and `posenc report` on the
    extension folder; re-run the same command to resume after an interruption."""
    import torch

    from ..experiments.extension.recipes import parse_recipes
    from ..experiments.extension.stage import ExtensionConfig, extension_folder_config, run_extension
    from ..experiments.results.records import read_run_records
    from ..experiments.results.summary import summary_table
    from ..experiments.train import Interrupted
    from ..viz.folder import write_figures

    torch.set_num_threads(threads)
    try:
        config = ExtensionConfig(
            to_len=to,
            recipes=[recipe.text for recipe in parse_recipes(recipes)],
            steps=steps,
            eval_len=eval_len,
            lr=lr,
            warmup=warmup,
        )
        with ProgressBars(console, progress) as bars:
            records = run_extension(
                run_folder, config, out, report=bars.report, log=bars.log, figures=write_figures
            )
    except Interrupted as err:
        print_error(f"{err}; run the same command again to resume", label=None, style="yellow")
        raise typer.Exit(130) from err
    except ValueError as err:
        print_error(str(err))
        raise typer.Exit(2) from err
    folder = out if out is not None else run_folder.with_name(f"{run_folder.name}-to{to}")
    folder_config = extension_folder_config(folder)
    print_table(
        rich_table(
            summary_table(folder_config, records, folder_config.make_task().metric, read_run_records(folder))
        )
    )
