"""The page every report is: one self-contained HTML file — Plotly's JavaScript inlined, styles inlined, no font,
image, script, stylesheet or frame from anywhere else — that opens offline, attaches to a ticket and prints.

Why Plotly: its Python package carries the whole plotly.js bundle (`plotly.offline.get_plotlyjs()`), so inlining it
needs nothing at run time but the package itself, and the charts keep hover values, zoom and legend toggles, which a
reader comparing dozens of offers uses. Vega-Lite through Altair would need vl-convert or three runtimes (vega,
vega-lite, vega-embed) fetched or vendored. The price is the page's size: about 5 MB, mostly plotly.js.

Colours are the Okabe–Ito palette (distinguishable with the common colour-vision deficiencies); every chart also
varies marker shape or line dash where colour carries meaning. Each chart sits in `<figure data-chart="NAME">` so
that tools and tests find it by name; tables sort by clicking a column head.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tunecast.version import __version__

# Okabe & Ito (2008), "Color Universal Design": black, orange, sky blue, bluish green, yellow, blue, vermillion,
# reddish purple.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#56B4E9", "#CC79A7", "#F0E442", "#000000")

STYLE = """
:root { color-scheme: light; --ink: #1b1b1b; --muted: #555; --rule: #d0d0d0; --accent: #0072B2; }
* { box-sizing: border-box; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: var(--ink); margin: 0 auto; padding: 1.5rem 2rem 3rem; max-width: 1200px; }
h1 { font-size: 1.6rem; margin: 0 0 .2rem; }
h2 { font-size: 1.2rem; margin: 2rem 0 .5rem; border-bottom: 1px solid var(--rule); padding-bottom: .2rem; }
p, li { max-width: 75ch; }
.muted { color: var(--muted); }
figure { margin: .5rem 0 1.5rem; break-inside: avoid; }
figure .plot { width: 100%; min-height: 380px; }
figcaption { color: var(--muted); font-size: .9rem; margin-top: .25rem; }
table { border-collapse: collapse; font-size: .88rem; width: 100%; }
th, td { padding: .3rem .5rem; border-bottom: 1px solid var(--rule); text-align: left; white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
th { position: sticky; top: 0; background: #f4f4f4; cursor: pointer; user-select: none; }
th[aria-sort="ascending"]::after { content: " ▲"; }
th[aria-sort="descending"]::after { content: " ▼"; }
.scroll { max-height: 32rem; overflow: auto; border: 1px solid var(--rule); }
tr.best td { font-weight: 600; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: .2rem 1rem; }
dl.facts dt { color: var(--muted); }
dl.facts dd { margin: 0; }
footer { margin-top: 3rem; color: var(--muted); font-size: .85rem; }
@media print {
  body { max-width: none; padding: 0; font-size: 11pt; }
  .scroll { max-height: none; overflow: visible; border: 0; }
  th { position: static; }
  figure .plot { min-height: 0; }
}
"""

# The sorting of tables (report/sortable.js, shared with the web planner's page), run on every table with class
# "sortable".
SORTABLE_JS = Path(__file__).with_name("sortable.js")


def escape(text: object) -> str:
    return html.escape(str(text), quote=True)


def page(title: str, subtitle: str, sections: Iterable[str]) -> str:
    """The whole report: `sections` are HTML fragments (from `section`)."""
    from plotly.offline import get_plotlyjs

    made = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        # nothing may be fetched: scripts and styles are inline, images data: URLs
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; script-src 'unsafe-inline' "
        "'unsafe-eval'; style-src 'unsafe-inline'; img-src data:; font-src data:\">",
        f"<title>{escape(title)}</title>",
        f"<style>{STYLE}</style>",
        f"<script>{get_plotlyjs()}</script>",
        "</head><body>",
        f"<header><h1>{escape(title)}</h1><p class=\"muted\">{escape(subtitle)}</p></header>",
        *sections,
        f"<footer>Written by tunecast {escape(__version__)} on {made}. This file is self-contained: it loads nothing "
        "from the network.</footer>",
        f"<script>{SORTABLE_JS.read_text(encoding='utf-8')}"
        'document.querySelectorAll("table.sortable").forEach(sortableTable);</script>',
        "</body></html>",
    ])


def section(heading: str, *parts: str) -> str:
    return f"<section><h2>{escape(heading)}</h2>" + "".join(parts) + "</section>"


def paragraph(text: str, muted: bool = False) -> str:
    style = ' class="muted"' if muted else ""
    return f"<p{style}>{escape(text)}</p>"


def chart(name: str, figure: Any, caption: str) -> str:
    """A Plotly figure in `<figure data-chart=NAME>`, drawn as SVG (so that it prints sharp)."""
    figure.update_layout(template="plotly_white", colorway=list(PALETTE), font={"size": 13},
                         margin={"l": 60, "r": 20, "t": 40, "b": 50})
    spec = figure.to_plotly_json()
    plot_id = f"chart-{name}"
    config = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": ["sendDataToCloud"]}
    # inside <script> (a JavaScript literal: NaN, a loss that diverged, is one), "</" would end the element early
    # (a model named "</script>"), so it is escaped
    payload = json.dumps({"data": spec["data"], "layout": spec["layout"], "config": config},
                         default=_plain, ensure_ascii=False).replace("</", "<\\/")
    return (f'<figure data-chart="{escape(name)}"><div class="plot" id="{plot_id}"></div>'
            f"<figcaption>{escape(caption)}</figcaption>"
            f'<script>(function () {{ var c = {payload}; Plotly.newPlot("{plot_id}", c.data, c.layout, c.config); '
            "})();</script></figure>")


def log_ticks(values: Sequence[float], text: Callable[[float], str]) -> dict[str, list[Any]]:
    """`tickvals` and `ticktext` of a log axis over `values` (all > 0) that say their value whole ("0.3 h", where
    Plotly's own ticks between decades are a bare "3"): 1, 2, 3 and 5 of each decade when the values span less than
    one, 1, 2 and 5 up to four, only the powers of ten past that (the page's charts do the same, app.js logTicks)."""
    low, high = min(values), max(values)
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    span = math.log10(high / low)
    steps = (1,) if span > 4 else (1, 2, 5) if span > 1 else (1, 2, 3, 5)
    ticks: dict[str, list[Any]] = {"tickvals": [], "ticktext": []}
    for power in range(first, last + 1):
        for step in steps:
            value = float(f"{step * 10.0**power:.1g}")
            if low / 1.5 <= value <= high * 1.5:
                ticks["tickvals"].append(value)
                ticks["ticktext"].append(text(value))
    return ticks


def hours_tick(value: float) -> str:
    return f"{value:g} h" if value < 1 else f"{value:,.0f} h"


def usd_tick(value: float) -> str:
    return f"${value:g}" if value < 1 else f"${value:,.0f}"


def _plain(value: Any) -> Any:
    """What plotly's figure JSON holds beyond plain JSON (numpy arrays and numbers)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


def table(columns: Sequence[tuple[str, bool]], rows: Iterable[Sequence[Any]], *, sortable: bool = True,
          highlight: Iterable[int] = (), name: str | None = None) -> str:
    """A table: `columns` are (heading, numeric); a cell is text or (text, sort value); `highlight` marks rows."""
    marked = set(highlight)
    number = ' class="num"'
    head = "".join(f'<th scope="col"{number if numeric else ""}>{escape(title)}</th>' for title, numeric in columns)
    body = []
    for index, row in enumerate(rows):
        cells = []
        for (_, numeric), cell in zip(columns, row, strict=True):
            text, value = cell if isinstance(cell, tuple) else (cell, None)
            attributes = (' class="num"' if numeric else "") + (f' data-value="{escape(value)}"' if value is not None
                                                                  else "")
            cells.append(f"<td{attributes}>{text if isinstance(text, Markup) else escape(text)}</td>")
        best = ' class="best"' if index in marked else ""
        body.append(f"<tr{best}>" + "".join(cells) + "</tr>")
    label = f' data-table="{escape(name)}"' if name else ""
    return (f'<div class="scroll"><table class="{"sortable" if sortable else ""}"{label}><thead><tr>{head}</tr>'
            f"</thead><tbody>{''.join(body)}</tbody></table></div>")


class Markup(str):
    """Text already HTML (a link), put in a cell as it is."""


def link(text: str, url: str) -> Markup:
    """A link the reader may click (never loaded by the page itself)."""
    if not url.startswith(("https://", "http://")):
        return Markup(escape(text))
    return Markup(f'<a href="{escape(url)}" rel="noreferrer noopener">{escape(text)}</a>')


def facts(pairs: Iterable[tuple[str, Any]]) -> str:
    return '<dl class="facts">' + "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in pairs) + "</dl>"
