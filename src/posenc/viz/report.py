"""``posenc report DIR``: one self-contained HTML page for an experiment directory.

The page holds the run's configuration, the results table (mean over seeds per task, encoding,
metric and length), metric-against-length curves with one line per encoding, the default figure
of every encoding in the run and, when the run saved checkpoints, a trained model's attention
maps. Images are PNGs embedded as base64 ``data:`` URIs and the only style sheet is inline, so the
file opens from disk with no network.

Input (written by the experiment runner and read by :mod:`posenc.experiments.results`):

* ``results.jsonl``: one JSON record per line with at least ``encoding``, ``length``, ``metric``
  and ``value``; ``task``, ``seed`` and ``train_len`` are read when present (the runner's record
  also carries ``run``, ``steps`` and ``examples``, which the page does not need).
* ``config.json`` (optional): the run's configuration (the runner writes ``{"experiment": {...},
  "runtime": {...}}``), shown as it is. The experiment's ``encodings`` list orders the encodings;
  its ``num_heads`` and ``d_model`` size the encoding figures.
* ``checkpoints/<run id>.pt`` (optional): trained models, whose attention maps are drawn.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import html
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from ..examples import build_example
from ..experiments.results import (
    Record,
    atomic_write_text,
    experiment_settings,
    group_records,
    load_config,
    load_results,
    read_records,
)
from .curves import curve_figure
from .registry import PlotOptions, describe, figures_for, make_figure

__all__ = ["render_report", "write_report"]


def _encodings_in_order(records: list[Record], config: dict[str, Any]) -> list[str]:
    seen = list(dict.fromkeys(r.encoding for r in records))
    listed = [str(e) for e in experiment_settings(config).get("encodings", []) if str(e) in seen]
    return listed + [e for e in seen if e not in listed]


def _format(values: list[float]) -> str:
    mean = float(np.mean(values))
    text = f"{mean:.4g}"
    if len(values) > 1:
        text += f" ± {float(np.std(values)):.2g}"
    return text


# ---------------------------------------------------------------------------- HTML pieces


def _png_data_uri(fig: Figure, dpi: int = 90) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _image(fig: Figure, alt: str) -> str:
    return f'<figure><img src="{_png_data_uri(fig)}" alt="{html.escape(alt)}"><figcaption>{html.escape(alt)}</figcaption></figure>'


def _config_html(config: dict[str, Any]) -> str:
    if not config:
        return "<p>No config.json in this directory.</p>"
    # One level of nesting ({"experiment": {...}, "runtime": {...}}) becomes dotted keys.
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{inner}": item for inner, item in value.items()})
        else:
            flat[key] = value
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td><code>{html.escape(json.dumps(v))}</code></td></tr>"
        for k, v in flat.items()
    )
    return f'<table id="config">{rows}</table>'


def _results_html(records: list[Record], encodings: list[str]) -> str:
    lengths = sorted({r.length for r in records})
    grouped = group_records(records)
    head = "".join(f"<th>{n}</th>" for n in lengths)
    body = []
    for task, metric in sorted({(r.task, r.metric) for r in records}):
        for enc in encodings:
            cells = grouped.get((task, metric, enc))
            if not cells:
                continue
            values = "".join(f"<td>{_format(cells[n]) if n in cells else ''}</td>" for n in lengths)
            body.append(
                f"<tr><td>{html.escape(task)}</td><td>{html.escape(metric)}</td>"
                f"<td><code>{html.escape(enc)}</code></td>{values}</tr>"
            )
    seeds = len({r.seed for r in records})
    return (
        f"<p>{len(records)} records, {seeds} seed(s); cells are the mean over seeds (± standard deviation).</p>"
        f'<div class="scroll"><table id="results"><thead><tr><th>task</th><th>metric</th><th>encoding</th>{head}</tr>'
        f'<tr><th></th><th></th><th></th><th colspan="{len(lengths)}">evaluation length</th></tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _curves_html(records: list[Record], encodings: list[str], headline: Any = None, unfit: Any = None) -> str:
    """One figure per (task, metric); the headline metric's (``headline``, a task's
    :class:`~posenc.experiments.tasks.Metric`) gets binomial bands and marks the rows in ``unfit``."""
    parts = []
    for task, metric in sorted({(r.task, r.metric) for r in records}):
        label = f"{task + ' · ' if task else ''}{metric} against length"
        extra = {}
        if headline is not None and metric == headline.name:
            extra = {"binomial": headline.fits, "unfit": unfit}
        parts.append(_image(curve_figure(records, task, metric, encodings, **extra), label))
    return "".join(parts)


def _summary(directory: Path, config: dict[str, Any]) -> tuple[Any, Any, dict[str, str]]:
    """``(summary table, the task's metric, {row: "did not fit: iid 4.0%"})`` of a folder whose
    config names a known task and whose records score it; ``(None, None, {})`` otherwise."""
    from ..experiments.results import fit_notes, read_run_records
    from ..experiments.summary import summary_table
    from ..experiments.tasks import TASKS
    from ..experiments.train import ExperimentConfig
    from ..experiments.variants import row_labels

    settings = experiment_settings(config)
    task = settings.get("task")
    if task not in TASKS or "train_len" not in settings:
        return None, None, {}
    metric = TASKS[task].metric
    raw = [r for r in read_records(directory / "results.jsonl") if r.get("metric") == metric.name]
    if not raw:
        return None, None, {}
    known = {f.name for f in dataclasses.fields(ExperimentConfig)}
    exp = ExperimentConfig(**{k: v for k, v in settings.items() if k in known})
    seen = list(dict.fromkeys(r["encoding"] for r in raw))
    listed = row_labels(exp)  # the encodings, each followed by its variants
    rows = [e for e in listed if e in seen] + [e for e in seen if e not in listed]
    exp = dataclasses.replace(
        exp, encodings=rows, eval_variants=[], eval_len=max(exp.eval_len, exp.train_len)
    )
    table = summary_table(exp, raw, metric, read_run_records(directory))
    return table, metric, fit_notes(raw, metric, exp.train_len, rows, exp.fit_threshold)


def _summary_html(table: Any, unfit: dict[str, str]) -> str:
    """The summary table: in-distribution score with fit flags, the score beyond L with its 95%
    interval across seeds, one row per encoding and variant; rows that did not fit are marked."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in [*table.columns, "ranked"])
    body = []
    for row in table.rows:
        mark = unfit.get(row[0])
        cells = "".join(f"<td>{html.escape(cell)}</td>" for cell in row[1:])
        status = f"not ranked ({html.escape(mark)})" if mark else "yes"
        body.append(
            f'<tr class="{"unfit" if mark else "fit"}"><td><code>{html.escape(row[0])}</code></td>{cells}'
            f"<td>{status}</td></tr>"
        )
    notes = "".join(f'<p class="note">{html.escape(note)}</p>' for note in table.notes)
    return (
        f"<p>{html.escape(table.title)}</p>"
        f'<div class="scroll"><table id="summary"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>{notes}"
    )


def _encoding_figures_html(encodings: list[str], config: dict[str, Any]) -> str:
    settings = experiment_settings(config)
    heads = int(settings.get("num_heads") or 8)
    head_dim = int(
        settings.get("head_dim") or (int(settings["d_model"]) // heads if settings.get("d_model") else 16)
    )
    parts = []
    for spec in encodings:
        try:
            enc = build_example(spec, heads, head_dim)
            name = next(iter(figures_for(enc)))
            fig = make_figure(enc, name, PlotOptions())
        except (ValueError, StopIteration) as err:
            # Shown on the page, not hidden: the reader sees which figure is missing and why.
            parts.append(
                f'<p class="note">No figure for <code>{html.escape(spec)}</code>: {html.escape(str(err))}</p>'
            )
            continue
        parts.append(_image(fig, f"{describe(enc)}: {name}"))
    return "".join(parts)


def _attention_html(directory: Path) -> str:
    from .runs import find_checkpoints, run_attention_figure

    checkpoints = find_checkpoints(directory)
    if not checkpoints:
        return "<p>No checkpoints in this directory.</p>"
    parts = []
    for encoding in checkpoints:
        try:
            fig = run_attention_figure(directory, encoding=encoding, options=PlotOptions(max_heads=4))
        except (ValueError, FileNotFoundError) as err:
            parts.append(
                f'<p class="note">No attention maps for <code>{html.escape(encoding)}</code>: {html.escape(str(err))}</p>'
            )
            continue
        parts.append(_image(fig, f"attention maps of the trained model: {encoding}"))
    return "".join(parts)


def _depth_section(directory: Path, encodings: list[str]) -> list[tuple[str, str, str]]:
    """The passkey depth x length heat map, when the records carry depths (none otherwise)."""
    from .depth import depth_heatmap_figure, has_depths

    raw = read_records(directory / "results.jsonl")
    if not has_depths(raw):
        return []
    figure = _image(depth_heatmap_figure(raw, encodings), "exact match by needle depth and length")
    return [("depth", "Retrieval by depth and length", figure)]


def _missing_html(directory: Path, config: dict[str, Any]) -> str:
    """A warning naming the runs of the (encoding x seed) grid that have no results (a shard)."""
    from ..experiments.results import read_records
    from ..experiments.shards import missing_runs_note

    settings = experiment_settings(config)
    if not {"task", "encodings", "seeds"} <= settings.keys():
        return ""
    raw = read_records(directory / "results.jsonl")
    note = missing_runs_note(settings["task"], settings["encodings"], settings["seeds"], raw)
    return f'<p class="note" id="missing">{html.escape(note)}</p>' if note else ""


def _published_section(directory: Path, config: dict[str, Any]) -> list[tuple[str, str, str]]:
    """For a ``--preset`` run: the paper's numbers beside ours, with the source."""
    if not config.get("preset"):
        return []
    from ..experiments.presets import comparison_for_folder

    try:
        table = comparison_for_folder(directory)
    except ValueError as err:
        return [("published", "Published beside ours", f'<p class="note">{html.escape(str(err))}</p>')]
    head = "".join(f"<th>{html.escape(column)}</th>" for column in table.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in table.rows
    )
    notes = "".join(f"<p>{html.escape(note)}</p>" for note in table.notes)
    content = (
        f'<p>{html.escape(table.title)}</p><table id="published"><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table>{notes}"
    )
    return [("published", "Published beside ours", content)]


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: 1em 0; font-size: .9em; }
th, td { border: 1px solid #ddd; padding: .3em .6em; text-align: left; vertical-align: top; }
thead th { background: #f3f3f3; }
#results td:nth-child(n+4) { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; } img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: .85em; color: #555; } .note { color: #a33; }
#summary tr.unfit td { color: #888; } #summary td:nth-child(n+2) { text-align: right; }
.scroll { overflow-x: auto; }
code { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: .9em; }
"""


def render_report(directory: str | Path) -> str:
    """The HTML page for experiment ``directory`` as a string."""
    directory = Path(directory)
    records = load_results(directory)
    config = load_config(directory)
    encodings = _encodings_in_order(records, config)
    table, headline, unfit = _summary(directory, config)
    summary = (
        [] if table is None else [("summary", "Fit, intervals and variants", _summary_html(table, unfit))]
    )
    variants = {str(r["encoding"]) for r in read_records(directory / "results.jsonl") if "variant" in r}
    title = f"posenc report: {directory.resolve().name}"
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sections = [
        ("config", "Configuration", _config_html(config)),
        *summary,
        ("results-section", "Results", _missing_html(directory, config) + _results_html(records, encodings)),
        ("curves", "Metric against length", _curves_html(records, encodings, headline, unfit)),
        *_depth_section(directory, encodings),
        *_published_section(directory, config),
        (
            "encodings",
            "The encodings",
            _encoding_figures_html([e for e in encodings if e not in variants], config),
        ),
        ("attention", "Attention maps of the trained models", _attention_html(directory)),
    ]
    body = "".join(
        f'<section id="{sid}"><h2>{html.escape(heading)}</h2>{content}</section>'
        for sid, heading, content in sections
    )
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>Directory <code>{html.escape(str(directory))}</code>, {len(encodings)} encoding(s), generated {when}.</p>"
        f"{body}</body></html>\n"
    )


def write_report(directory: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of ``directory`` to ``out`` (default ``directory/report.html``)."""
    path = Path(out) if out is not None else Path(directory) / "report.html"
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"report output must end in .html, got {str(path)!r}")
    _check_writable(path, out is None)  # before the figures are drawn
    text = render_report(directory)
    try:
        atomic_write_text(path, text)
    except OSError as err:
        raise ValueError(_cannot_write(path, str(err.strerror or err), out is None)) from err
    return path


def _cannot_write(path: Path, why: str, default: bool) -> str:
    fix = "write it elsewhere with --out FILE.html" if default else "give --out a writable FILE.html"
    where = " (the default, inside the experiment folder)" if default else ""
    return f"cannot write the report to {path}{where}: {why}; {fix}"


def _check_writable(path: Path, default: bool) -> None:
    """``ValueError`` naming ``path`` and what to do when its folder cannot be written (read-only
    experiment folders are common: an archived or shared result)."""
    from ..experiments.results import cannot_create_in

    if path.is_dir():
        raise ValueError(_cannot_write(path, "it is a folder", default))
    existing = path.parent
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(_cannot_write(path, f"{existing} is not a folder", default))
    problem = cannot_create_in(existing)
    if problem:
        raise ValueError(_cannot_write(path, problem, default))
