"""The folder ``posenc inspect`` writes: ``index.html`` (self-contained: figures embedded as PNG
``data:`` URIs, the report's inline style sheet), ``inspect.json`` (every number the page shows) and
``figures/<name>.png`` (the same figures as files).

:func:`write_folder` builds it in a temporary folder beside ``--out`` and renames it into place; a
previous ``posenc inspect`` folder there (one holding ``inspect.json``) is replaced whole, any other
non-empty folder refused.
"""

from __future__ import annotations

import base64
import html
import io
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure

from ..report.pieces import STYLE, table
from .layers import Check, LayerRow, join_layers
from .model import InspectError

if TYPE_CHECKING:
    from . import Inspection

__all__ = ["MARKER", "render_page", "write_folder"]

#: The file that marks a folder as ``posenc inspect``'s (and holds its numbers).
MARKER = "inspect.json"

#: Resolution of the figures (PNG).
DPI = 90

EXTRA_STYLE = """
tr.disagrees td { color: #a33; font-weight: 600; } ul.summary { font-size: .9em; margin: .3em 0; }
ul.summary li { margin: .15em 0; } #layers td:nth-child(5) { white-space: normal; min-width: 16em; }
"""


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _figure(stem: str, fig: Figure, caption: str, folder: Path) -> str:
    """Write ``fig`` to ``folder/stem.png`` and return it embedded, with ``caption``."""
    data = _png(fig)
    (folder / f"{stem}.png").write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    return (
        f'<figure id="fig-{html.escape(stem)}"><img src="{uri}" alt="{html.escape(caption)}">'
        f"<figcaption>{html.escape(caption)} (<code>figures/{html.escape(stem)}.png</code>)</figcaption></figure>"
    )


def _options(options: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in options.items())


def layer_table(rows: list[LayerRow]) -> tuple[list[str], list[list[str]]]:
    """``(columns, rows)`` of the encoding per stack and layer type; a cell of several encodings holds
    one line per encoding."""
    columns = ["stack", "layer type", "layers", "encoding", "options", "window", "heads (q / kv)", "head dim"]
    cells = []
    for row in rows:
        encodings = row.encodings or ()
        cells.append(
            [
                row.stack,
                row.layer_type or "every layer",
                join_layers(row.layers) if row.layers else "?",
                "\n".join(f"{e.family} ({e.where})" for e in encodings) or "none found",
                "\n".join(_options(e.options) for e in encodings),
                str(row.window) if row.window else "-",
                f"{row.heads} / {row.kv_heads}",
                str(row.head_dim),
            ]
        )
    return columns, cells


def _layer_html(rows: list[LayerRow]) -> str:
    """:func:`layer_table` as HTML, each encoding of a cell on a line of its own."""
    columns, cells = layer_table(rows)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell).replace(chr(10), '<br>')}</td>" for cell in row) + "</tr>"
        for row in cells
    )
    return f'<table id="layers"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _checks(checks: list[Check]) -> str:
    ordered = sorted(checks, key=lambda c: c.agrees)
    head = "".join(f"<th>{c}</th>" for c in ("", "what", "the config says", "the weights say"))
    body = "".join(
        f'<tr class="{"agrees" if c.agrees else "disagrees"}"><td>{"ok" if c.agrees else "DISAGREE"}</td>'
        f"<td>{html.escape(c.what)}</td><td>{html.escape(c.config)}</td><td>{html.escape(c.weights)}</td></tr>"
        for c in ordered
    )
    wrong = [c for c in checks if not c.agrees]
    lede = (
        f'<p class="note">{len(wrong)} of {len(checks)} checks disagree: the config does not describe these weights.</p>'
        if wrong
        else f"<p>All {len(checks)} checks agree.</p>"
    )
    return f'{lede}<table id="checks"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _family_section(family, found: list, label: str, folder: Path) -> str:
    parts = [f"<p>{html.escape(family.INTRO)}</p>"]
    for index, finding in enumerate(found):
        parts.append(f"<h3><code>{html.escape(finding.title)}</code></h3>")
        items = "".join(f"<li>{html.escape(line)}</li>" for line in finding.summary)
        parts.append(f'<ul class="summary">{items}</ul>')
        columns, rows = finding.table()
        if rows:
            parts.append(f'<div class="scroll">{table(f"{family.ID}-{index}", columns, rows)}</div>')
        for stem, fig, caption in family.figures(finding, label):
            parts.append(_figure(stem, fig, caption, folder))
    return "".join(parts)


def render_page(inspection: Inspection, figures: Path, families: Sequence) -> str:
    """The HTML page of ``inspection``; its figures are also written into the folder ``figures``.
    ``families``: the family sections in the page's order (each with ``ID``, ``HEADING``, ...)."""
    view = inspection.view
    architectures = ", ".join(getattr(view.config, "architectures", None) or []) or "none named"
    title = html.escape(f"posenc inspect: {view.label}")
    body = (
        f'<p class="lede">{html.escape(view.config.model_type)} ({html.escape(architectures)}), read from '
        f"the {html.escape(view.source)} <code>{html.escape(str(view.path))}</code>.</p>"
        f'<section id="encodings"><h2>Encoding per layer type</h2>{_layer_html(inspection.rows)}'
        f"</section>"
        f'<section id="agreement"><h2>The config against the weights</h2>{_checks(inspection.checks)}</section>'
    )
    for family in families:
        found = inspection.findings.get(family.ID)
        if found:
            content = _family_section(family, found, view.label, figures)
            body += f'<section id="{family.ID}"><h2>{html.escape(family.HEADING)}</h2>{content}</section>'
    body += (
        f'<section id="command"><h2>Reproduce</h2><pre><code>{html.escape(inspection.command)}'
        "</code></pre></section>"
    )
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{STYLE}{EXTRA_STYLE}</style></head><body><h1>{title}</h1>{body}</body></html>\n"
    )


def _check_target(out: Path) -> None:
    """Refuse an ``--out`` that is a file, or a non-empty folder not written by ``posenc inspect``."""
    if out.exists() and not out.is_dir():
        raise InspectError(
            f"--out {out}: a file is there; give a folder (posenc inspect writes index.html in it)"
        )
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise InspectError(
            f"--out {out}: a folder that holds other files (no {MARKER}: not a posenc inspect folder); "
            "give an empty or new folder"
        )


def write_folder(inspection: Inspection, out: Path, families: Sequence) -> Path:
    """Write ``index.html``, ``inspect.json`` and ``figures/`` into ``out`` all at once (a temporary
    folder beside it, renamed); returns ``out/index.html``. ``families``: as :func:`render_page`."""
    _check_target(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    except OSError as err:
        raise InspectError(
            f"--out {out}: cannot create it ({err.strerror or err}); give a writable folder"
        ) from err
    try:
        figures = scratch / "figures"
        figures.mkdir()
        (scratch / "index.html").write_text(render_page(inspection, figures, families), encoding="utf-8")
        text = json.dumps(inspection.numbers(), indent=1, default=str)
        (scratch / MARKER).write_text(text + "\n", encoding="utf-8")
        scratch.chmod(0o755)
        _replace(scratch, out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return out / "index.html"


def _replace(scratch: Path, out: Path) -> None:
    """Move ``scratch`` to ``out``; an existing ``out`` is moved aside first and removed after."""
    if not out.exists():
        scratch.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    try:
        scratch.rename(out)
    except OSError:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)
