"""``engine=megatron``: Megatron-Core DDP + (distributed) optimizer under its own schedules.

This ``__init__`` is the torch-free :class:`launcher.engines.base.EngineSpec` the plan asks;
:mod:`.engine` is the runtime (model chunks, DDP, optimizer, the timed schedule) and
:mod:`.checkpoint` its dist-checkpointing IO.
"""

from __future__ import annotations

from launcher.config import is_fp8
from launcher.engines.base import Rule, RuleBook, StateBytes
from launcher.engines.state_bytes import mixed_precision_bytes


RULES = (
    Rule(("parallelism.zero_stage", "engine"), lambda cfg: cfg.parallelism.zero_stage >= 2,
         lambda cfg: f"zero_stage={cfg.parallelism.zero_stage}: Megatron-Core shards optimizer "
                     "state only (distributed optimizer = ZeRO-1)",
         lambda cfg: f"engine=megatron supports parallelism.zero_stage 0 (DDP) or 1 (distributed "
                     f"optimizer, ZeRO-1), got {cfg.parallelism.zero_stage}; set "
                     "parallelism.zero_stage=1, or use engine=deepspeed for ZeRO 2/3 (without "
                     "pipeline parallelism)"),
    Rule(("parallelism.offload_optimizer", "parallelism.offload_params", "engine"),
         lambda cfg: cfg.parallelism.offload_optimizer or cfg.parallelism.offload_params,
         lambda cfg: "CPU offload (offload_optimizer/offload_params) is a DeepSpeed feature",
         lambda cfg: "CPU offload (parallelism.offload_optimizer/offload_params) is a DeepSpeed "
                     "feature; use engine=deepspeed or set both to false"),
    Rule(("trainer.fp8.param_gather", "parallelism.zero_stage"),
         lambda cfg: is_fp8(cfg.trainer.precision) and cfg.trainer.fp8.param_gather
         and cfg.parallelism.zero_stage != 1, lambda cfg: None,
         lambda cfg: "trainer.fp8.param_gather=true all-gathers FP8 weights from the distributed "
                     "optimizer's shards, which needs parallelism.zero_stage=1 (got "
                     f"{cfg.parallelism.zero_stage}); set parallelism.zero_stage=1 or "
                     "trainer.fp8.param_gather=false"),
)
"""Every setting engine=megatron cannot run (the plan's notes and problems)."""


class MegatronSpec(RuleBook):
    """What engine=megatron runs (see :class:`launcher.engines.base.EngineSpec`)."""

    name = "megatron"
    RULES = RULES

    def summary(self, cfg) -> str:
        p = cfg.parallelism
        schedule = ("no pipelining" if p.pipeline_parallel_size == 1 else
                    "interleaved 1F1B" if p.virtual_pipeline_parallel_size > 1 else "1F1B")
        optimizer = ("distributed optimizer (ZeRO-1)" if p.zero_stage == 1
                     else "DDP with a replicated optimizer")
        return (f"engine=megatron: Megatron-Core DDP + {optimizer}, forward/backward schedule "
                f"{schedule}; gradients reduced in "
                f"{'fp32' if cfg.engine.grad_reduce_in_fp32 else 'the compute dtype'}")

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
