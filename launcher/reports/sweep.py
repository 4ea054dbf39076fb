"""A sweep read back and shown: :func:`summarize` (one row per point), :func:`format_table`
and :func:`sweep_page` (the HTML report).

Every run directory under the sweep directory (a folder holding ``metrics.jsonl``) is a point,
named by its folder: the swept overrides (``optimizer.lr=0.0001,trainer.x=2``). A row: last
step, final training loss, final and best validation loss and the step of the best, median
tokens/s, peak memory, goodput and outcome; rows sorted by best validation loss (points without
one after, by final training loss). The page adds every point's loss curve overlaid and the
final and best validation loss against each swept parameter (a log axis for values spanning
more than two decades, as learning rates do); the best point is marked.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Optional
from urllib.parse import quote

from launcher.html.figures import COLORS, column, line
from launcher.html.page import Page, esc, write_page
from launcher.reports.data import RunData, load_run, outcome

COLUMNS = ("point", "steps", "train_loss", "final_val_loss", "best_val_loss", "best_val_step",
           "tokens_per_s", "peak_memory_gb", "goodput", "outcome")
"""The table's columns (the first six are launcher.sweep_summary's of old)."""

_SETTING = re.compile(r"(?:^|,)([\w.+~/-]+)=((?:[^,\[]|\[[^\]]*\])*)")


def points(sweep_dir: Path) -> list[Path]:
    """The run directories of a sweep (folders holding metrics.jsonl), by name."""
    return sorted(p.parent for p in Path(sweep_dir).glob("*/metrics.jsonl"))


def settings(point: str) -> dict:
    """``{"optimizer.lr": "0.0001"}`` from a point's folder name (Hydra's override_dirname)."""
    return {m.group(1): m.group(2) for m in _SETTING.finditer(point)}


def _number(text: str) -> Optional[float]:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def row_of(run: RunData) -> dict:
    """The summary row of one point."""
    row = {"point": run.name, "steps": run.last_step,
           "train_loss": run.steps[-1]["loss"] if run.steps else None,
           "final_val_loss": run.evals[-1]["eval/loss"] if run.evals else None,
           "best_val_loss": None, "best_val_step": None}
    for rec in run.evals:
        if rec["eval/loss"] is not None and (row["best_val_loss"] is None
                                             or rec["eval/loss"] < row["best_val_loss"]):
            row["best_val_loss"], row["best_val_step"] = rec["eval/loss"], rec["step"]
    speeds = [s for s in column(run.steps, "tokens_per_s") if s is not None]
    memory = [m for m in column(run.steps, "memory_gb") if m is not None]
    row.update(tokens_per_s=statistics.median(speeds) if speeds else None,
               peak_memory_gb=max(memory) if memory else None,
               goodput=run.goodput.get("goodput"), outcome=outcome(run).kind)
    return row


def _rank_key(row: dict) -> tuple:
    best, train = row["best_val_loss"], row["train_loss"]
    return (best is None, best if best is not None else (train if train is not None
                                                          else math.inf), row["point"])


def summarize(sweep_dir: Path) -> list[dict]:
    """Rows of every point under ``sweep_dir``, best first."""
    return sorted((row_of(load_run(p)) for p in points(sweep_dir)), key=_rank_key)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def format_table(rows: list[dict], cols=COLUMNS) -> str:
    """A plain-text table of the rows."""
    table = [list(cols)] + [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(line_[i]) for line_ in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                               for i, (v, w) in enumerate(zip(line_, widths)))
                     for line_ in table)


def curves_figure(runs: list[RunData], best: str):
    """Every point's training loss against step, overlaid; the best point drawn thicker."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for i, run in enumerate(runs):
        trace = line(column(run.steps, "step"), column(run.steps, "loss"), run.name,
                     max_points=1000, color=COLORS[i % len(COLORS)])
        trace.line.width = 3.5 if run.name == best else 1.2
        fig.add_trace(trace)
        if run.evals:
            fig.add_trace(line(column(run.evals, "step"), column(run.evals, "eval/loss"),
                               f"{run.name} (validation)", mode="markers",
                               color=COLORS[i % len(COLORS)], max_points=1000))
    fig.update_layout(title="loss of every point", xaxis_title="step", yaxis_title="nats/token")
    return fig


