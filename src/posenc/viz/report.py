"""``posenc report DIR``: one self-contained HTML page for an experiment directory, read as a
results section: the verdict first, then what shows it, then why encodings fail.

Order of the page:

1. **Verdict**: the task, L, the number of seeds; the fit table in the order of the ranking beyond
   L (each score with its 95% interval across seeds), rows that did not fit listed as not ranked;
   for each pair of neighbours in the ranking, the verdict of ``posenc compare DIR A B``
   (:func:`posenc.experiments.compare.rank_rows`); and the metric-against-length figure (linear
   length axis, L marked, small multiples past six encodings; :mod:`posenc.viz.curves`).
2. **Per length**: the results as a heat map table (encoding x length, the colour the metric, the
   number in the cell where the cells are wide enough); every seed's value in a collapsed section.
3. **Why encodings fail**, from the checkpoints (:mod:`posenc.viz.diagnostics`): each trained
   model's attention at L and 2L side by side, attention entropy per head against length, and a
   learned absolute table's rows past L against their init.
4. The figures of the untrained encodings, only with ``gallery=True`` (``posenc report --gallery``).
5. **Configuration**, collapsed, with the command line that reproduces the folder.

Images are PNGs embedded as base64 ``data:`` URIs and the only style sheet is inline, so the file
opens from disk with no network. Numbers never wrap inside a table cell (``white-space: nowrap``).

Input (written by the experiment runner and read by :mod:`posenc.experiments.results`):

* ``results.jsonl``: one JSON record per line with at least ``encoding``, ``length``, ``metric``
  and ``value``; ``task``, ``seed`` and ``train_len`` are read when present.
* ``config.json`` (optional): the run's configuration (``{"experiment": {...}, "runtime": {...}}``;
  ``runtime.command`` is the command line that reproduces the folder, derived from the settings
  when a folder does not record it). The experiment's ``encodings`` list orders the encodings.
* ``checkpoints/<run id>.pt`` (optional): trained models, which the diagnostics read.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import html
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from ..examples import build_example
from ..experiments.results import (
    INTERVAL_METHOD,
    Record,
    atomic_write_text,
    experiment_settings,
    group_records,
    load_config,
    load_results,
    read_records,
)
from .curves import SMALL_MULTIPLES_ABOVE, curve_figure
from .registry import PlotOptions, describe, figures_for, make_figure

__all__ = ["render_report", "write_report"]

L_TITLE = ' title="L, the longest training size"'

#: Above this many lengths the heat map's cells are too narrow for numbers: colour only.
NUMBERS_UP_TO = 64


def _encodings_in_order(records: list[Record], config: dict[str, Any]) -> list[str]:
    seen = list(dict.fromkeys(r.encoding for r in records))
    listed = [str(e) for e in experiment_settings(config).get("encodings", []) if str(e) in seen]
    return listed + [e for e in seen if e not in listed]


# ---------------------------------------------------------------------------- HTML pieces


def _png_data_uri(fig: Figure, dpi: int = 90) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _image(fig: Figure, alt: str, dpi: int = 90, id: str | None = None) -> str:
    ident = f' id="{id}"' if id else ""
    return (
        f'<figure{ident}><img src="{_png_data_uri(fig, dpi)}" alt="{html.escape(alt)}">'
        f"<figcaption>{html.escape(alt)}</figcaption></figure>"
    )


def _command_html(directory: Path, config: dict[str, Any]) -> str:
    """The command line that reproduces the folder: recorded in ``config.json`` by the runner, or
    derived from the settings for a folder that does not record it (a merge, an older version)."""
    from ..experiments.folders import reproduce_command
    from ..experiments.train import ExperimentConfig

    runtime = config.get("runtime") if isinstance(config.get("runtime"), dict) else {}
    command, caveats = runtime.get("command"), list(runtime.get("command_caveats", []))
    how = "as recorded in config.json"
    settings = experiment_settings(config)
    if command is None and "task" in settings and "hf_model" not in settings:
        known = {f.name for f in dataclasses.fields(ExperimentConfig)}
        try:
            command, caveats = reproduce_command(
                ExperimentConfig(**{k: v for k, v in settings.items() if k in known}), directory
            )
        except (TypeError, ValueError):
            command = None
        how = "derived from config.json (this folder does not record its command)"
    if command is None and settings.get("study"):
        from ..experiments.study_plan import study_command

        command = study_command(settings, directory)
        how = "derived from config.json"
    if command is None:
        return "<p>No command line: this folder's config.json neither records nor implies one.</p>"
    notes = "".join(f'<p class="note">not reproduced: {html.escape(c)}</p>' for c in caveats)
    return (
        f'<p>Reproduce this folder ({html.escape(how)}):</p><pre id="command"><code>'
        f"{html.escape(str(command))}</code></pre>{notes}"
    )


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


def _per_seed_html(records: list[Record], encodings: list[str], metric_format: Any) -> str:
    """Every seed's value at every length: one row per (task, metric, encoding, seed)."""
    lengths = sorted({r.length for r in records})
    cells: dict[tuple[str, str, str, int], dict[int, float]] = {}
    for r in records:
        cells.setdefault((r.task, r.metric, r.encoding, r.seed), {})[r.length] = r.value
    order = {enc: i for i, enc in enumerate(encodings)}
    body = []
    for (task, metric, enc, seed), values in sorted(
        cells.items(), key=lambda item: (item[0][0], item[0][1], order.get(item[0][2], 1e9), item[0][3])
    ):
        fmt = metric_format(metric)
        row = "".join(f'<td class="num">{fmt(values[n]) if n in values else ""}</td>' for n in lengths)
        body.append(
            f"<tr><td>{html.escape(task)}</td><td>{html.escape(metric)}</td>"
            f'<td><code>{html.escape(enc)}</code></td><td class="num">{seed}</td>{row}</tr>'
        )
    head = "".join(f'<th class="num">{n}</th>' for n in lengths)
    return (
        f'<details id="per-seed"><summary>Every seed at every length ({len(records)} records, '
        f"{len({r.seed for r in records})} seed(s))</summary>"
        f'<div class="scroll"><table id="results"><thead><tr><th>task</th><th>metric</th><th>encoding</th>'
        f"<th>seed</th>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div></details>"
    )


