"""``posenc plot`` and ``posenc report``: registered on :data:`posenc.cli.app.app` when imported."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from posenc.cli.app import app, console, print_error, print_line

from ..examples import build_example
from ..viz.registry import PlotOptions, figures_for, make_figure, save_figure


def _fail(message: str) -> typer.Exit:
    print_error(message)
    return typer.Exit(2)


def _list_figures(spec: str, heads: int, head_dim: int) -> None:
    enc = build_example(spec, heads, head_dim)
    table = Table(title=f"figures of {enc.name} ({enc.kind.value}); the first is the default")
    table.add_column("figure")
    table.add_column("what it shows")
    for name, (_, description) in figures_for(enc).items():
        table.add_row(name, description)
    console.print(table)


@app.command("plot")
def plot(
    spec: str | None = typer.Argument(None, help="encoding name or spec string, e.g. t5 or rope:base=500000"),
    out: Path | None = typer.Option(None, "--out", "-o", help="output image, .png or .svg"),
    figure_name: str | None = typer.Option(
        None,
        "--figure",
        "-f",
        help="which figure (default: the encoding's first; see --list); with --run: depth draws a "
        "passkey run's depth x length heat map",
    ),
    run: Path | None = typer.Option(
        None, "--run", help="experiment directory: plot a trained model's attention maps"
    ),
    length: int | None = typer.Option(
        None, "--length", "-n", help="positions / grid size / original context (figure-specific)"
    ),
    heads: int = typer.Option(8, "--heads", help="number of heads the encoding is built for"),
    head_dim: int = typer.Option(16, "--head-dim", help="per-head size the encoding is built for"),
    max_heads: int = typer.Option(8, "--max-heads", help="draw at most this many heads"),
    causal: bool | None = typer.Option(
        None,
        "--causal/--no-causal",
        help="mask future keys (default: attention causal, bias as the encoding defines it)",
    ),
    dpi: int = typer.Option(100, "--dpi", help="resolution of PNG output"),
    list_figures: bool = typer.Option(False, "--list", help="list the figures available for SPEC and exit"),
) -> None:
    """Draw a figure of an encoding (or, with --run, of a trained model) to a PNG or SVG file.

    Layer sizes in the spec win over --heads/--head-dim: sinusoidal:dim=512, alibi:num_heads=12.
    """
    try:
        if list_figures:
            if spec is None:
                raise ValueError("--list needs an encoding SPEC")
            _list_figures(spec, heads, head_dim)
            return
        if out is None:
            raise ValueError("--out FILE.png|FILE.svg is required")
        options = PlotOptions(length=length, max_heads=max_heads, causal=causal)
        if run is not None and figure_name == "depth":
            from ..viz.depth import run_depth_figure

            fig = run_depth_figure(run)
        elif run is not None:
            from ..viz.runs import run_attention_figure

            fig = run_attention_figure(run, encoding=spec, options=options)
        elif spec is None:
            raise ValueError("give an encoding SPEC, or --run DIR for a trained model")
        else:
            fig = make_figure(build_example(spec, heads, head_dim), figure_name, options)
        path = save_figure(fig, out, dpi=dpi)
    except (ValueError, FileNotFoundError) as err:
        raise _fail(str(err)) from err
    print_line(f"wrote {path}")


@app.command("report")
def report(
    directory: Path = typer.Argument(..., help="experiment directory (results.jsonl, config.json)"),
    out: Path | None = typer.Option(None, "--out", "-o", help="HTML file to write (default DIR/report.html)"),
    gallery: bool = typer.Option(
        False, "--gallery", help="also draw every encoding as built, untrained (its default figure)"
    ),
) -> None:
    """Write one self-contained HTML report of an experiment: the verdict (fit, ranking beyond L with
    intervals, neighbours compared), curves, per-length heat map, diagnostics from the checkpoints
    and, last, the configuration with the command that reproduces the folder."""
    from ..viz.report import write_report

    try:
        path = write_report(directory, out, gallery=gallery)
    except (ValueError, FileNotFoundError) as err:
        raise _fail(str(err)) from err
    print_line(f"wrote {path}")