def parameter_figures(rows: list[dict], best: str) -> list:
    """Final and best validation loss (else the final training loss) against each swept
    parameter with numeric values; the best point as a star."""
    import plotly.graph_objects as go

    by_key: dict = {}
    for row in rows:
        for key, text in settings(row["point"]).items():
            if _number(text) is not None:
                by_key.setdefault(key, []).append((_number(text), row))
    figures = []
    for key, pairs in sorted(by_key.items()):
        pairs.sort(key=lambda p: p[0])
        xs = [x for x, _ in pairs]
        fig = go.Figure()
        measures = (("final_val_loss", "final validation loss"),
                    ("best_val_loss", "best validation loss")) \
            if any(r["best_val_loss"] is not None for _, r in pairs) \
            else (("train_loss", "final training loss"),)
        for i, (col, label) in enumerate(measures):
            fig.add_trace(go.Scatter(x=xs, y=[r[col] for _, r in pairs], name=label,
                                     mode="lines+markers", marker_color=COLORS[i],
                                     hovertext=[r["point"] for _, r in pairs]))
        mark = [(x, r) for x, r in pairs if r["point"] == best]
        if mark:
            fig.add_trace(go.Scatter(x=[mark[0][0]], y=[mark[0][1][measures[-1][0]]],
                                     mode="markers", name=f"best: {best}",
                                     marker=dict(symbol="star", size=16, color=COLORS[2])))
        log = all(x > 0 for x in xs) and max(xs) / min(xs) > 100
        fig.update_layout(title=f"loss against {key}", xaxis_title=key,
                          xaxis_type="log" if log else "linear", yaxis_title="nats/token")
        figures.append(fig)
    return figures


def sweep_page(sweep_dir: Path) -> Page:
    """The whole report of the sweep in ``sweep_dir``."""
    runs = {p.name: load_run(p) for p in points(sweep_dir)}
    rows = sorted((row_of(r) for r in runs.values()), key=_rank_key)
    best = rows[0]["point"] if rows else ""
    page = Page(f"trainwright sweep {Path(sweep_dir).name}")
    page.paragraph(f"{len(rows)} point(s) in {sweep_dir}; best: {best or '-'} (lowest best "
                   "validation loss, else final training loss)")
    page.raw(_table_html(rows, best, Path(sweep_dir)))
    if rows:
        page.heading("Loss curves")
        page.figure(curves_figure([runs[r["point"]] for r in rows], best), height=420)
        figures = parameter_figures(rows, best)
        if figures:
            page.heading("Loss against the swept parameters")
        for fig in figures:
            page.figure(fig, height=340)
    return page


def _table_html(rows: list[dict], best: str, sweep_dir: Path) -> str:
    head = "".join(f"<th>{esc(c)}</th>" for c in COLUMNS)
    body = []
    for row in rows:
        cells = []
        for col in COLUMNS:
            text = esc(_cell(row.get(col)) if col != "goodput" or row.get(col) is None
                       else f"{row[col]:.1%}")
            if col == "point" and (sweep_dir / row["point"] / "report.html").is_file():
                text = f'<a href="{esc(quote(row["point"]))}/report.html">{text}</a>'
            num = ' class="num"' if isinstance(row.get(col), (int, float)) else ""
            cells.append(f"<td{num}>{text}</td>")
        cls = ' class="best"' if row["point"] == best else ""
        body.append(f"<tr{cls}>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def write_sweep_report(sweep_dir: Path, output: Optional[Path] = None) -> Path:
    """Render the sweep report into ``output`` (default ``<sweep_dir>/report.html``)."""
    return write_page(sweep_page(Path(sweep_dir)),
                      Path(output) if output else Path(sweep_dir) / "report.html")
