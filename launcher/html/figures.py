"""Plotly figures shared by the reports: series thinned by :mod:`.downsample`.

Every series of a chart is a list of the run's own values (no smoothing, no rounding); a long
one keeps the points :func:`launcher.html.downsample.keep_extremes` picks.
"""

from __future__ import annotations

from typing import Optional, Sequence

from launcher.html.downsample import DEFAULT_MAX_POINTS, keep_extremes

COLORS = ("#2451a6", "#d1495b", "#edae49", "#00798c", "#66a182", "#8d96a3", "#6a4c93",
          "#e07a5f", "#3d405b", "#81b29a")
"""Trace colours in order (colour-blind-safe enough to tell seven phases apart)."""


def line(x: Sequence, y: Sequence, name: str, *, max_points: int = DEFAULT_MAX_POINTS,
         mode: str = "lines", color: Optional[str] = None, **kwargs):
    """A Scatter trace of (x, y), thinned to ``max_points`` keeping every extreme of y."""
    import plotly.graph_objects as go

    idx = keep_extremes(y, max_points)
    return go.Scatter(x=[x[i] for i in idx], y=[y[i] for i in idx], name=name, mode=mode,
                      line=dict(color=color) if color else None, **kwargs)


def column(rows: Sequence[dict], key: str) -> list:
    """``row[key]`` of every row (None where missing)."""
    return [row.get(key) for row in rows]


def has(rows: Sequence[dict], key: str) -> bool:
    """Whether any row has a value for ``key``."""
    return any(row.get(key) is not None for row in rows)


def subplots(rows: int, titles: Sequence[str], shared_x: bool = True):
    """A figure of ``rows`` charts stacked vertically."""
    from plotly.subplots import make_subplots

    return make_subplots(rows=rows, cols=1, shared_xaxes=shared_x, subplot_titles=list(titles),
                         vertical_spacing=0.08)
