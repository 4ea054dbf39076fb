"""One self-contained HTML file: :class:`Page` and :func:`write_page`.

Plotly's JavaScript is written once into the page's head (about 4.8 MB, no CDN), every chart's
data inline after it, the style inline; no font, image or script is fetched, so the file opens
offline after a copy (the browser tests check that no request leaves ``file:``/``data:``).
Text from a run (names, messages, config values) is escaped; only markup built here is raw.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from launcher.core.atomic import atomic_write_text

PLOT_CONFIG = {"displaylogo": False, "responsive": True, "scrollZoom": False}
"""Plotly's per-chart options: no logo link, charts follow the page width."""

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto;
       max-width: 1200px; padding: 16px 24px; color: #1d2330; }
h1 { font-size: 22px; margin: 8px 0 4px; } h2 { font-size: 17px; margin: 28px 0 6px;
     border-bottom: 1px solid #d6dae3; padding-bottom: 3px; }
table { border-collapse: collapse; margin: 6px 0; } td, th { padding: 3px 10px;
        border-bottom: 1px solid #eceef3; text-align: left; vertical-align: top; }
th { background: #f3f5f9; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.outcome-finished { color: #1a7f37; } .outcome-failed { color: #c62828; }
.outcome-stopped { color: #9a6700; } .note { color: #5b6273; }
details { margin: 6px 0; } summary { cursor: pointer; color: #2451a6; }
pre { background: #f6f8fa; padding: 8px; overflow-x: auto; font-size: 12px; }
tr.best td { background: #e9f6ec; }
"""


def esc(value: Any) -> str:
    """Text for HTML (None as an en dash)."""
    return "\u2013" if value is None else html.escape(str(value))


@dataclass
class Page:
    """A report page: blocks of markup in order, charts among them."""

    title: str
    blocks: list = field(default_factory=list)
    charts: int = 0
    """Charts added (the browser tests count the rendered ones against it)."""

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(f"<h{level}>{esc(text)}</h{level}>")

    def paragraph(self, text: str, css: str = "") -> None:
        cls = f' class="{css}"' if css else ""
        self.blocks.append(f"<p{cls}>{esc(text)}</p>")

    def raw(self, markup: str) -> None:
        """Markup built by the caller from escaped parts."""
        self.blocks.append(markup)

    def table(self, header: Sequence[str], rows: Iterable[Sequence[Any]],
              row_classes: Optional[Sequence[str]] = None) -> None:
        """A table; numbers right-aligned."""
        head = "".join(f"<th>{esc(h)}</th>" for h in header)
        body = []
        for i, row in enumerate(rows):
            cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
            cells = "".join(f'<td class="num">{esc(v)}</td>' if isinstance(v, (int, float))
                            and not isinstance(v, bool) else f"<td>{esc(v)}</td>" for v in row)
            body.append(f"<tr{cls}>{cells}</tr>")
        self.blocks.append(f"<table><tr>{head}</tr>{''.join(body)}</table>")

    def details(self, summary: str, text: str) -> None:
        """A collapsed block of preformatted text."""
        self.blocks.append(f"<details><summary>{esc(summary)}</summary><pre>{esc(text)}</pre>"
                           "</details>")

    def figure(self, fig, height: int = 360) -> None:
        """A Plotly figure, its data inline (the library is in the page's head)."""
        fig.update_layout(height=height, margin=dict(l=60, r=30, t=40, b=40),
                          template="plotly_white")
        self.charts += 1
        self.blocks.append(fig.to_html(full_html=False, include_plotlyjs=False,
                                       include_mathjax=False, config=PLOT_CONFIG,
                                       div_id=f"chart{self.charts}"))

    def render(self) -> str:
        """The whole document."""
        from plotly.offline import get_plotlyjs

        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{esc(self.title)}</title><style>{STYLE}</style>"
                f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head><body>"
                f"<h1>{esc(self.title)}</h1>\n" + "\n".join(self.blocks)
                + f"\n<script type=\"application/json\" id=\"report-meta\">"
                f"{json.dumps({'charts': self.charts})}</script></body></html>\n")


def write_page(page: Page, path: Path) -> Path:
    """Write ``page`` to ``path`` atomically (temp file, fsync, rename); the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, page.render())
    return path
