"""``engine=megatron``: Megatron-Core DDP + (distributed) optimizer under its own schedules.

This ``__init__`` is the torch-free :class:`launcher.engines.base.EngineSpec` the plan asks;
:mod:`.engine` is the runtime (model chunks, DDP, optimizer, the timed schedule) and
:mod:`.checkpoint` its dist-checkpointing IO.
"""

from __future__ import annotations

from launcher.config import is_fp8
from launcher.core.problems import Problem
from launcher.engines.base import StateBytes
from launcher.engines.state_bytes import mixed_precision_bytes


class MegatronSpec:
    """What engine=megatron runs (see :class:`launcher.engines.base.EngineSpec`)."""

    name = "megatron"

    def summary(self, cfg) -> str:
        p = cfg.parallelism
        schedule = ("no pipelining" if p.pipeline_parallel_size == 1 else
                    "interleaved 1F1B" if p.virtual_pipeline_parallel_size > 1 else "1F1B")
        optimizer = ("distributed optimizer (ZeRO-1)" if p.zero_stage == 1
                     else "DDP with a replicated optimizer")
        return (f"engine=megatron: Megatron-Core DDP + {optimizer}, forward/backward schedule "
                f"{schedule}; gradients reduced in "
                f"{'fp32' if cfg.engine.grad_reduce_in_fp32 else 'the compute dtype'}")

    def cannot_run(self, cfg) -> list:
        p = cfg.parallelism
        out = []
        if p.zero_stage >= 2:
            out.append(f"zero_stage={p.zero_stage}: Megatron-Core shards optimizer state only "
                       "(distributed optimizer = ZeRO-1)")
        if p.offload_optimizer or p.offload_params:
            out.append("CPU offload (offload_optimizer/offload_params) is a DeepSpeed feature")
        return out

    def problems(self, cfg) -> list:
        p = cfg.parallelism
        out = []
        if p.zero_stage >= 2:
            out.append(Problem(
                ("parallelism.zero_stage", "engine"),
                f"engine=megatron supports parallelism.zero_stage 0 (DDP) or 1 (distributed "
                f"optimizer, ZeRO-1), got {p.zero_stage}; set parallelism.zero_stage=1, or use "
                "engine=deepspeed for ZeRO 2/3 (without pipeline parallelism)"))
        if p.offload_optimizer or p.offload_params:
            out.append(Problem(
                ("parallelism.offload_optimizer", "parallelism.offload_params", "engine"),
                "CPU offload (parallelism.offload_optimizer/offload_params) is a DeepSpeed "
                "feature; use engine=deepspeed or set both to false"))
        if is_fp8(cfg.trainer.precision) and cfg.trainer.fp8.param_gather and p.zero_stage != 1:
            out.append(Problem(
                ("trainer.fp8.param_gather", "parallelism.zero_stage"),
                "trainer.fp8.param_gather=true all-gathers FP8 weights from the distributed "
                f"optimizer's shards, which needs parallelism.zero_stage=1 (got {p.zero_stage}); "
                "set parallelism.zero_stage=1 or trainer.fp8.param_gather=false"))
        return out

    def state_bytes(self, *, precision, zero_stage: int, grad_fp32: bool,
                    offload_optimizer: bool, offload_params: bool, shards: int) -> StateBytes:
        """zero_stage 1 = the distributed optimizer: only the optimizer state is sharded."""
        weight, grad, optim = mixed_precision_bytes(precision, grad_fp32)
        return StateBytes(weight, grad, optim / shards if zero_stage >= 1 else optim)

    def gathered_layers(self, zero_stage: int) -> int:
        return 0

    def build(self, *, batch, model, parallelism, optimizer, trainer, engine):
        from launcher.engines.megatron.engine import build_megatron_engine

        return build_megatron_engine(batch=batch, model=model, parallelism=parallelism,
                                     optimizer=optimizer, trainer=trainer, engine=engine)

    def run_files(self, *, batch, parallelism, optimizer, trainer, engine) -> dict:
        return {}


SPEC = MegatronSpec()