def _compact(value: float, fraction: bool, digits: int) -> str:
    """A heat map cell: a fraction as a percentage (``digits`` decimals), other values in three
    significant figures (``1.2k`` from a thousand)."""
    if math.isnan(value):
        return ""
    if fraction:
        return f"{100 * value:.{digits}f}"
    if abs(value) >= 1000:
        return f"{value / 1000:.1f}k" if abs(value) < 1e5 else f"{value:.0e}"
    return f"{value:.3g}"


def _heatmap_html(
    records: list[Record],
    task: str,
    metric: str,
    rows: list[str],
    train_len: int | None,
    fraction: bool,
    higher_is_better: bool,
    log_colour: bool,
    label: str,
) -> str:
    """Encoding x length as a table: each cell the mean over seeds, its background the colour of
    the value (a fraction on a fixed 0-100% scale; other metrics between their smallest and largest
    value, log scaled for perplexity, the better end dark), the number written where it fits."""
    from matplotlib import colormaps

    grouped = group_records([r for r in records if r.task == task and r.metric == metric])
    lengths = sorted({r.length for r in records if r.task == task and r.metric == metric})
    means = {
        (enc, n): float(np.mean(values))
        for (_, _, enc), cells in grouped.items()
        for n, values in cells.items()
    }
    if not means:
        return ""
    values = np.asarray(list(means.values()))
    if fraction:
        low, high = 0.0, 1.0
    else:
        finite = values[np.isfinite(values)]
        low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        if log_colour and low > 0:
            low, high = math.log(low), math.log(high)
    cmap = colormaps["YlGnBu"]
    numbers = len(lengths) <= NUMBERS_UP_TO
    digits = 1 if len(lengths) <= 24 else 0

    def colour(value: float) -> tuple[str, str]:
        v = math.log(value) if (log_colour and not fraction and value > 0) else value
        t = 0.5 if high == low else (v - low) / (high - low)
        t = t if higher_is_better else 1.0 - t
        r, g, b, _ = cmap(0.05 + 0.9 * min(max(t, 0.0), 1.0))
        text = "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 0.55 else "#111"
        return f"rgb({int(255 * r)},{int(255 * g)},{int(255 * b)})", text

    def beyond(n: int) -> bool:  # the first length past L: a bar on its left
        return train_len is not None and n == train_len + 1

    head = "".join(
        f'<th class="num{" l" if beyond(n) else ""}"{L_TITLE if n == train_len else ""}>{n}</th>'
        for n in lengths
    )
    body = []
    for enc in rows:
        if not any((enc, n) in means for n in lengths):
            continue
        cells = []
        for n in lengths:
            if (enc, n) not in means:
                cells.append("<td></td>")
                continue
            value = means[(enc, n)]
            seeds = grouped[(task, metric, enc)][n]
            background, text = colour(value)
            tip = f"{enc} at {n}: {value:.4g}" + (f" (mean of {len(seeds)} seeds)" if len(seeds) > 1 else "")
            shown = _compact(value, fraction, digits) if numbers else ""
            cells.append(
                f'<td class="num{" l" if beyond(n) else ""}" style="background:{background};color:{text}" '
                f'title="{html.escape(tip)}">{shown}</td>'
            )
        body.append(f'<tr><th class="enc"><code>{html.escape(enc)}</code></th>{"".join(cells)}</tr>')
    unit = " (%)" if fraction else ""
    caption = (
        f"{html.escape(label)}{unit}, mean over seeds, by evaluation length"
        + (f"; the bar after L={train_len} starts the lengths never trained" if train_len else "")
        + ("" if numbers else "; hover a cell for its value")
    )
    return (
        f'<div class="scroll"><table class="heat" data-metric="{html.escape(metric)}"><caption>{caption}</caption>'
        f'<thead><tr><th class="enc">encoding</th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
    )


