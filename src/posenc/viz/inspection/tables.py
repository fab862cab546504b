"""Absolute position tables: BERT's and MPNet's ``position_embeddings``, Whisper's ``embed_positions``
(the decoder's learned, the encoder's a fixed sinusoid), GPT-2's ``wpe``.

Found wherever the weights hold a 2-D tensor of one of :data:`TABLE_NAMES`; its shape is checked
against the config's context (:data:`LENGTHS`, per stack) and width. A table equal to a fixed
sinusoid (:func:`~posenc.pretrained.measures.sinusoid_table`, either layout, within
:data:`SINUSOID_TOLERANCE`) is reported as one; any other is learned. The page shows the cosine
similarity of every pair of rows (a learned table's band: neighbours alike, far positions not) and
each row's norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from torch import Tensor

from ...pretrained.measures import cosine_by_offset, cosine_matrix, row_norms, sinusoid_table
from .._style import DIVERGING, SEQUENTIAL
from ..registry import new_figure
from .layers import HIDDEN, Check, Encoding, Finding, first, stack_of
from .model import ModelView

__all__ = ["HEADING", "ID", "INTRO", "TableFinding", "figures", "find"]

ID = "tables"
HEADING = "Absolute position tables"
INTRO = (
    "Each row of the table is added to the token embedding at that position. Left: the cosine "
    "similarity of every pair of rows; a learned table shows a band (neighbouring positions alike), "
    "a fixed sinusoid its own regular pattern. Right: each row's norm."
)

#: The names of absolute position tables in HF's model families.
TABLE_NAMES = ("position_embeddings.weight", "embed_positions.weight", "wpe.weight")

#: The config attributes giving a table's length, per stack, first found wins.
LENGTHS = {
    "encoder": ("max_source_positions", "max_position_embeddings", "n_positions"),
    "decoder": ("max_target_positions", "max_position_embeddings", "n_positions"),
    "model": ("max_position_embeddings", "n_positions"),
}

#: How close (max abs difference) a table must be to a sinusoid to count as one (fp16 storage).
SINUSOID_TOLERANCE = 5e-3

#: The most rows whose cosine matrix is computed (a 4096 x 4096 float64 matrix is 128 MiB).
MAX_COSINE_ROWS = 4096

#: The offsets whose mean cosine the page lists.
OFFSETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class TableFinding(Finding):
    """One absolute table and its measurements.

    Attributes:
        name: the weight's name.
        norms: ``[P]`` each row's norm.
        cosine: ``[P, P]`` cosine similarity of the rows.
        by_offset: ``[P]`` the mean cosine at each offset ``d`` (``cosine_by_offset``).
        sinusoid: the sinusoid layout it equals, or None (learned).
        zero_rows: rows of norm zero (a padding row).
    """

    name: str = ""
    shape: tuple[int, ...] = ()
    norms: Any = None
    cosine: Any = None
    by_offset: Any = None
    sinusoid: str | None = None
    zero_rows: tuple[int, ...] = ()

    def table(self) -> tuple[list[str], list[list[str]]]:
        columns = ["offset d", "mean cos(row p, row p + d)"]
        rows = [[str(d), f"{self.by_offset[d]:.3f}"] for d in OFFSETS if d < len(self.by_offset)]
        return columns, rows

    def numbers(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "family": "fixed sinusoid" if self.sinusoid else "learned absolute",
            "sinusoid": self.sinusoid,
            "norms": [float(v) for v in self.norms],
            "cosine_by_offset": {
                str(d): float(self.by_offset[d]) for d in OFFSETS if d < len(self.by_offset)
            },
            "zero_rows": list(self.zero_rows),
        }


def find(view: ModelView, *, tokens: int) -> list[TableFinding]:
    """A :class:`TableFinding` for every 2-D weight named as an absolute table."""
    names = [n for n in view.weights.ending(*TABLE_NAMES) if len(view.weights.shape(n)) == 2]
    order = {"model": 0, "encoder": 1, "decoder": 2}
    names.sort(key=lambda n: order[stack_of(n, view.config)])  # an encoder's table before its decoder's
    return [_finding(view, name) for name in names]


def _finding(view: ModelView, name: str) -> TableFinding:
    stack = stack_of(name, view.config)
    table = view.weights.tensor(name)
    text = view.config if stack != "model" else view.config.get_text_config()
    length, hidden = first(text, LENGTHS[stack]), first(text, HIDDEN)
    check = Check(
        f"{stack}: {name} shape",
        f"{length} positions x hidden {hidden}",
        " x ".join(str(s) for s in table.shape),
        tuple(table.shape) == (length, hidden),
    )
    sinusoid, gap = _sinusoid(table)
    norms = row_norms(table)
    cosine = cosine_matrix(table[:MAX_COSINE_ROWS])
    by_offset = cosine_by_offset(cosine)
    zero = tuple(int(i) for i in (norms == 0).nonzero().flatten())
    family = "fixed sinusoid" if sinusoid else "learned absolute"
    options: dict[str, Any] = {"positions": table.shape[0], "width": table.shape[1]}
    if sinusoid:
        options["layout"] = sinusoid
    summary = [
        f"{name}: {family}, {table.shape[0]} positions x {table.shape[1]}"
        + (f" (equals the {sinusoid} sinusoid within {gap:.1e})" if sinusoid else ""),
        f"row norms {float(norms.min()):.3g} .. {float(norms.max()):.3g} (mean {float(norms.mean()):.3g}); "
        + "mean cosine with the next row "
        + (f"{float(by_offset[1]):.3f}" if len(by_offset) > 1 else "n/a")
        + (f", with the row 16 on {float(by_offset[16]):.3f}" if len(by_offset) > 16 else ""),
    ]
    if table.shape[0] > MAX_COSINE_ROWS:
        summary.append(f"cosines of the first {MAX_COSINE_ROWS} rows only (the table has {table.shape[0]})")
    if zero:
        summary.append(f"rows of norm zero (padding rows, never a position): {', '.join(map(str, zero))}")
    return TableFinding(
        title=name,
        encodings=(Encoding(stack, None, family, "added to the input", options),),
        checks=(check,),
        summary=tuple(summary),
        name=name,
        shape=tuple(table.shape),
        norms=norms.numpy(),
        cosine=cosine.numpy(),
        by_offset=by_offset.numpy(),
        sinusoid=sinusoid,
        zero_rows=zero,
    )


def _sinusoid(table: Tensor) -> tuple[str | None, float]:
    """``(layout, max abs difference)`` of the fixed sinusoid ``table`` equals, or ``(None, inf)``."""
    length, dim = table.shape
    if dim % 2 or dim < 4:
        return None, float("inf")
    for layout in ("halves", "interleaved"):
        gap = float((table.double() - sinusoid_table(length, dim, layout)).abs().max())
        if gap <= SINUSOID_TOLERANCE:
            return layout, gap
    return None, float("inf")


def figures(finding: TableFinding, label: str) -> list[tuple[str, Figure, str]]:
    """``[(file stem, figure, caption)]``: the cosine matrix beside the norm per position."""
    fig = new_figure(11.0, 4.6)
    grid = fig.add_gridspec(1, 2, width_ratios=(1.15, 1))
    ax = fig.add_subplot(grid[0])
    low = float(np.percentile(finding.cosine, 1))
    # Nearly every cosine positive (MPNet's table: 0.8 and up): a sequential scale from the lowest
    # percentile, so the band shows; a table with negative cosines gets the diverging scale.
    scale = (
        {"cmap": DIVERGING, "vmin": -1, "vmax": 1}
        if low < 0
        else {"cmap": SEQUENTIAL, "vmin": low, "vmax": 1}
    )
    image = ax.imshow(finding.cosine, interpolation="antialiased", **scale)
    ax.set_xlabel("position q")
    ax.set_ylabel("position p")
    ax.set_title("cos(row p, row q)")
    fig.colorbar(image, ax=ax, shrink=0.85)
    right = fig.add_subplot(grid[1])
    positions = np.arange(len(finding.norms))
    right.plot(positions, finding.norms, lw=1.2, color="#235")
    right.set_xlabel("position")
    right.set_ylabel("row norm")
    right.set_title("norm by position")
    right.grid(alpha=0.3)
    right.set_ylim(0, 1.1 * float(np.max(finding.norms)) or 1.0)  # a sinusoid's constant norm off the frame
    family = "fixed sinusoid" if finding.sinusoid else "learned"
    fig.suptitle(f"{label}: {finding.name} ({family}, {len(positions)} positions)")
    stem = finding.name.removesuffix(".weight").replace(".", "_")
    return [(f"table_{stem}", fig, f"{finding.name}: cosine similarity of the rows and the norm by position")]
