"""Render a Plan as a readable rich table (the JSON form is ``Plan.to_dict``)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from launcher.plan.plan import Plan

GIB = 2 ** 30


def _n(value: float) -> str:
    return f"{value:,.0f}"


def _b(value: float) -> str:
    return f"{value / GIB:,.2f} GiB"


def _si(value: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:,.2f}{unit}"
    return f"{value:,.0f}"


def _section(table: Table, title: str, rows: list[tuple[str, str, str]]) -> None:
    table.add_row(f"[bold cyan]{title}[/]", "", "")
    for row in rows:
        table.add_row(*row)


def _world_rows(p: Plan) -> list[tuple[str, str, str]]:
    h = p.machines
    machines, n = f"{h.nodes:,} nodes x {h.gpus_per_node} {h.gpu}", h.ranks_per_gpu
    if n == 1:
        return [("GPUs (world size)", _n(p.dims.world), machines)]
    return [("ranks (world size)", _n(p.dims.world), f"{machines}, {n} ranks on each"),
            ("ranks per GPU", str(n), "development: the ranks share each GPU's memory and compute")]


def _stage_detail(p: Plan) -> str:
    """'20 layers each' or '7, 8 x 14, 7 layers' for an uneven split (+ virtual stages)."""
    d, layers = p.dims, p.stage_layers
    virtual = f", {d.vpp} virtual" if d.vpp > 1 else ""
    if not layers or len(set(layers)) == 1:
        return f"{d.layers_per_stage(p.model.layers)} layers each" + virtual
    middle = layers[1:-1]
    inner = [f"{middle[0]} x {len(middle)}"] if middle and len(set(middle)) == 1 else \
        [str(n) for n in middle]
    return ", ".join([str(layers[0]), *inner, str(layers[-1])]) + " layers" + virtual


def _layout_rows(p: Plan) -> list[tuple[str, str, str]]:
    d = p.dims
    return _world_rows(p) + [
        ("tensor parallel (TP)", str(d.tp),
         f"{_n(d.tp_groups)} TP groups" + (", sequence parallel" if d.sequence_parallel else "")),
        ("pipeline stages (PP)", str(d.pp), _stage_detail(p)),
        ("context parallel (CP)", str(d.cp), ""),
        ("expert parallel (EP)", str(d.ep),
         f"{_n(d.edp)} expert-data-parallel replicas" if d.ep > 1 else ""),
        ("model-parallel group", _n(d.model_parallel), "TP x PP x CP GPUs per replica"),
        ("data-parallel replicas", _n(d.dp), f"engine={p.engine}, zero_stage={p.zero_stage}"),
    ]


def _batch_rows(p: Plan) -> list[tuple[str, str, str]]:
    b = p.batch
    return [
        ("micro-batch", f"{b.micro_batch_size} seq", f"{_n(b.micro_batch_tokens)} tokens"),
        ("gradient accumulation", str(b.grad_accum_steps), "micro-batches per step per replica"),
        ("global batch", f"{_n(b.global_batch_size)} seq", f"{_n(b.global_batch_tokens)} tokens"),
        ("optimizer steps", _n(b.train_steps), f"{_si(b.train_tokens)} tokens"),
    ]


def _param_rows(p: Plan) -> list[tuple[str, str, str]]:
    c = p.params
    rows = [(f"  {name}", _n(count), _si(count)) for name, count in c.by_component.items()]
    rows += [
        ("total", _n(c.total), f"{_si(c.total_unpadded)} without vocab padding"),
        ("vocabulary padding", _n(c.vocab_padding),
         f"{p.model.vocab:,} -> {p.model.padded_vocab:,} rows"),
        ("active per token", _n(c.active_per_token), ""),
        ("per GPU (most loaded)", _n(c.per_gpu), _si(c.per_gpu)),
    ]
    return rows


def _total_rows(p: Plan) -> list[tuple[str, str, str]]:
    """The most loaded GPU's total against its capacity (all ranks_per_gpu ranks on it)."""
    m, n, capacity = p.memory.per_gpu, p.machines.ranks_per_gpu, p.machines.gpu_memory_bytes
    cap = f"of {_b(capacity)}" if capacity else "capacity not checked"
    fits = not capacity or n * m.total <= capacity
    verdict = f"{cap} ({m.stage} stage) " + ("[green]fits[/]" if fits else "[red]DOES NOT FIT[/]")
    if n == 1:
        return [("total per GPU", _b(m.total), verdict)]
    return [("total per rank", _b(m.total), f"{n} ranks per GPU"),
            (f"total per GPU ({n} ranks)", _b(n * m.total), verdict)]


