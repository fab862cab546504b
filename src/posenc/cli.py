"""The ``posenc`` command line: ``posenc list | show | plot | extrapolate | compare | merge | report | bench``.

Typer + Rich. Sub-commands owned by other modules register themselves on :data:`app` when their
module is imported (see :data:`COMMAND_MODULES`), so this file stays small.
"""

from __future__ import annotations

import importlib
import os

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

app = typer.Typer(
    name="posenc",
    help="Positional encodings for Transformers: inspect, plot, benchmark and run length-generalization experiments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
console = Console()


def print_error(message: str, *, label: str | None = "error", style: str = "red") -> None:
    """Print ``label: message`` (``message`` in ``style`` without a label) on the console: the
    message as it is (no Rich markup read from it) and never wrapped by the console, so a long path
    stays on one line and can be copied whole."""
    text = (
        f"[{style}]{label}:[/{style}] {escape(message)}" if label else f"[{style}]{escape(message)}[/{style}]"
    )
    console.print(text, soft_wrap=True, highlight=False)


def print_line(message: str) -> None:
    """Print a plain line that may name paths (``wrote DIR/report.html``) without wrapping it."""
    console.print(message, soft_wrap=True, markup=False, highlight=False)


#: Modules that add sub-commands to :data:`app` when imported (skipped if not present yet).
COMMAND_MODULES = [
    "posenc.experiments_cli",
    "posenc.viz.cli",
    "posenc.bench_cli",
    "posenc.pretrained_cli",
]


#: The calls ``posenc list`` asks every backend about: a short and a long causal self-attention.
LIST_LENGTHS = (8, 8192)


@app.command("list")
def list_encodings() -> None:
    """List every registered encoding: name, kind, description and the backends that can run it."""
    import posenc

    short, long = LIST_LENGTHS
    table = Table(
        title="posenc encodings",
        caption=f"backends: those that state no reason against a causal self-attention of {short} or "
        f"{long} tokens, in the order auto tries them (posenc.backends.dispatch.PRIORITY); "
        f"(long): only at {long}",
        caption_justify="left",
    )
    for column in ("name", "kind", "description", "backends (auto order)"):
        table.add_column(column)
    for name in posenc.available():
        cls = posenc.get_class(name)
        table.add_row(Text(name), cls.kind.value, Text(cls.description), ", ".join(listed_backends(name)))
    console.print(table)


def listed_backends(name: str) -> list[str]:
    """The backends ``posenc list`` shows for encoding ``name``, in ``auto``'s order: each that serves a
    call of either length of :data:`LIST_LENGTHS`, marked ``(long)`` when it serves only the long one."""
    from posenc.backends import available_backends
    from posenc.examples import runnable_backends

    short, long = LIST_LENGTHS
    at_short, at_long = runnable_backends(name, short), runnable_backends(name, long)
    return [
        b if b in at_short else f"{b} (long)" for b in available_backends() if b in at_short or b in at_long
    ]


@app.command("show")
def show(
    spec: str = typer.Argument(..., help="encoding name or spec string, e.g. t5 or rope:base=500000"),
) -> None:
    """Show an encoding's configuration and a small numeric view of what it computes."""
    from posenc.examples import build_example

    try:
        enc = build_example(spec)
    except ValueError as err:
        print_error(str(err))
        raise typer.Exit(2) from err
    table = Table(title=f"{enc.name} ({enc.kind.value})", show_header=True)
    table.add_column("option")
    table.add_column("value")
    for key, value in enc.config().items():
        table.add_row(Text(key), Text(repr(value)))
    console.print(table)
    console.print(f"spec: [bold]{escape(enc.spec())}[/bold]")
    text = enc.preview()
    if text:
        console.print(text, markup=False, highlight=False)


def _load_command_modules() -> None:
    for module in COMMAND_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is None or not module.startswith(err.name):
                raise


def main() -> None:
    """Entry point of the ``posenc`` script."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    _load_command_modules()
    app()
