"""Self-contained HTML pages with plots: what every report of trainwright is made of.

:mod:`.page` assembles one file (every script, style and data point inline: it opens offline,
after a copy, with no network request); :mod:`.figures` builds the charts with Plotly (a
well-kept plotting library, not hand-written SVG or JS); :mod:`.downsample` keeps long series
light while keeping every extreme. Torch-free; used by the plan's report
(:mod:`launcher.plan.html_report`) and the run and sweep reports (:mod:`launcher.reports`).
"""