def _memory_rows(p: Plan) -> list[tuple[str, str, str]]:
    m = p.memory.per_gpu
    rows = [(f"  {k}", _b(getattr(m, k)), "") for k in ("weights", "grads", "optimizer")]
    rows.append(("  activations", _b(m.activations),
                 f"recompute={p.memory.activation_recompute}, "
                 f"{'flash' if p.memory.flash_attention else 'unfused'} attention"))
    rows += _total_rows(p)
    if m.cpu_offload:
        rows.append(("offloaded to CPU", _b(m.cpu_offload), "per GPU"))
    rows.append(("training state, 1 copy", _b(p.memory.training_state_bytes),
                 f"{_b(p.memory.redundant_state_bytes)} held redundantly across GPUs"))
    return rows


_CAUSES = {"compute": "forward, backward, recompute", "tensor_parallel": "TP collectives",
           "context_parallel": "CP ring not hidden", "expert_parallel": "expert all-to-all",
           "pipeline_bubble": "(PP-1)/VPP stage times", "pipeline_p2p": "stage sends/receives",
           "data_parallel": "gradient/param traffic not hidden", "optimizer": "optimizer step",
           "framework": "the engine's fixed cost per step (measured)"}


def _time_rows(p: Plan) -> list[tuple[str, str, str]]:
    c = p.compute
    flat = c.step_time_s != sum(c.parts.values()) if c.parts else True
    how = (f"flat plan.mfu: {c.mfu_while_computing:.0%} MFU while computing" if flat else
           f"step-time model; {c.mfu:.1%} MFU, {c.mfu_while_computing:.1%} while computing")
    rows = [
        ("precision", p.precision, p.precision_reason),
        ("FLOPs per step", f"{c.flops_per_step:.3e}", f"{c.flops_per_token:.3e} per token"),
        ("MFU", f"{c.mfu:.1%}", f"{c.mfu_causal:.1%} causal (attention counted half, as "
                                "Megatron-LM and NeMo log it); the first: full attention"),
        ("step time", f"{c.step_time_s:,.3f} s",
         f"{how}; peak {p.machines.peak_tflops_per_gpu:,.4g} TFLOP/s per GPU"),
    ]
    if c.fp8_layers:
        rows.append(("FP8", "on", c.fp8_layers + "; MFU against the bf16 peak"))
    if not flat:
        rows += [(f"  {name.replace('_', ' ')}", f"{seconds:,.3f} s",
                  f"{seconds / c.step_time_s:.1%}, {_CAUSES[name]}"
                  + (" [dominant]" if name == c.dominant_cost else ""))
                 for name, seconds in c.parts.items() if seconds > 0]
    return rows + [
        ("throughput", f"{_si(c.tokens_per_s)} tok/s",
         f"pipeline bubble (PP-1)/(VPP x accumulation) = {c.bubble_fraction:.1%} of compute"
         if p.dims.pp > 1 else ""),
        *_chat_rows(p),
        ("time to train", f"{c.time_to_train_days:,.2f} days", f"{p.batch.train_steps:,} steps"),
    ]


