"""``posenc inspect MODEL``: a trained model's positional encodings, as a terminal summary and an HTML
page (:mod:`posenc.viz.inspection`). Registered on :data:`posenc.cli.app.app` when imported."""

from __future__ import annotations

import re
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from posenc.cli.app import app, console, print_error, print_line

#: Where the page goes without ``--out``: ``runs/inspect/<model>``.
DEFAULT_ROOT = Path("runs") / "inspect"


def default_out(label: str) -> Path:
    """``runs/inspect/<label>``, the model's label (its fetched name, or the folder's or the GGUF
    file's name) made a file name."""
    return DEFAULT_ROOT / (re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.") or "model")


@app.command("inspect")
def inspect_command(
    model: str = typer.Argument(
        ..., help="a fetched model's name (posenc models list), an HF folder or a .gguf file"
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="folder for index.html, inspect.json and figures/ (default runs/inspect/MODEL)",
    ),
    tokens: int = typer.Option(
        512, "--tokens", "-n", min=2, help="tokens of the reference text a RoPE model runs on"
    ),
) -> None:
    """Show what positions a trained model uses and what it learned: the encoding per layer type
    checked against the weights; learned tables' cosine similarity and norms; bucketed biases per head
    against distance; RoPE's query and key norms per frequency pair on real text. Writes one HTML page."""
    from ..viz.inspection import InspectError, inspect_model, write_inspection

    try:
        inspection = inspect_model(model, tokens=tokens, log=print_line)
        page = write_inspection(inspection, out if out is not None else default_out(inspection.view.label))
    except InspectError as err:
        print_error(str(err))
        raise typer.Exit(2) from err
    except (ValueError, FileNotFoundError, RuntimeError, ImportError, OSError) as err:
        print_error(str(err))
        raise typer.Exit(1) from err
    _summary(inspection)
    print_line(f"wrote {page}")


def _summary(inspection) -> None:
    """The layer table, the disagreements (or that every check agrees) and each finding's lines."""
    from ..viz.inspection.layers import join_layers

    view = inspection.view
    table = Table(title=f"{view.label}: {view.config.model_type}, positions per layer type", show_lines=True)
    for column in ("layers", "encoding and options", "window", "heads q/kv x dim"):
        table.add_column(column, overflow="fold")
    for row in inspection.rows:
        where = f"{row.stack}: " if row.stack != "model" else ""
        kind = f" ({row.layer_type})" if row.layer_type else ""
        encodings = "\n".join(
            f"{e.family}: " + ", ".join(f"{k} {v}" for k, v in e.options.items()) for e in row.encodings
        )
        table.add_row(
            Text(f"{where}{join_layers(row.layers)}{kind}"),
            Text(encodings or "none found"),
            Text(str(row.window or "-")),
            Text(f"{row.heads}/{row.kv_heads} x {row.head_dim}"),
        )
    console.print(table)
    wrong = inspection.disagreements
    if wrong:
        for check in wrong:
            print_error(
                f"{check.what}: the config says {check.config}, the weights {check.weights}", label="disagree"
            )
    else:
        print_line(f"config and weights agree ({len(inspection.checks)} checks)")
    for found in inspection.findings.values():
        for finding in found:
            for line in finding.summary:
                print_line(f"  {line}")
