"""The plan as a page (``python -m launcher.plan ... plan.format=html``): :func:`plan_page`.

One self-contained HTML file (:mod:`launcher.html.page`): the layout, batch and time in a table,
the plan's warnings and notes; memory per GPU of each pipeline stage that can be the most
loaded (weights, gradients, optimizer state, activations) stacked against the GPU's capacity;
the parts of the step-time model; and, with a checkpoint interval and an MTBF, the expected
goodput. :func:`write_plan_page` writes it to ``plan.output`` (default ``plan.html``).
"""

from __future__ import annotations

from pathlib import Path

from launcher.config import TrainwrightConfig
from launcher.html.figures import COLORS
from launcher.html.page import Page, esc, write_page
from launcher.plan.plan import Plan, stage_memory

GIB = 2 ** 30
MEMORY_PARTS = ("weights", "grads", "optimizer", "activations")
"""The stacked parts of a GPU's memory (bytes of :class:`launcher.plan.plan.MemoryPerGPU`)."""


def summary_rows(plan: Plan) -> list:
    """(quantity, value) rows of the layout, batch, size and time."""
    d, b, c, m = plan.dims, plan.batch, plan.compute, plan.machines
    return [("GPUs", f"{d.world:,} ({m.nodes:,} nodes x {m.gpus_per_node} {m.gpu})"),
            ("engine", f"{plan.engine}, ZeRO stage {plan.zero_stage}"),
            ("TP x PP x CP x EP", f"{d.tp} x {d.pp} x {d.cp} x {d.ep}"
             + (f" (VPP {d.vpp})" if d.vpp > 1 else "")),
            ("data-parallel replicas", f"{d.dp:,}"),
            ("micro-batch x accumulation", f"{b.micro_batch_size} x {b.grad_accum_steps}"),
            ("global batch", f"{b.global_batch_size:,} sequences x {b.seq_length:,} tokens"),
            ("optimizer steps", f"{b.train_steps:,}"),
            ("parameters", f"{plan.params.total:,}"),
            ("memory per GPU (most loaded stage)", f"{plan.memory.per_gpu.total / GIB:.2f} GiB"
             f" of {m.gpu_memory_bytes / GIB:.0f} GiB" if m.gpu_memory_bytes else
             f"{plan.memory.per_gpu.total / GIB:.2f} GiB"),
            ("step time", f"{c.step_time_s:.3f} s (dominant cost besides compute: "
                          f"{c.dominant_cost})"),
            ("MFU", f"{c.mfu:.1%}"), ("tokens/s", f"{c.tokens_per_s:,.0f}"),
            ("time to train", f"{c.time_to_train_days:,.2f} days")]


def memory_figure(plan: Plan, cfg: TrainwrightConfig):
    """Memory per GPU of each stage view, stacked by part, with the GPU's capacity."""
    import plotly.graph_objects as go

    stages = stage_memory(cfg, plan.dims, plan.batch, plan.memory.flash_attention,
                          gpu_kernels=plan.machines.gpu.lower() != "cpu")
    names = [f"{s.stage} stage" if s.stage != "all" else "every stage" for s in stages]
    fig = go.Figure([go.Bar(x=names, y=[getattr(s, part) / GIB for s in stages], name=part,
                            marker_color=COLORS[i],
                            hovertemplate=f"{part}: %{{y:.2f}} GiB<extra></extra>")
                     for i, part in enumerate(MEMORY_PARTS)])
    capacity = plan.machines.gpu_memory_bytes / max(1, plan.machines.ranks_per_gpu)
    if capacity:
        fig.add_hline(y=capacity / GIB, line_dash="dash", line_color=COLORS[1],
                      annotation_text=f"{plan.machines.gpu}: {capacity / GIB:.0f} GiB per rank")
    fig.update_layout(barmode="stack", title="memory per GPU by pipeline stage (GiB)",
                      yaxis_title="GiB")
    return fig


def step_time_figure(plan: Plan):
    """Seconds per step of each part of the step-time model."""
    import plotly.graph_objects as go

    parts = {k: v for k, v in plan.compute.parts.items() if v > 0}
    fig = go.Figure([go.Bar(x=list(parts.values()), y=list(parts), orientation="h",
                            marker_color=COLORS[0],
                            hovertemplate="%{y}: %{x:.4f} s<extra></extra>")])
    fig.update_layout(title=f"step-time model: {plan.compute.step_time_s:.3f} s per step",
                      xaxis_title="seconds per step", yaxis=dict(autorange="reversed"))
    return fig


def plan_page(plan: Plan, cfg: TrainwrightConfig) -> Page:
    """The plan's page."""
    page = Page(f"trainwright plan: {cfg.model.name} on {plan.dims.world:,} {plan.machines.gpu}")
    page.table(("quantity", "value"), summary_rows(plan))
    for title, lines in (("warnings", plan.warnings), ("notes", plan.engine_notes)):
        if lines:
            page.heading(title.capitalize())
            page.raw("<ul>" + "".join(f"<li>{esc(line)}</li>" for line in lines) + "</ul>")
    page.heading("Memory")
    page.figure(memory_figure(plan, cfg), height=420)
    page.heading("Step time")
    page.figure(step_time_figure(plan), height=340)
    if plan.goodput is not None:
        g = plan.goodput
        page.heading("Goodput")
        page.paragraph(f"With one interruption every {g.mtbf_hours:,.1f} h for the whole job "
                       f"and {g.save_s:,.1f} s per save, trainer.save_interval="
                       f"{g.save_interval:,} steps gives an expected goodput of "
                       f"{g.expected:.1%}; {g.best_save_interval:,} steps would give "
                       f"{g.expected_at_best:.1%} (Young/Daly).")
    return page


def write_plan_page(page: Page, output: str, default: str) -> Path:
    """Write ``page`` to ``output`` (``plan.output``), or ``default`` in the current directory."""
    return write_page(page, Path(output or default))