def _summary(directory: Path, config: dict[str, Any]) -> tuple[Any, Any, dict[str, str], Any]:
    """``(summary table, the task's metric, {row: "did not fit: iid 4.0%"}, experiment config)`` of
    a folder whose config names a known task and whose records score it; Nones otherwise."""
    from ..experiments.results import fit_notes, read_run_records
    from ..experiments.summary import summary_table
    from ..experiments.tasks import TASKS
    from ..experiments.train import ExperimentConfig
    from ..experiments.variants import row_labels

    settings = experiment_settings(config)
    task = settings.get("task")
    if task not in TASKS or "train_len" not in settings:
        return None, None, {}, None
    metric = TASKS[task].metric
    raw = [r for r in read_records(directory / "results.jsonl") if r.get("metric") == metric.name]
    if not raw:
        return None, None, {}, None
    known = {f.name for f in dataclasses.fields(ExperimentConfig)}
    exp = ExperimentConfig(**{k: v for k, v in settings.items() if k in known})
    seen = list(dict.fromkeys(r["encoding"] for r in raw))
    listed = row_labels(exp)  # the encodings, each followed by its variants
    rows = [e for e in listed if e in seen] + [e for e in seen if e not in listed]
    exp = dataclasses.replace(
        exp, encodings=rows, eval_variants=[], eval_len=max(exp.eval_len, exp.train_len)
    )
    table = summary_table(exp, raw, metric, read_run_records(directory))
    return table, metric, fit_notes(raw, metric, exp.train_len, rows, exp.fit_threshold), exp


