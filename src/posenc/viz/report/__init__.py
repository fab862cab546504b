"""``posenc report DIR``: one self-contained HTML page for an experiment directory, read as a
results section: the verdict first, then what shows it, then why encodings fail.

:func:`~.view.read_folder` reads the folder once into a :class:`~.view.FolderView`; each section of
the page is one module whose ``render(view)`` gives its HTML (None: the section does not apply).
In the order of the page:

1. **Verdict** (:mod:`.verdict`): the task, L, the number of seeds; the fit table in the order of
   the ranking beyond L (each score with its 95% interval across seeds), rows that did not fit
   listed as not ranked; for each pair of neighbours in the ranking, the verdict of ``posenc
   compare DIR A B`` (:func:`posenc.experiments.results.compare.rank_rows`); and the metric-against-length
   figure (linear length axis, L marked, small multiples past six encodings; :mod:`.length_curves`).
2. **Per length** (:mod:`.per_length`): the results as a heat map table (encoding x length, the
   colour the metric, the number in the cell where the cells are wide enough); every seed's value
   in a collapsed section.
3. **Retrieval by depth** (:mod:`.depth`), when the records carry depths (passkey).
4. **Published beside ours** (:mod:`.published`), for a ``--preset`` run.
5. **Why encodings fail**, from the checkpoints (:mod:`.diagnostics`): each trained model's
   attention at L and 2L side by side, attention entropy per head against length, and a learned
   absolute table's rows past L against their init.
6. The figures of the untrained encodings (:mod:`.gallery`), only with ``gallery=True`` (``posenc
   report --gallery``).
7. **Configuration** (:mod:`.configuration`), collapsed, with the command line that reproduces the
   folder.

Images are PNGs embedded as base64 ``data:`` URIs and the only style sheet is inline
(:mod:`.pieces`), so the file opens from disk with no network. Numbers never wrap inside a table
cell (``white-space: nowrap``).

Input (written by the experiment runner and read by :mod:`posenc.experiments.results.records`):

* ``results.jsonl``: one JSON record per line with at least ``encoding``, ``length``, ``metric``
  and ``value``; ``task``, ``seed`` and ``train_len`` are read when present.
* ``config.json`` (optional): the run's configuration (``{"experiment": {...}, "runtime": {...}}``;
  ``runtime.command`` is the command line that reproduces the folder, derived from the settings
  when a folder does not record it). The experiment's ``encodings`` list orders the encodings.
* ``checkpoints/<run id>.pt`` (optional): trained models, which the diagnostics read.
"""

from __future__ import annotations

import html
from pathlib import Path

from ...experiments.results.records import atomic_write_text, cannot_create_in
from . import configuration, depth, diagnostics, gallery, per_length, published, verdict
from .pieces import STYLE
from .view import FolderView, read_folder

__all__ = ["FolderView", "read_folder", "render_report", "write_report"]

#: The sections in the order of the page; the gallery only on request.
SECTIONS = (verdict, per_length, depth, published, diagnostics, gallery, configuration)


def render_report(directory: str | Path, *, gallery: bool = False) -> str:
    """The HTML page for experiment ``directory`` as a string; ``gallery``: add the default figure
    of every encoding as built untrained (``posenc report --gallery``)."""
    view = read_folder(directory)
    body = ""
    for section in SECTIONS:
        if section.ID == "encodings" and not gallery:
            continue
        content = section.render(view)
        if content is not None:
            body += f'<section id="{section.ID}"><h2>{html.escape(section.HEADING)}</h2>{content}</section>'
    title = html.escape(f"posenc report: {view.directory.resolve().name}")
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{STYLE}</style></head><body><h1>{title}</h1>"
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