def _chat_rows(p: Plan) -> list[tuple[str, str, str]]:
    """data.format=chat: the planned tokens/s that are conversation, and those trained."""
    shares, tps = p.chat_tokens, p.compute.tokens_per_s
    if not shares:
        return []
    return [("  conversation tokens", f"{_si(tps * shares['real'])} tok/s",
             f"{shares['real']:.2%} of each row (the rest padding; the shards' manifests)"),
            ("  trained tokens", f"{_si(tps * shares['trained'])} tok/s",
             f"{shares['trained']:.2%} of each row are targets (chat.mask)")]


def _downstream_rows(p: Plan) -> list[tuple[str, str, str]]:
    d = p.downstream
    if not d:
        return []
    if "jobs" in d:  # eval.asynchronous
        return [("downstream tasks", "0 s in the run", f"{d['jobs']:,} eval jobs, one per "
                 "checkpoint, outside the run" + (f" ({d['seconds']:,.2f} s of scoring each at "
                                                  "the training's layout)" if d["rows"] else ""))]
    if not d["rows"]:
        return [("downstream tasks", "not priced", f"{d['evaluations']:,} evaluations; their rows "
                 "are counted when a run launches (eval.rows)")]
    return [("downstream tasks", f"{d['seconds'] * d['evaluations']:,.1f} s",
             f"{d['evaluations']:,} evaluations of {d['rows']:,} rows"
             + (f" ({d['tokens']:,} tokens)" if d.get("tokens") else "")
             + f", {d['seconds']:,.2f} s each (forward passes of micro-batches sized to the "
             "rows, every replica at once)")]


def _goodput_rows(p: Plan) -> list[tuple[str, str, str]]:
    g = p.goodput
    if g is None:
        return []
    every = f"every {g.save_interval:,} steps" if g.save_interval else "at the end only"
    return [
        ("checkpoint", _b(g.checkpoint_bytes), f"save {g.save_s:,.1f} s (loop stalls "
                                               f"{g.stall_s:,.1f} s"
                                               + (f", upload {g.upload_s:,.1f} s" if g.upload_s
                                                  else "") + f"), load {g.load_s:,.1f} s"),
        ("interrupted every", f"{g.mtbf_hours:,.1f} h",
         f"cluster.mtbf_hours / {p.machines.nodes:,} nodes; a restart costs {g.restart_s:,.0f} s"),
        ("launch", f"{g.startup_s + g.shutdown_s:,.0f} s",
         f"start-up {g.startup_s:,.1f} s, exit {g.shutdown_s:,.1f} s with the final save "
         f"({g.launch_source}); evaluations {g.eval_s:,.1f} s in all"),
        *_downstream_rows(p),
        ("expected goodput", f"{g.expected:.1%}", f"saving {every} (trainer.save_interval); "
                                                  "start-up, exit and evaluations counted"),
        ("best save interval", f"{g.best_save_interval:,}",
         f"steps: {g.expected_at_best:.1%} expected goodput (Young/Daly)"),
    ]


def _source_rows(p: Plan) -> list[tuple[str, str, str]]:
    """Where each figure comes from: measured, catalogue or assumed."""
    return [(name, "", source) for name, source in p.sources.items()]


def _engine_rows(p: Plan) -> list[tuple[str, str, str]]:
    return [("engine" if i == 0 else "", p.engine if i == 0 else "", note)
            for i, note in enumerate(p.engine_notes)]


def render_plan(plan: Plan, console: Console | None = None) -> None:
    table = Table(title="trainwright plan", show_header=True, header_style="bold")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("detail")
    _section(table, "layout", _layout_rows(plan))
    _section(table, "engine choice", _engine_rows(plan))
    _section(table, "batch", _batch_rows(plan))
    _section(table, "parameters", _param_rows(plan))
    _section(table, "memory per GPU" if plan.machines.ranks_per_gpu == 1 else "memory per rank",
             _memory_rows(plan))
    _section(table, "compute", _time_rows(plan))
    _section(table, "goodput", _goodput_rows(plan))
    _section(table, "sources", _source_rows(plan))
    (console or Console()).print(table)