def _ranking(directory: Path) -> tuple[Any, str]:
    """``(ranking or None, why not)`` (:func:`posenc.experiments.compare.rank_rows`)."""
    from ..experiments.compare import rank_rows

    try:
        return rank_rows(directory), ""
    except (ValueError, FileNotFoundError) as err:
        return None, str(err)


def _verdict_html(table: Any, unfit: dict[str, str], ranking: Any, why: str) -> str:
    """The fit table in ranking order (rank, in-distribution score with the seeds that fit, the
    score beyond L with its interval, the verdict against the next row), then each neighbour
    pair's ``posenc compare`` verdict as a sentence, naming the interval method."""
    order = {row[0]: row for row in table.rows}
    ranked = [r for r in (ranking.rows if ranking else []) if r in order]
    rest = [r for r in order if r not in ranked]
    against = {}
    if ranking is not None:
        for comparison in ranking.neighbours:
            verdict = comparison.verdict
            word = {"a": "beats", "b": "loses to"}.get(verdict, "cannot tell from")
            against[comparison.a] = f"{word} <code>{html.escape(comparison.b)}</code>"
        for (a, b), reason in ranking.uncompared.items():
            against[a] = (
                f'<span title="{html.escape(reason)}">no verdict against <code>{html.escape(b)}</code></span>'
            )
    head = "".join(f'<th class="num">{html.escape(c)}</th>' for c in table.columns[1:])
    head = f'<th class="num">rank</th><th>encoding</th>{head}<th>against the next</th>'
    body = []
    for place, name in enumerate(ranked + rest, start=1):
        row = order[name]
        mark = unfit.get(name) or (ranking.unranked.get(name) if ranking else None)
        rank = str(place) if name in ranked else "-"
        cells = "".join(f'<td class="num">{html.escape(cell)}</td>' for cell in row[1:])
        last = (
            against.get(name, "")
            if name in ranked
            else f"not ranked ({html.escape(mark or why or 'no ranking')})"
        )
        body.append(
            f'<tr class="{"fit" if name in ranked else "unfit"}"><td class="num">{rank}</td>'
            f"<td><code>{html.escape(name)}</code></td>{cells}<td>{last}</td></tr>"
        )
    sentences = ""
    if ranking is not None and (ranking.neighbours or ranking.uncompared):
        seeds = max((len(c.scores) for c in ranking.neighbours), default=1)
        method = (
            f"paired by seed, 95% {INTERVAL_METHOD} interval of the mean difference beyond L"
            if seeds > 1
            else "paired by seed; with one seed there is no interval, so no verdict (run --seeds 0,1,2)"
        )
        items = "".join(f"<li>{html.escape(c.sentence())}</li>" for c in ranking.neighbours)
        items += "".join(
            f"<li>{html.escape(a)} vs {html.escape(b)}: no verdict ({html.escape(why)})</li>"
            for (a, b), why in ranking.uncompared.items()
        )
        sentences = (
            f'<div id="neighbours"><p>Neighbours in the ranking, as <code>posenc compare DIR A B</code> '
            f"judges them ({html.escape(method)}; cannot tell when it contains 0):</p><ul>{items}</ul></div>"
        )
    notes = "".join(f'<p class="note">{html.escape(note)}</p>' for note in table.notes)
    return (
        f'<div class="scroll"><table id="summary"><thead><tr>{head}</tr></thead>'
        f'<tbody>{"".join(body)}</tbody></table></div>{sentences}<div class="notes">{notes}</div>'
    )


