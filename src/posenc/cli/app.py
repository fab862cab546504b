"""The ``posenc`` command line: ``posenc list | show | plot | extrapolate | compare | merge | report | bench |
models | inspect | submit | slurm-torchrun``.

Typer + Rich. Sub-commands owned by other modules register themselves on :data:`app` when their
module is imported (see :data:`COMMAND_MODULES`), so this file stays small.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

#: The order ``posenc --help`` lists the commands in: what the library does first, the cluster last.
COMMAND_ORDER = (
    "list",
    "show",
    "plot",
    "extrapolate",
    "extend",
    "study",
    "compare",
    "merge",
    "report",
    "bench",
    "models",
    "inspect",
    "submit",
    "slurm-torchrun",
)


def unwrap(text: str) -> str:
    """``text`` with each paragraph (blocks between blank lines) on one line: docstrings are wrapped
    at the source's width, and Rich would keep those breaks inside its own wrapping. A paragraph
    starting with ``\\b`` (click's "keep as is") and lines of a list (``* ``, ``- ``) keep theirs."""
    paragraphs = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        if paragraph.startswith("\b"):
            paragraphs.append(paragraph)
            continue
        lines: list[str] = []
        for line in paragraph.splitlines():
            line = line.strip()
            if lines and not line.startswith(("* ", "- ")):
                lines[-1] += " " + line
            else:
                lines.append(line)
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


def _tidy(command: Any) -> None:
    """Make ``command``'s (and its sub-commands') help read as written at any terminal width:
    docstring paragraphs unwrapped and taken as plain text (no Rich markup), no type column for
    flags (``--progress/--no-progress`` needs no ``<bool>``), and a long comma-separated default
    (``--encodings``) given with spaces so that it wraps instead of being cut with an ellipsis."""
    if getattr(command, "_posenc_tidy", False):
        return
    command._posenc_tidy = True  # type: ignore[attr-defined]
    help_option = command.get_help_option  # made per context, so a flag without a type column too

    def get_help_option(ctx: Any) -> Any:
        option = help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    command.get_help_option = get_help_option
    if command.help:
        command.help = escape(unwrap(command.help))
    for param in command.params:
        option = getattr(param, "param_type_name", None) == "option"  # typer may vendor click: no isinstance
        if option and getattr(param, "is_flag", False):
            param.metavar = ""
        elif option and param.metavar is None and getattr(param, "type_descriptor", None) is not None:
            described = param.type_descriptor  # typer >= 0.2x: "<int range> [x>=1]" becomes "<int> [x>=1]"
            if described.is_ranged:
                param.metavar = f"<{described.ranged_type_name}>"
        help_text = getattr(param, "help", None)
        if help_text:
            param.help = escape(unwrap(help_text))  # type: ignore[attr-defined]
        default = param.default
        if option and isinstance(default, str) and "," in default and " " not in default:
            param.show_default = False
            shown = escape(f"[default: {', '.join(default.split(','))}]")
            param.help = f"{param.help}  {shown}" if param.help else shown
    if isinstance(getattr(command, "commands", None), dict):  # a group
        for sub in command.commands.values():
            _tidy(sub)


class _Group(typer.core.TyperGroup):
    """The ``posenc`` group: commands listed in :data:`COMMAND_ORDER`, every help tidied (:func:`_tidy`)."""

    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(names, key=lambda name: (rank.get(name, len(rank)), names.index(name)))

    def main(self, *args, **kwargs):  # type: ignore[override]
        _tidy(self)
        return super().main(*args, **kwargs)


app = typer.Typer(
    name="posenc",
    cls=_Group,
    help="Positional encodings for Transformers: inspect, plot, benchmark and run length-generalization experiments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="rich",
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
    "posenc.cli.experiments",
    "posenc.cli.extend",
    "posenc.cli.study",
    "posenc.cli.slurm",
    "posenc.cli.plots",
    "posenc.cli.bench",
    "posenc.cli.pretrained",
    "posenc.cli.inspection",
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


def load_command_modules() -> None:
    """Import every module of :data:`COMMAND_MODULES`, so that each registers its commands on
    :data:`app`; a module whose optional dependency is missing is skipped. ``main`` calls it first, and
    so does any caller that invokes :data:`app` directly (tests driving it through Typer's runner)."""
    for module in COMMAND_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is None or not module.startswith(err.name):
                raise


def main() -> None:
    """Entry point of the ``posenc`` script."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    load_command_modules()
    app()
