"""The HTML pieces every section uses: an embedded figure, a note, a plain table, the style sheet."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable

from matplotlib.figure import Figure

__all__ = ["STYLE", "image", "note", "table"]


def png_data_uri(fig: Figure, dpi: int = 90) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def image(fig: Figure, alt: str, dpi: int = 90, id: str | None = None) -> str:
    """``fig`` as an embedded PNG with ``alt`` as its caption."""
    ident = f' id="{id}"' if id else ""
    return (
        f'<figure{ident}><img src="{png_data_uri(fig, dpi)}" alt="{html.escape(alt)}">'
        f"<figcaption>{html.escape(alt)}</figcaption></figure>"
    )


def note(text: str, id: str | None = None) -> str:
    """A note in the page's warning colour (``text`` is escaped)."""
    ident = f' id="{id}"' if id else ""
    return f'<p class="note"{ident}>{html.escape(text)}</p>'


def table(id: str, columns: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    """A plain table of text cells (each escaped) with a header row."""
    head = "".join(f"<th>{html.escape(column)}</th>" for column in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows
    )
    return f'<table id="{id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


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