def _lede(records: list[Record], config: dict[str, Any], encodings: list[str], metric: Any) -> str:
    """Task, L, evaluated lengths, seeds, encodings and steps in one line."""
    settings = experiment_settings(config)
    lengths = sorted({r.length for r in records})
    parts = []
    if settings.get("task"):
        parts.append(f"task <b>{html.escape(str(settings['task']))}</b>")
    if settings.get("hf_model"):  # a pretrained model, scored as it is: L is its context
        parts.append(
            f"pretrained {html.escape(str(settings['hf_model']))}, context <b>L = {int(settings['train_len'])}</b>"
        )
    elif settings.get("train_len"):
        parts.append(f"trained on sizes &le; <b>L = {int(settings['train_len'])}</b>")
    parts.append(f"evaluated at {lengths[0]}..{lengths[-1]}")
    seeds = len({r.seed for r in records})
    parts.append(f"<b>{seeds} seed{'s' if seeds != 1 else ''}</b>")
    parts.append(f"{len(encodings)} row{'s' if len(encodings) != 1 else ''}")
    if settings.get("steps"):
        parts.append(f"{settings['steps']} steps")
    if metric is not None:
        parts.append(f"scored by {html.escape(metric.label)}")
    return f'<p class="lede">{" · ".join(parts)}</p>'


def _curves(
    records: list[Record], encodings: list[str], headline: Any, unfit: dict[str, str], width: float
) -> tuple[str, str]:
    """``(headline figure, the other metrics' figures)``: the task's metric against length first."""
    first, rest = "", []
    for task, metric in sorted({(r.task, r.metric) for r in records}):
        label = f"{task + ' · ' if task else ''}{metric} against length"
        if headline is not None and metric == headline.name:
            fig = curve_figure(
                records, task, metric, encodings, binomial=headline.fits, unfit=unfit,
                log_scale=headline.log_scale, width=width, title="",
            )  # fmt: skip
            # Small multiples: the L line's label is on the first panel; say what the grey lines are.
            many = len({r.encoding for r in records if r.metric == metric}) > SMALL_MULTIPLES_ABOVE
            alt = label + (
                "; each panel one encoding over the others in grey; band: 95% interval; dashed line: L"
                if many
                else "; band: 95% interval; dashed line: L"
            )
            first = _image(fig, alt, dpi=80, id="headline-figure")
        else:
            # A fraction (token accuracy) keeps its band inside [0, 1]; with one seed it has none
            # (the records' example counts are not its trials).
            values = [r for r in records if r.task == task and r.metric == metric]
            bounded = all(0 <= r.value <= 1 for r in values) and len({r.seed for r in values}) > 1
            fig = curve_figure(records, task, metric, encodings, width=width, binomial=bounded)
            rest.append(_image(fig, label, dpi=80))
    if not first and rest:
        first, rest = rest[0], rest[1:]
    return first, "".join(rest)


