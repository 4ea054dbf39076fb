"""The HTML report of one run: :func:`run_page` and :func:`write_run_report`.

One self-contained page (:mod:`launcher.html.page`): a header (name, outcome, steps, tokens,
wall time, goodput, the command that reproduces it, commit; config and plan collapsed), then
charts of the loss (training and evaluation, steps below and tokens above), the optimizer (lr,
gradient norm, loss scale), throughput (tokens/s, MFU, step time against the plan's), where each
step's time goes (the seven phases stacked), memory against the plan, goodput (the wall time by
cause; each attempt on a timeline) and the run's events on its time axis. Long series keep
every extreme (:mod:`launcher.html.downsample`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from launcher.core.phases import PHASES
from launcher.html.figures import COLORS, column, has, line, subplots
from launcher.html.page import Page, esc, write_page
from launcher.reports.data import RunData, load_run, outcome

REPORT_NAME = "report.html"
"""The run report's file name in the run directory."""

EVENT_KINDS = ("checkpoint", "restart", "hang", "attempt_start", "attempt_end", "loss_spike",
               "straggler", "nan_skip", "stop", "abort", "resume", "layout_change", "run_end")
"""Events drawn on the time axis (one row each)."""

PLAN_SUMMARY_KEYS = ("engine", "world_size", "nodes", "gpus_per_node", "gpu",
                     "tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
                     "expert_parallel_size", "data_parallel_size", "zero_stage",
                     "micro_batch_size", "grad_accum_steps", "global_batch_size", "seq_length",
                     "train_steps", "params_total", "step_time_s", "mfu", "tokens_per_s")


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s" if h else f"{rest // 60}m{rest % 60:02d}s"


def header(page: Page, run: RunData) -> None:
    """The run's facts, its outcome, how to reproduce it, config and plan collapsed."""
    end = outcome(run)
    gp = run.goodput
    attempts = gp.get("attempts", [])
    launches = sum(1 for a in attempts if a["attempt"] == 0) or 1
    page.raw(f'<p class="outcome-{end.kind}"><b>{end.kind}</b>: '
             f'{esc(end.text)}</p>')
    train_steps = run.plan.get("train_steps")
    rows = [("steps", f"{run.last_step:,}" + (f" of {train_steps:,}" if train_steps else "")),
            ("tokens", f"{run.last_step * run.tokens_per_step:,}"),
            ("wall time", _hms(gp.get("wall_s", 0.0))),
            ("goodput", f"{gp.get('goodput', 0.0):.1%}"),
            ("attempts", f"{len(attempts)}: {launches} launch(es), "
                         f"{len(attempts) - launches} in-job restart(s)"),
            ("command", run.command() or "\u2013"),
            ("commit", run.env.get("git_sha") or "\u2013"),
            ("started", run.env.get("started_at") or "\u2013"),
            ("run directory", str(run.run_dir))]
    page.table(("", ""), rows)
    plan_against_run(page, run)
    if run.config_text:
        page.details("config (resolved, secrets redacted)", run.config_text)
    if run.plan:
        summary = {k: run.plan[k] for k in PLAN_SUMMARY_KEYS if k in run.plan}
        page.details("plan summary", json.dumps(summary, indent=1))


def plan_against_run(page: Page, run: RunData) -> None:
    """The plan's step time, tokens/s, memory and goodput against the run's
    (:mod:`launcher.reports.plan_check`)."""
    from launcher.reports.plan_check import OFF_BY, plan_check

    comparisons = plan_check(run.run_dir)
    if not comparisons:
        return
    rows = [(c.name, f"{c.planned:,.4g}", f"{c.measured:,.4g}",
             f"{c.off:+.1%}" + ("" if c.judged else " (CPU resident set: not comparable)")
             + (" off" if c.judged and abs(c.off) > OFF_BY else ""))
            for c in comparisons]
    page.table(("plan against run", "planned", "measured", "difference"), rows)


def loss_figure(run: RunData):
    """Training and evaluation loss against step; tokens on the top axis."""
    import plotly.graph_objects as go

    steps = column(run.steps, "step")
    fig = go.Figure([line(steps, column(run.steps, "loss"), "train loss", color=COLORS[0])])
    if run.evals:
        fig.add_trace(line(column(run.evals, "step"), column(run.evals, "eval/loss"),
                           "validation loss", mode="lines+markers", color=COLORS[1]))
    if run.discarded:
        fig.add_trace(line(column(run.discarded, "step"), column(run.discarded, "loss"),
                           "thrown away by a restart", mode="markers", color=COLORS[5]))
    if steps and run.tokens_per_step:
        lo, hi = min(steps), max(steps)
        fig.add_trace(go.Scatter(x=[lo * run.tokens_per_step, hi * run.tokens_per_step],
                                 y=[run.steps[0]["loss"], run.steps[-1]["loss"]], xaxis="x2",
                                 mode="markers", marker=dict(opacity=0), hoverinfo="skip",
                                 showlegend=False, name="tokens"))
        fig.update_layout(xaxis=dict(range=[lo, hi], title="step"),
                          xaxis2=dict(overlaying="x", side="top", title="tokens",
                                      range=[lo * run.tokens_per_step, hi * run.tokens_per_step]))
    fig.update_layout(title="loss", yaxis_title="nats/token")
    return fig


def task_metrics(rows: list) -> dict:
    """{task: [metric, ...]} of the ``eval/<task>/<metric>`` keys (examples left out)."""
    found: dict = {}
    for row in rows:
        for key in row:
            bits = key.split("/")
            if len(bits) == 3 and bits[0] == "eval" and not bits[2].startswith("examples") \
                    and not bits[2].endswith("_clean") \
                    and bits[2] not in found.setdefault(bits[1], []):
                found[bits[1]].append(bits[2])
    return found


def task_figures(run: RunData) -> list:
    """One chart per downstream task: each of its metrics against the tokens trained, beside
    its score on the examples not found in the run's shards (eval.contamination)."""
    figures = []
    tokens = column(run.tasks, "eval/tokens")
    for task, metrics in task_metrics(run.tasks).items():
        fig = subplots(len(metrics), metrics)
        for i, metric in enumerate(metrics):
            key = f"eval/{task}/{metric}"
            rows = [r for r in run.tasks if key in r]
            fig.add_trace(line(column(rows, "eval/tokens"), column(rows, key), metric,
                               mode="lines+markers", color=COLORS[i]), row=i + 1, col=1)
            clean = [r for r in run.tasks if f"{key}_clean" in r]
            if clean:  # eval.contamination: the score on the examples not in the shards
                fig.add_trace(line(column(clean, "eval/tokens"), column(clean, f"{key}_clean"),
                                   f"{metric} (clean)", mode="lines+markers",
                                   color=COLORS[5]), row=i + 1, col=1)
        fig.update_layout(title=f"{task} (against tokens trained; last step "
                                f"{run.tasks[-1]['step']})" if tokens else task,
                          showlegend=False)
        fig.update_xaxes(title_text="tokens", row=len(metrics), col=1)
        figures.append((fig, len(metrics)))
    return figures


def series_figure(run: RunData, keys: tuple, title: str):
    """One chart per key of ``keys`` the step lines have, stacked, against step."""
    keys = [k for k in keys if has(run.steps, k)]
    fig = subplots(len(keys), keys)
    steps = column(run.steps, "step")
    for i, key in enumerate(keys):
        fig.add_trace(line(steps, column(run.steps, key), key, color=COLORS[i]), row=i + 1, col=1)
    fig.update_layout(title=title, showlegend=False)
    return fig, keys


def optimizer_figure(run: RunData):
    """Learning rate, gradient norm and loss scale against step."""
    return series_figure(run, ("lr", "grad_norm", "loss_scale"), "optimizer")[0]


def throughput_figure(run: RunData):
    """Tokens/s, MFU and step time against step; the plan's predicted step time as a line."""
    fig, keys = series_figure(run, ("tokens_per_s", "mfu", "step_time"), "throughput")
    steps = column(run.steps, "step")
    predicted = run.plan.get("step_time_s")
    if predicted and "step_time" in keys and steps:
        fig.add_trace(line([min(steps), max(steps)], [predicted, predicted], "plan: step time",
                           color=COLORS[5]), row=keys.index("step_time") + 1, col=1)
        fig.update_traces(line_dash="dash", selector=dict(name="plan: step time"))
        fig.update_layout(showlegend=True)
    return fig


def phase_keys(rows: list) -> list:
    """The ``time/<phase>`` keys of the step lines in phase order (fused ones where the
    engine reports them so, e.g. ``time/backward+grad_sync``), plus ``time/eval``; a phase
    that is zero in every step (``time/grad_sync`` next to a fused key) is left out."""
    present = {k for row in rows for k in row if k.startswith("time/") and row[k]}
    ordered = [k for k in present if k != "time/eval"]
    ordered.sort(key=lambda k: min((PHASES.index(p) for p in k[5:].split("+") if p in PHASES),
                                   default=len(PHASES)))
    return ordered + (["time/eval"] if "time/eval" in present else [])


def phases_figure(run: RunData):
    """Seconds of each phase per step, stacked (where each step's time goes); the points are
    those that keep every extreme of the step time."""
    import plotly.graph_objects as go

    from launcher.html.downsample import keep_extremes

    idx = keep_extremes(column(run.steps, "step_time"))
    rows = [run.steps[i] for i in idx]
    steps = column(rows, "step")
    fig = go.Figure()
    for i, key in enumerate(phase_keys(run.steps)):
        fig.add_trace(go.Scatter(x=steps, y=[r.get(key) or 0.0 for r in rows], name=key[5:],
                                 stackgroup="phases", mode="lines",
                                 line=dict(width=0.5, color=COLORS[i % len(COLORS)])))
    fig.update_layout(title="where each step's time goes (phases, stacked)", xaxis_title="step",
                      yaxis_title="seconds per step")
    return fig


def memory_figure(run: RunData) -> Optional[object]:
    """Measured memory per step against the plan's memory per GPU."""
    if not has(run.steps, "memory_gb"):
        return None
    steps = column(run.steps, "step")
    fig = subplots(1, ["memory"])
    fig.add_trace(line(steps, column(run.steps, "memory_gb"), "measured (rank 0)",
                       color=COLORS[0]), row=1, col=1)
    planned = (run.plan.get("memory_per_gpu") or {}).get("total")
    if planned and steps:
        fig.add_trace(line([min(steps), max(steps)], [planned / 1e9] * 2, "plan: per GPU",
                           color=COLORS[5]), row=1, col=1)
        fig.update_traces(line_dash="dash", selector=dict(name="plan: per GPU"))
    fig.update_layout(title="memory (GB)", xaxis_title="step", yaxis_title="GB")
    return fig


def goodput_figures(run: RunData) -> list:
    """The wall time split by cause (one stacked bar) and every attempt on a timeline."""
    import plotly.graph_objects as go

    gp = run.goodput
    parts = [("productive", gp.get("productive_s", 0.0))] + \
        [(cause, s) for cause, s in gp.get("lost_s", {}).items() if s >= 0.005]
    split = go.Figure([go.Bar(y=["wall time"], x=[s], name=cause, orientation="h",
                              marker_color=COLORS[i % len(COLORS)],
                              hovertemplate=f"{cause}: %{{x:.1f}} s<extra></extra>")
                       for i, (cause, s) in enumerate(parts)])
    split.update_layout(barmode="stack", title=f"goodput {gp.get('goodput', 0.0):.1%}: wall "
                        "time by cause (s)", xaxis_title="seconds")
    attempts = gp.get("attempts", [])
    t0 = min((a["start"] for a in attempts), default=0.0)
    timeline = go.Figure([go.Bar(y=[label], x=[a["seconds"]],
                                 base=[a["start"] - t0], orientation="h", name=a["cause"],
                                 marker_color=COLORS[0] if a["cause"] in ("finished", "running")
                                 else COLORS[1], hovertext=a["cause"])
                          for a, label in zip(attempts, attempt_labels(attempts))])
    timeline.update_layout(title="attempts: each launch (first start, resumes, requeues) and "
                           "its in-job restarts", yaxis=dict(autorange="reversed"),
                           xaxis_title="seconds since the first start", showlegend=False)
    return [split, timeline]


def attempt_labels(attempts: list) -> list:
    """``launch 1``, ``launch 1, restart 1``, ``launch 2`` ...: each attempt by the launch
    (first start, resume, requeue) it belongs to and its in-job restart number."""
    labels, launch = [], 0
    for a in attempts:
        launch += a["attempt"] == 0 or not labels
        labels.append(f"launch {launch}" + (f", restart {a['attempt']}" if a["attempt"] else ""))
    return labels


def events_figure(run: RunData):
    """The run's events on its time axis, one row per kind, the message on hover."""
    import plotly.graph_objects as go

    events = [e for e in run.events if e.get("kind") in EVENT_KINDS and "time" in e]
    t0 = min((a["start"] for a in run.goodput.get("attempts", [])),
             default=min((e["time"] for e in events), default=0.0))
    fig = go.Figure()
    for i, kind in enumerate(k for k in EVENT_KINDS if any(e["kind"] == k for e in events)):
        mine = [e for e in events if e["kind"] == kind]
        fig.add_trace(go.Scatter(x=[e["time"] - t0 for e in mine], y=[kind] * len(mine),
                                 mode="markers", name=kind, hovertext=[_event_text(e)
                                                                       for e in mine],
                                 hoverinfo="text+x", marker=dict(size=9,
                                                                 color=COLORS[i % len(COLORS)])))
    fig.update_layout(title="events", xaxis_title="seconds since the first start",
                      showlegend=False)
    return fig


def _event_text(event: dict) -> str:
    text = event.get("message", "")
    if event.get("kind") == "checkpoint" and event.get("seconds"):
        gb = event.get("bytes", 0) / 1e9
        text += f" ({gb:.2f} GB, {event['seconds']:.1f} s, {gb / event['seconds']:.2f} GB/s)"
    return text[:300]


def run_page(run: RunData) -> Page:
    """The whole report of ``run``."""
    page = Page(f"trainwright run {run.name}")
    header(page, run)
    if run.steps:
        page.heading("Loss")
        page.figure(loss_figure(run), height=380)
        page.heading("Optimizer")
        page.figure(optimizer_figure(run), height=520)
        page.heading("Throughput")
        page.figure(throughput_figure(run), height=560)
        page.heading("Where the time of a step goes")
        page.figure(phases_figure(run), height=380)
        memory = memory_figure(run)
        if memory is not None:
            page.heading("Memory")
            page.figure(memory, height=320)
    else:
        page.paragraph("No training step was recorded.", "note")
    if run.tasks:
        page.heading("Downstream tasks")
        for fig, rows in task_figures(run):
            page.figure(fig, height=160 + 180 * rows)
    page.heading("Goodput")
    for fig in goodput_figures(run):
        page.figure(fig, height=260)
    page.heading("Events")
    page.figure(events_figure(run), height=360)
    return page


def write_run_report(run_dir: Path, output: Optional[Path] = None) -> Path:
    """Render ``run_dir``'s report into ``output`` (default ``<run_dir>/report.html``)."""
    run = load_run(Path(run_dir))
    return write_page(run_page(run), Path(output) if output else Path(run_dir) / REPORT_NAME)
