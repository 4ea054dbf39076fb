"""Which engine a layout needs, in words: the plan's ``engine_notes``.

:func:`engine_notes` explains what the chosen engine does with the layout and which settings the
other engine could not run; :mod:`launcher.validate` turns the impossible combinations into
errors (the runtime refuses DeepSpeed with pipeline stages, see :mod:`launcher.engines`).
"""

from __future__ import annotations

from launcher.config import EngineName, TrainwrightConfig


def deepspeed_blockers(cfg: TrainwrightConfig) -> list[str]:
    """Layout settings trainwright's DeepSpeed path cannot run (each with its reason)."""
    p = cfg.parallelism
    out = []
    if p.pipeline_parallel_size > 1:
        out.append(f"pipeline_parallel_size={p.pipeline_parallel_size}: the DeepSpeed path does "
                   "not pipeline (no stage split or schedule)")
        stages = f"zero_stage={p.zero_stage}" if p.zero_stage >= 2 else "zero_stage=2 or 3"
        out.append(f"{stages} with pipeline_parallel_size={p.pipeline_parallel_size}: ZeRO 2/3 "
                   "shard gradients that pipeline stages accumulate across micro-batches")
    if p.virtual_pipeline_parallel_size > 1:
        out.append(f"virtual_pipeline_parallel_size={p.virtual_pipeline_parallel_size}: "
                   "interleaved schedule is Megatron-Core's")
    if p.context_parallel_size > 1:
        out.append(f"context_parallel_size={p.context_parallel_size}: the sequence split and its "
                   "gradient reduction come from Megatron-Core's DDP and schedules")
    if p.expert_parallel_size > 1:
        out.append(f"expert_parallel_size={p.expert_parallel_size}: expert gradients reduce over "
                   "the expert-data-parallel group, which only Megatron-Core's DDP knows")
    return out


def megatron_blockers(cfg: TrainwrightConfig) -> list[str]:
    """Settings the Megatron engine cannot run."""
    p = cfg.parallelism
    out = []
    if p.zero_stage >= 2:
        out.append(f"zero_stage={p.zero_stage}: Megatron-Core shards optimizer state only "
                   "(distributed optimizer = ZeRO-1)")
    if p.offload_optimizer or p.offload_params:
        out.append("CPU offload (offload_optimizer/offload_params) is a DeepSpeed feature")
    return out


def _megatron_does(cfg: TrainwrightConfig) -> str:
    p = cfg.parallelism
    schedule = ("no pipelining" if p.pipeline_parallel_size == 1 else
                "interleaved 1F1B" if p.virtual_pipeline_parallel_size > 1 else "1F1B")
    optimizer = ("distributed optimizer (ZeRO-1)" if p.zero_stage == 1
                 else "DDP with a replicated optimizer")
    return (f"engine=megatron: Megatron-Core DDP + {optimizer}, forward/backward schedule "
            f"{schedule}; gradients reduced in "
            f"{'fp32' if cfg.engine.grad_reduce_in_fp32 else 'the compute dtype'}")


def engine_notes(cfg: TrainwrightConfig) -> list[str]:
    """Why the chosen engine runs this layout, and what the other engine would not run."""
    ds, mg = deepspeed_blockers(cfg), megatron_blockers(cfg)
    if cfg.engine.name == EngineName.megatron:
        notes = [_megatron_does(cfg) + (" (works)" if not mg else "")]
        notes += [f"engine=megatron cannot run {b}" for b in mg]
        notes += [f"engine=deepspeed would not work: {b}" for b in ds] or [
            f"engine=deepspeed would also run this layout (ZeRO stage {cfg.parallelism.zero_stage})"]
        return notes
    notes = [f"engine=deepspeed: ZeRO stage {cfg.parallelism.zero_stage} around the "
             "Megatron-Core GPTModel" + (" (works)" if not ds else "")]
    notes += [f"engine=deepspeed cannot run {b}; use engine=megatron" for b in ds]
    if ds and not mg:
        notes.append("engine=megatron runs this layout (parallelism.zero_stage=1 for the "
                     "distributed optimizer)")
    return notes