def _diagnostics_html(directory: Path, encodings: list[str]) -> str:
    """Why encodings fail, from the checkpoints: attention at L and 2L, entropy per head against
    length, and a learned table's untrained rows."""
    from . import diagnostics
    from .runs import find_checkpoints

    try:
        checkpoints = find_checkpoints(directory)
    except (TypeError, ValueError, FileNotFoundError) as err:
        return f'<p class="note">No diagnostics: {html.escape(str(err))}</p>'
    if not checkpoints:
        return "<p>No checkpoints in this directory: the diagnostics read the trained models.</p>"
    order = {enc: i for i, enc in enumerate(encodings)}
    checkpoints = dict(sorted(checkpoints.items(), key=lambda item: order.get(item[0], 1e9)))
    parts = [
        "<h3>Attention at L and at 2L</h3>",
        "<p>One evaluation example of size L and one of size 2L per trained model (first seed), one row "
        "per layer, the mean over its heads. Dotted lines in the 2L map: the last position a training "
        "example reaches; below and right of them, every query or key position is new to the model.</p>",
        '<div class="grid">',
    ]
    failures = []
    for encoding, path in checkpoints.items():
        try:
            fig = diagnostics.attention_at_lengths_figure(path)
        except (ValueError, RuntimeError, KeyError) as err:
            failures.append(f"{encoding}: {err}")
            continue
        parts.append(_image(fig, f"attention of the trained model at L and 2L: {encoding}", dpi=72))
    parts.append("</div>")
    parts += [
        "<h3>Attention entropy against length</h3>",
        "<p>Per head (coloured by layer) the entropy of its attention, averaged over the queries of 8 "
        "examples of each size; dashed: attention spread evenly over the visible keys. A head whose "
        "entropy climbs toward that line past L disperses: it spreads over more keys than it learnt to "
        "choose from.</p>",
    ]
    try:
        parts.append(
            _image(diagnostics.entropy_figure(checkpoints), "attention entropy per head against size", dpi=72)
        )
    except (ValueError, RuntimeError, KeyError) as err:
        failures.append(f"entropy: {err}")
    for encoding, path in checkpoints.items():
        try:
            fig = diagnostics.learned_table_figure(path, encoding)
        except (ValueError, RuntimeError, KeyError) as err:
            failures.append(f"{encoding}: {err}")
            continue
        if fig is not None:
            _, drift, reached = diagnostics.learned_table_drift(path)  # type: ignore[misc]
            moved = float(drift[reached:].max()) if len(drift) > reached else 0.0
            verdict = (
                f"Rows {reached}..{len(drift) - 1}, past the last position a training example reaches, "
                "got no gradient: they are exactly their random init, which is what the model reads "
                "beyond L."
                if moved == 0
                else f"Rows past position {reached - 1} moved too (largest change {moved:.2g}): training "
                "reached them (randomized or packed positions)."
            )
            parts += [
                f"<h3>Learned positions past L: <code>{html.escape(encoding)}</code></h3>",
                "<p>The trained table and how far each row moved from its initialisation (rebuilt from "
                f"the run's seed). {html.escape(verdict)}</p>",
                _image(fig, f"learned absolute table after training: {encoding}", dpi=72),
            ]
    parts += [f'<p class="note">No diagnostic for {html.escape(f)}</p>' for f in failures]
    return "".join(parts)


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


def _depth_section(directory: Path, encodings: list[str], study: bool) -> list[tuple[str, str, str]]:
    """The passkey depth x length heat map, when the records carry depths (none otherwise);
    ``study``: a pretrained model's study, whose prompts are measured in tokens."""
    from .depth import depth_heatmap_figure, has_depths
    from .hf_study import PROMPT_LENGTH

    raw = read_records(directory / "results.jsonl")
    if not has_depths(raw):
        return []
    kw = {"length_label": PROMPT_LENGTH} if study else {}
    figure = _image(depth_heatmap_figure(raw, encodings, **kw), "exact match by needle depth and length")
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
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: .8em auto 2em; max-width: 1240px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.3em; margin: .2em 0; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc;
       padding-bottom: .2em; margin: 1.6em 0 .5em; } h3 { font-size: 1.05em; margin: 1.2em 0 .4em; }
