"""The pieces both pages (the run report, the comparison) are made of: style, tables, embedded plots.

A page is one self-contained HTML file: no external file, script or font; each plot is a PNG
embedded as a base64 data URI, so the page can be mailed, attached to a ticket or opened from an
object store as is.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from typing import Any, Iterable

from matplotlib.figure import Figure

from batchinfer.observe import margins

CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.1em}h2{font-size:1.2em;margin-top:1.8em;border-bottom:1px solid #ddd}
h3{font-size:1em;margin:1.2em 0 .3em}.sub{color:#666;margin-top:0}
table{border-collapse:collapse;margin:.5em 0}th,td{padding:.25em .7em;text-align:left;border-bottom:1px solid #eee;vertical-align:top}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}img{display:block;max-width:100%;margin:.6em 0}
pre{background:#f6f6f6;padding:.8em;overflow:auto;font-size:.85em}.bad{color:#b00}.note{color:#666;font-size:.9em}
.facts{display:grid;grid-template-columns:repeat(auto-fill,minmax(240px,1fr));gap:.6em;margin:1em 0}
.fact{background:#f6f7f9;border-radius:6px;padding:.5em .8em}.fact dt{font-size:.8em;color:#666}
.fact dd{margin:0;font-size:1.05em;font-weight:600}.fact .small{font-weight:400;font-size:.8em;color:#555}
.text{max-width:480px;white-space:pre-wrap;word-break:break-word;font-family:ui-monospace,monospace;font-size:.85em}
.plots{display:flex;flex-wrap:wrap;gap:.5em}.plots img{max-width:360px}
"""


def esc(x: Any) -> str:
    return html.escape("" if x is None else str(x))


# zlib level 3, not PIL's 6: half the encoding time of the page's plots for ~10% more bytes
PNG_OPTIONS = {"compress_level": 3}


def png(fig: Figure, dpi: int = 100) -> str:
    """The figure as a data URI; a figure without a layout engine gets its margins from margins.fit."""
    if fig.get_layout_engine() is None:
        margins.fit(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, pil_kwargs=dict(PNG_OPTIONS))
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def slug(text: str) -> str:
    """A value usable in an element id ("address.city" -> "address-city")."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-") or "x"


def img(name: str, alt: str, fig: Figure) -> str:
    return f'<img id="plot-{esc(slug(name))}" alt="{esc(alt)}" src="{png(fig)}">'


def kv_table(rows: Iterable[tuple[str, str]], id_: str | None = None) -> str:
    """Two columns: a label and its (already formatted) value."""
    cells = "".join(f"<tr><th>{esc(k)}</th><td class=\"n\">{esc(v)}</td></tr>" for k, v in rows)
    ident = f' id="{esc(id_)}"' if id_ else ""
    return f"<table{ident}>{cells}</table>"


def grid(head: list[str], rows: Iterable[list[str]], numeric: Iterable[int] = (), text: Iterable[int] = (),
         id_: str | None = None) -> str:
    """A table with a header row; `numeric` columns right-aligned, `text` columns in the answer style.
    Cells are escaped here."""
    numeric, text = set(numeric), set(text)

    def cls(i: int) -> str:
        return ' class="n"' if i in numeric else (' class="text"' if i in text else "")

    head_html = "".join(f"<th{cls(i) if i in numeric else ''}>{esc(h)}</th>" for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f"<td{cls(i)}>{esc(c)}</td>" for i, c in enumerate(r)) + "</tr>" for r in rows)
    ident = f' id="{esc(id_)}"' if id_ else ""
    return f"<table{ident}><tr>{head_html}</tr>{body}</table>"


def facts(items: Iterable[tuple[str, str, str, str]]) -> str:
    """Headline cards: (id, label, value, small print)."""
    cards = "".join(
        f'<div class="fact" id="fact-{esc(i)}"><dt>{esc(label)}</dt><dd>{esc(value)}'
        + (f'<br><span class="small">{esc(small)}</span>' if small else "")
        + "</dd></div>"
        for i, label, value, small in items
    )
    return f'<dl class="facts">{cards}</dl>'


def details(title: str, obj: Any) -> str:
    """A collapsed block of JSON (the resolved job, versions, ...)."""
    body = esc(json.dumps(obj, indent=1, default=str))
    return f"<details><summary>{esc(title)}</summary><pre>{body}</pre></details>"


def document(title: str, body: str) -> str:
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title><style>{CSS}</style></head>
<body>
{body}
</body></html>
"""
