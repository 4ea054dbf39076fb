"""``engine=deepspeed``: DeepSpeed ZeRO 0-3 (and CPU offload) around the Megatron-Core GPTModel.

This ``__init__`` is the torch-free :class:`launcher.engines.base.EngineSpec` the plan asks;
:mod:`.engine` is the runtime (DeepSpeed's config from the plan, ``deepspeed.initialize``, the
timed step, the checkpoint IO).
"""

from __future__ import annotations

from launcher.config import is_fp8
from launcher.core.problems import Problem
from launcher.engines.base import StateBytes
from launcher.engines.state_bytes import mixed_precision_bytes


class DeepSpeedSpec:
    """What engine=deepspeed runs (see :class:`launcher.engines.base.EngineSpec`)."""

    name = "deepspeed"

    def summary(self, cfg) -> str:
        return (f"engine=deepspeed: ZeRO stage {cfg.parallelism.zero_stage} around the "
                "Megatron-Core GPTModel; measured 1.22x the step of engine=megatron on one H100 "
                "(Llama 3.2 1B: backward 390 vs 202 ms, optimizer 52 vs 26 ms, docs/gpu.md), "
                "which the step time here includes")

    def cannot_run(self, cfg) -> list:
        p = cfg.parallelism
        out = []
        if p.pipeline_parallel_size > 1:
            out.append(f"pipeline_parallel_size={p.pipeline_parallel_size}: the DeepSpeed path "
                       "does not pipeline (no stage split or schedule)")
            stages = f"zero_stage={p.zero_stage}" if p.zero_stage >= 2 else "zero_stage=2 or 3"
            out.append(f"{stages} with pipeline_parallel_size={p.pipeline_parallel_size}: ZeRO "
                       "2/3 shard gradients that pipeline stages accumulate across micro-batches")
        if p.virtual_pipeline_parallel_size > 1:
            out.append(f"virtual_pipeline_parallel_size={p.virtual_pipeline_parallel_size}: "
                       "interleaved schedule is Megatron-Core's")
        if p.context_parallel_size > 1:
            out.append(f"context_parallel_size={p.context_parallel_size}: the sequence split and "
                       "its gradient reduction come from Megatron-Core's DDP and schedules")
        if p.expert_parallel_size > 1:
            out.append(f"expert_parallel_size={p.expert_parallel_size}: expert gradients reduce "
                       "over the expert-data-parallel group, which only Megatron-Core's DDP knows")
        if is_fp8(cfg.trainer.precision):
            out.append("trainer.precision=fp8: Transformer Engine's FP8 autocast and scaling "
                       "state are wired into engine=megatron only")
        return out

    def problems(self, cfg) -> list:
        p = cfg.parallelism
        out = []
        if p.pipeline_parallel_size > 1 and p.zero_stage >= 2:
            out.append(Problem(
                ("parallelism.zero_stage", "parallelism.pipeline_parallel_size", "engine"),
                f"parallelism.zero_stage={p.zero_stage} with pipeline_parallel_size="
                f"{p.pipeline_parallel_size} is not supported by DeepSpeed (ZeRO 2/3 shard "
                "gradients that pipeline stages accumulate across micro-batches, and "
                "trainwright's DeepSpeed path does not pipeline); pipeline_parallel_size="
                f"{p.pipeline_parallel_size} with zero_stage={p.zero_stage} needs "
                "engine=megatron with the distributed optimizer (parallelism.zero_stage=1)"))
        out += _layout_problems(p)
        if cfg.trainer.async_save:
            out.append(Problem(
                ("trainer.async_save", "engine"),
                "trainer.async_save=true needs engine=megatron (Megatron-Core "
                "dist-checkpointing); DeepSpeed saves synchronously: set "
                "trainer.async_save=false or engine=megatron"))
        if is_fp8(cfg.trainer.precision):
            out.append(Problem(
                ("trainer.precision", "engine"),
                "trainer.precision=fp8 needs engine=megatron (Megatron-Core's transformer block "
                "enters Transformer Engine's FP8 autocast and reduces its scaling state; the "
                "DeepSpeed path was not built or measured with FP8); use engine=megatron or "
                "trainer.precision=bf16"))
        if p.offload_params and p.zero_stage != 3:
            out.append(Problem(
                ("parallelism.offload_params", "parallelism.zero_stage"),
                f"parallelism.offload_params=true needs zero_stage=3 (got {p.zero_stage}); set "
                "parallelism.zero_stage=3 or parallelism.offload_params=false"))
        return out

    def state_bytes(self, *, precision, zero_stage: int, grad_fp32: bool,
                    offload_optimizer: bool, offload_params: bool, shards: int) -> StateBytes:
        """ZeRO-1 shards the optimizer state, ZeRO-2 the gradients too, ZeRO-3 the weights too;
        offload moves the optimizer state (and ZeRO-3 weights) to host memory."""
        weight, grad, optim = mixed_precision_bytes(precision, grad_fp32)
        weights = weight / shards if zero_stage >= 3 else weight
        grads = grad / shards if zero_stage >= 2 else grad
        optimizer = optim / shards if zero_stage >= 1 else optim
        cpu = 0.0
        if offload_optimizer:
            cpu, optimizer = cpu + optimizer, 0.0
        if offload_params and zero_stage >= 3:
            cpu, weights = cpu + weights, 0.0
        return StateBytes(weights, grads, optimizer, cpu)

    def gathered_layers(self, zero_stage: int) -> int:
        """ZeRO-3 holds the layer it computes plus the prefetched next one, gathered whole."""
        return 2 if zero_stage >= 3 else 0

    def build(self, *, batch, model, parallelism, optimizer, trainer, engine):
        from launcher.engines.deepspeed.engine import build_engine

        return build_engine(batch=batch, model=model, parallelism=parallelism,
                            optimizer=optimizer, trainer=trainer, engine=engine)

    def run_files(self, *, batch, parallelism, optimizer, trainer, engine) -> dict:
        from launcher.engines.deepspeed.engine import deepspeed_config

        return {"ds_config.json": deepspeed_config(batch, parallelism=parallelism,
                                                   optimizer=optimizer, trainer=trainer,
                                                   engine=engine)}


def _layout_problems(p) -> list:
    """Pipeline stages (when ZeRO 2/3 has not already said so), virtual stages, context and
    expert parallelism need Megatron-Core's DDP and schedules."""
    sizes = {"pipeline_parallel_size": p.pipeline_parallel_size if p.zero_stage < 2 else 1,
             "virtual_pipeline_parallel_size": p.virtual_pipeline_parallel_size,
             "context_parallel_size": p.context_parallel_size,
             "expert_parallel_size": p.expert_parallel_size}
    return [Problem((f"parallelism.{key}", "engine"),
                          f"parallelism.{key}={value} is not supported by engine=deepspeed "
                          "(trainwright's DeepSpeed path has no Megatron-Core schedule or "
                          f"expert/context-parallel gradient groups); use engine=megatron, or "
                          f"set parallelism.{key}=1")
            for key, value in sizes.items() if value > 1]


SPEC = DeepSpeedSpec()