#verdict h2 { margin-top: .4em; }
.lede { margin: .2em 0 .4em; } p { margin: .4em 0; }
table { border-collapse: collapse; margin: .4em 0; font-size: .85em; }
th, td { border: 1px solid #ddd; padding: .15em .5em; text-align: left; vertical-align: top; white-space: nowrap; }
thead th { background: #f3f3f3; } .num { text-align: right; font-variant-numeric: tabular-nums; }
#summary tr.unfit td { color: #888; }
#neighbours ul { margin: .2em 0; padding-left: 1.4em; columns: 2; font-size: .85em; }
#neighbours p, .notes p { font-size: .85em; margin: .2em 0; } .notes p.note { color: #666; }
table.heat { font-size: 10px; } table.heat td, table.heat th { padding: 1px; border: 1px solid #fff; }
table.heat th.enc { text-align: left; background: #f3f3f3; }
table.heat .l { border-left: 3px solid #222; }
table.heat caption { caption-side: top; text-align: left; font-size: 12px; color: #555; padding-bottom: 2px; }
figure { margin: .4em 0; } img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: .8em; color: #555; } .note { color: #a33; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(380px, 1fr)); gap: .5em; }
.scroll { overflow-x: auto; }
details { margin: .5em 0; } summary { cursor: pointer; color: #235; }
pre { background: #f6f6f6; padding: .5em; overflow-x: auto; }
code { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: .9em; }
"""


def render_report(directory: str | Path, *, gallery: bool = False) -> str:
    """The HTML page for experiment ``directory`` as a string; ``gallery``: add the default figure
    of every encoding as built untrained (``posenc report --gallery``)."""
    directory = Path(directory)
    records = load_results(directory)
    config = load_config(directory)
    encodings = _encodings_in_order(records, config)
    table, headline, unfit, exp = _summary(directory, config)
    ranking, why = _ranking(directory) if table is not None else (None, "")
    rows = encodings
    if ranking is not None:  # the ranking's order everywhere below the verdict
        rows = [r for r in ranking.rows if r in encodings] + [r for r in encodings if r not in ranking.rows]
    first, other_curves = _curves(records, rows, headline, unfit, width=12.0)
    verdict = _lede(records, config, encodings, headline)
    if table is not None:
        verdict += _verdict_html(table, unfit, ranking, why)
    verdict += first
    train_len = exp.train_len if exp is not None else None
    heat = []
    for task, metric in sorted(
        {(r.task, r.metric) for r in records}, key=lambda tm: (headline is None or tm[1] != headline.name, tm)
    ):
        is_headline = headline is not None and metric == headline.name
        fraction = (
            headline.fits if is_headline else all(0 <= r.value <= 1 for r in records if r.metric == metric)
        )
        heat.append(
            _heatmap_html(
                records, task, metric, rows, train_len, fraction,
                headline.higher_is_better if is_headline else True,
                bool(headline.log_scale) if is_headline else False,
                headline.label if is_headline else metric.replace("_", " "),
            )
        )  # fmt: skip
    formats = {headline.name: headline.format} if headline is not None else {}
    per_length = (
        _missing_html(directory, config)
        + "".join(heat)
        + other_curves
        + _per_seed_html(records, rows, lambda m: formats.get(m, lambda v: f"{v:.4g}"))
    )
    variants = {str(r["encoding"]) for r in read_records(directory / "results.jsonl") if "variant" in r}
    title = f"posenc report: {directory.resolve().name}"
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sections = [
        ("verdict", "Which encodings extrapolate beyond L, and how sure", verdict),
        ("per-length", "Per length", per_length),
        *_depth_section(directory, rows, bool(experiment_settings(config).get("study"))),
        *_published_section(directory, config),
    ]
    if "hf_model" not in experiment_settings(config):  # the diagnostics read trained checkpoints
        sections.append(
            ("diagnostics", "Why encodings fail: the trained models", _diagnostics_html(directory, rows))
        )
    if gallery:
        figures = _encoding_figures_html([e for e in encodings if e not in variants], config)
        sections.append(("encodings", "The encodings, untrained", figures))
    configuration = (
        f'<details id="configuration"><summary>Settings ({html.escape(str(directory))}, generated {when})'
        f"</summary>{_config_html(config)}</details>"
    )
    sections.append(("config", "Configuration", _command_html(directory, config) + configuration))
    body = "".join(
        f'<section id="{sid}"><h2>{html.escape(heading)}</h2>{content}</section>'
        for sid, heading, content in sections
    )
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f"{body}</body></html>\n"
    )


def write_report(directory: str | Path, out: str | Path | None = None, *, gallery: bool = False) -> Path:
    """Write the report of ``directory`` to ``out`` (default ``directory/report.html``); ``gallery``:
    see :func:`render_report`."""
    path = Path(out) if out is not None else Path(directory) / "report.html"
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"report output must end in .html, got {str(path)!r}")
    _check_writable(path, out is None)  # before the figures are drawn
    text = render_report(directory, gallery=gallery)
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
