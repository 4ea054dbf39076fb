"""The layout search as a page (``python -m launcher.search ... search.format=html``).

Every candidate is a point: predicted MFU against the memory headroom it leaves on the GPU
(1 - its memory per GPU / the GPU's). The layouts that fit are coloured by engine, the best
``search.top_k`` marked; those that do not fit are grey, with the reason on hover; those the
plan refuses before any memory is estimated are counted by reason in a table. The best
candidates follow as a table of their overrides.
"""

from __future__ import annotations

import collections

from launcher.html.figures import COLORS
from launcher.html.page import Page
from launcher.search.report import _layout
from launcher.search.search import SearchResult

MAX_REFUSAL_ROWS = 30
"""Reasons listed for refused layouts (the most frequent first)."""


def candidates_figure(result: SearchResult, capacity: float, top_k: int):
    """MFU against memory headroom: fitting layouts by engine, the best marked, the rest grey."""
    import plotly.graph_objects as go

    fig = go.Figure()
    over = [e for e in result.excluded if e.memory_bytes]
    if over:
        fig.add_trace(go.Scatter(
            x=[1 - e.memory_bytes / capacity for e in over], y=[e.mfu for e in over],
            mode="markers", name=f"excluded: memory ({len(over):,})",
            marker=dict(color="#b9bec9", size=5), hovertext=[
                f"{describe(e.candidate)}<br>{e.reason}" for e in over], hoverinfo="text"))
    engines = sorted({s.candidate.engine for s in result.ranked})
    for i, engine in enumerate(engines):
        mine = [s for s in result.ranked if s.candidate.engine == engine]
        fig.add_trace(go.Scatter(
            x=[1 - s.estimate.memory.total / capacity for s in mine], y=[s.mfu for s in mine],
            mode="markers", name=f"{engine} ({len(mine):,})",
            marker=dict(color=COLORS[i % len(COLORS)], size=6),
            hovertext=[f"{describe(s.candidate)}, {s.step.total:.3f} s/step" for s in mine],
            hoverinfo="text"))
    best = result.ranked[:top_k]
    fig.add_trace(go.Scatter(x=[1 - s.estimate.memory.total / capacity for s in best],
                             y=[s.mfu for s in best], mode="markers+text",
                             name=f"best {len(best)}", text=[str(i + 1) for i in range(len(best))],
                             textposition="top center",
                             marker=dict(symbol="star", size=13, color=COLORS[1])))
    fig.update_layout(title="every layout: predicted MFU against memory headroom",
                      xaxis_title="memory headroom (1 - memory per GPU / GPU memory); zoom out "
                      "for the layouts far over", xaxis_range=[-1.0, 1.0],
                      yaxis_title="predicted MFU", xaxis_tickformat=".0%", yaxis_tickformat=".0%")
    return fig


def describe(c) -> str:
    """``TP4 PP8 VPP10 CP1 EP1 mb1 ZeRO1 recompute=none megatron``: a candidate in one line."""
    split = f" ends {c.split.first}/{c.split.last}" if c.split.first or c.split.last else \
        (" emb+loss as layers" if c.split.uneven else "")
    return (f"TP{c.tp} PP{c.pp} VPP{c.vpp} CP{c.cp} EP{c.ep}{split} mb{c.micro_batch} "
            f"ZeRO{c.zero_stage} recompute={c.recompute.value} {c.engine}")


def search_page(result: SearchResult, *, title: str, capacity: float, top_k: int) -> Page:
    """The search's page (``capacity``: bytes of one GPU's memory)."""
    page = Page(title)
    refused = [e for e in result.excluded if not e.memory_bytes]
    page.paragraph(f"{result.searched:,} layouts searched: {result.valid:,} fit "
                   f"({len(result.excluded) - len(refused):,} need more memory than "
                   f"{result.budget_bytes / 2**30:.1f} GiB, {len(refused):,} refused by the "
                   f"plan); global batch {result.global_batch:,} sequences.")
    page.figure(candidates_figure(result, capacity, top_k), height=560)
    page.heading(f"The best {min(top_k, len(result.ranked))}")
    page.table(("#", "layout", "engine", "step time (s)", "MFU", "memory (GiB)", "overrides"),
               [(i + 1, _layout(s), s.candidate.engine, round(s.step.total, 4),
                 f"{s.mfu:.1%}", round(s.estimate.memory.total / 2**30, 2),
                 " ".join(s.candidate.overrides())) for i, s in
                enumerate(result.ranked[:top_k])])
    if refused:
        page.heading("Refused by the plan")
        counts = collections.Counter(e.reason for e in refused)
        page.table(("layouts", "reason"), [(n, reason) for reason, n in
                                           counts.most_common(MAX_REFUSAL_ROWS)])
    return page
