"""Print a search's best candidates: a rich table, or one JSON object (``search.format``)."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from launcher.search.evaluate import Scored
from launcher.search.search import SearchResult

GIB = 2 ** 30


def candidate_dict(s: Scored) -> dict:
    """One candidate as the JSON output lists it."""
    c, mem = s.candidate, s.estimate.memory
    return {
        "overrides": c.overrides(),
        "parallelism": {"tensor_parallel_size": c.tp, "pipeline_parallel_size": c.pp,
                        "virtual_pipeline_parallel_size": c.vpp, "context_parallel_size": c.cp,
                        "expert_parallel_size": c.ep, "sequence_parallel": c.tp > 1,
                        "zero_stage": c.zero_stage,
                        "data_parallel_size": s.estimate.dims.dp,
                        "layers_in_first_stage": c.split.first,
                        "layers_in_last_stage": c.split.last,
                        "account_for_embedding_in_pipeline_split": c.split.embedding,
                        "account_for_loss_in_pipeline_split": c.split.loss},
        "trainer": {"micro_batch_size": c.micro_batch, "activation_recompute": c.recompute.value,
                    "grad_accum_steps": s.estimate.grad_accum},
        "engine": c.engine, "step_time_s": s.step.total, "mfu": s.mfu,
        "tokens_per_s": s.tokens_per_s, "dominant_cost": s.step.dominant,
        "step_time_parts": s.step.parts(),
        "memory_per_gpu": {"weights": mem.weights, "grads": mem.grads, "optimizer": mem.optimizer,
                           "activations": mem.activations, "total": mem.total,
                           "stage": mem.stage},
    }


def to_json(result: SearchResult, top: list[Scored], measured: list | None = None) -> str:
    out = {"searched": result.searched, "valid": result.valid,
           "global_batch_size": result.global_batch,
           "step_time_source": result.step_time_source,
           "candidates": [candidate_dict(s) for s in top]}
    if measured is not None:
        out["measured"] = measured
    return json.dumps(out)


def _layout(s: Scored) -> str:
    c = s.candidate
    parts = [f"TP{c.tp}", f"PP{c.pp}"] + ([f"VPP{c.vpp}"] if c.vpp > 1 else [])
    parts += [f"CP{c.cp}"] * (c.cp > 1) + [f"EP{c.ep}"] * (c.ep > 1)
    parts += [f"DP{s.estimate.dims.dp}"]
    split = c.split
    if split.first or split.last:
        parts.append(f"ends {split.first}/{split.last}")
    elif split.uneven:
        parts.append("emb+loss as layers")
    return " ".join(parts)


def render(result: SearchResult, top: list[Scored], console: Console | None = None) -> None:
    table = Table(title=f"trainwright search: {result.searched:,} layouts, {result.valid:,} "
                        f"valid and fitting, best {len(top)}", header_style="bold")
    for name in ("#", "layout", "engine/ZeRO", "mbs", "recompute", "step s", "tok/s", "MFU",
                 "GiB/GPU", "dominant cost"):
        table.add_column(name, justify="right" if name in ("#", "mbs", "step s", "tok/s", "MFU",
                                                            "GiB/GPU") else "left")
    for i, s in enumerate(top, 1):
        c = s.candidate
        table.add_row(str(i), _layout(s), f"{c.engine}/{c.zero_stage}", str(c.micro_batch),
                      c.recompute.value, f"{s.step.total:,.3f}", f"{s.tokens_per_s:,.0f}",
                      f"{s.mfu:.1%}", f"{s.estimate.memory.total / GIB:.1f}", s.step.dominant)
    console = console or Console(width=max(Console().width, 150))
    console.print(table)
    for i, s in enumerate(top, 1):
        console.print(f"{i}: {' '.join(s.candidate.overrides())}", soft_wrap=True)
