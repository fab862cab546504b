"""The figure registry: plot functions keyed by encoding name, by kind, or for every encoding.

A figure function takes a built encoding and :class:`PlotOptions` and returns a
:class:`matplotlib.figure.Figure`. It is registered with :func:`figure` under

* an encoding name (``"t5"``): figures only that family has (its bucket map);
* a :class:`~posenc.encodings.base.Kind` (``Kind.BIAS``): generic figures for every encoding of that kind,
  computed from the kind's hook (the per-head bias heatmap from ``enc.bias``);
* :data:`ANY`: figures every encoding has (its positional attention pattern).

:func:`figures_for` merges them in that order, so the first figure of the most specific key is the
default and a family never needs an ``if name == ...`` anywhere. Figures are drawn on bare
:class:`~matplotlib.figure.Figure` objects (no pyplot state), so they render headless.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..encodings.base import Kind, PositionalEncoding
from ..encodings.registry import format_spec

__all__ = [
    "ANY",
    "FigureFn",
    "PlotOptions",
    "figure",
    "figures_for",
    "make_figure",
    "new_figure",
    "save_figure",
    "set_title",
]

#: Registry key of figures every encoding has.
ANY = "*"

#: Output formats :func:`save_figure` writes.
FORMATS = (".png", ".svg")


@dataclass(frozen=True)
class PlotOptions:
    """Options shared by the figure functions (each one documents which it reads).

    Attributes:
        length: number of positions (or the query/key grid size) to draw; None = the figure's default.
        max_heads: draw at most this many heads in per-head figures.
        seed: seed of the random projections of attention-pattern figures.
        causal: mask future keys (True), show them (False), or let the figure decide (None): the
            attention pattern is causal by default, bias heatmaps hide future keys only where the
            encoding does not define them.
    """

    length: int | None = None
    max_heads: int = 8
    seed: int = 0
    causal: bool | None = None

    def __post_init__(self) -> None:
        if self.length is not None and self.length < 1:
            raise ValueError(f"length must be a positive integer, got {self.length}")
        if self.max_heads < 1:
            raise ValueError(f"max_heads must be a positive integer, got {self.max_heads}")

    def length_or(self, default: int) -> int:
        return default if self.length is None else self.length


FigureFn = Callable[[PositionalEncoding, PlotOptions], Figure]


#: The largest ``length × length`` float32 map a figure may build (256 MiB, ``-n 8192``): a bigger one
#: would exhaust memory long before it is drawn, and no image has that many pixels.
MAX_MAP_BYTES = 256 << 20


def check_map_length(length: int) -> None:
    """Refuse up front a ``length × length`` map past :data:`MAX_MAP_BYTES`, naming ``-n`` and the memory."""
    needed = length * length * 4
    if needed > MAX_MAP_BYTES:
        largest = int((MAX_MAP_BYTES // 4) ** 0.5)
        raise ValueError(
            f"-n/--length {length} asks for a {length} x {length} map: {needed / 2**30:.1f} GiB per head in "
            f"float32 (limit {MAX_MAP_BYTES >> 20} MiB); use -n {largest} or less"
        )


@dataclass(frozen=True)
class _Entry:
    fn: FigureFn
    description: str
    applies: Callable[[PositionalEncoding], bool] | None
    #: The figure builds ``length × length`` maps (attention, bias, similarity): its length is checked.
    square: bool = False


_FIGURES: dict[str | Kind, dict[str, _Entry]] = {}


def figure(
    key: str | Kind,
    name: str,
    *,
    applies: Callable[[PositionalEncoding], bool] | None = None,
    square: bool = False,
):
    """Decorator: register a figure function under an encoding name, a :class:`Kind` or :data:`ANY`.

    ``applies(enc)``, when given, says whether the figure makes sense for a particular encoding
    (an absolute heatmap of NoPE's zero-width embedding does not). ``square=True`` says the figure
    builds ``length × length`` maps, so a length past :data:`MAX_MAP_BYTES` is refused before any
    is allocated. The function's docstring's first line is the figure's description in
    ``posenc plot --list``.
    """

    def decorator(fn: FigureFn) -> FigureFn:
        table = _FIGURES.setdefault(key, {})
        if name in table:
            raise ValueError(f"figure {name!r} is already registered for {key!r}")
        doc = (fn.__doc__ or "").strip().split("\n")[0]
        table[name] = _Entry(fn, doc, applies, square)
        return fn

    return decorator


def figures_for(enc: PositionalEncoding) -> dict[str, tuple[FigureFn, str]]:
    """The figures available for ``enc``, most specific first: ``{name: (function, description)}``."""
    return {name: (entry.fn, entry.description) for name, entry in _entries_for(enc).items()}


def _entries_for(enc: PositionalEncoding) -> dict[str, _Entry]:
    merged: dict[str, _Entry] = {}
    for key in (enc.name, enc.kind, ANY):
        for name, entry in _FIGURES.get(key, {}).items():
            if name not in merged and (entry.applies is None or entry.applies(enc)):
                merged[name] = entry
    return merged


def make_figure(
    enc: PositionalEncoding, name: str | None = None, options: PlotOptions | None = None
) -> Figure:
    """Draw figure ``name`` of ``enc`` (its default figure when ``name`` is None)."""
    available = _entries_for(enc)
    if not available:
        raise ValueError(f"no figure is registered for encoding {enc.name!r} (kind {enc.kind.value})")
    if name is None:
        name = next(iter(available))
    if name not in available:
        raise ValueError(
            f"figure {name!r} is not available for encoding {enc.name!r}; choose one of: {', '.join(available)}"
        )
    options = options or PlotOptions()
    if available[name].square and options.length is not None:
        check_map_length(options.length)
    return available[name].fn(enc, options)


def new_figure(width: float = 10.0, height: float = 5.0) -> Figure:
    """A bare figure with an Agg canvas and constrained layout (no pyplot, safe headless)."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def set_title(fig: Figure, text: str) -> None:
    """``fig.suptitle(text)``, wrapped to the figure's width so long spec strings stay on the page.

    Lines break after a comma or a space, so a spec string's options are never cut in the middle.
    """
    columns = max(int(fig.get_figwidth() * 11), 40)
    lines = [""]
    for piece in re.split(r"(?<=[, ])", text):
        if lines[-1] and len(lines[-1]) + len(piece) > columns:
            lines.append("")
        lines[-1] += piece
    fig.suptitle("\n".join(line.strip() for line in lines))


def save_figure(fig: Figure, out: str | Path, dpi: int = 100) -> Path:
    """Write ``fig`` to ``out`` (``.png`` or ``.svg``), creating parent folders; returns the path."""
    path = Path(out)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"out must end in {' or '.join(FORMATS)}, got {str(out)!r}")
    if dpi < 10:
        raise ValueError(f"dpi must be at least 10, got {dpi}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # No creation date in SVG metadata: the same figure gives the same file.
    metadata = {"Date": None} if path.suffix.lower() == ".svg" else None
    fig.savefig(path, dpi=dpi, metadata=metadata)
    return path


def describe(enc: PositionalEncoding) -> str:
    """A short title for an encoding: its spec string without layer sizes."""
    config: dict[str, Any] = {
        k: v for k, v in enc.config().items() if k not in ("num_heads", "head_dim", "dim") and v is not None
    }
    return format_spec(enc.name, config)
