"""``posenc merge OUT DIR1 DIR2 ...``: combine the result folders of the shards of one experiment."""

from __future__ import annotations

from pathlib import Path

import typer

from ..cli import app, console, print_error, print_line


@app.command("merge")
def merge(
    out: Path = typer.Argument(
        ..., help="folder to write the merged experiment into (new, empty, or one of DIRS)"
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
    from .shards import merge_folders

    try:
        summary = merge_folders(out, folders)
    except ValueError as err:
        print_error(str(err))
        raise typer.Exit(2) from err
    dropped = f", {summary.duplicates} exact duplicate(s) dropped" if summary.duplicates else ""
    runs = f", {summary.runs} per-run records (runs.jsonl)" if summary.runs else ""
    print_line(f"merged {len(folders)} folder(s) into {out}: {summary.records} records{runs}{dropped}")
    if summary.missing:
        labels = ", ".join(run.label for run in summary.missing)
        console.print(
            f"[yellow]incomplete:[/yellow] {len(summary.missing)} run(s) have no results yet: {labels}"
        )
    else:
        console.print("complete: every (encoding, seed) run of the grid has results")
