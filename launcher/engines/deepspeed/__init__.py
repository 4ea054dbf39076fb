"""``engine=deepspeed``: DeepSpeed ZeRO 0-3 (and CPU offload) around the Megatron-Core GPTModel.

This ``__init__`` is the torch-free :class:`launcher.engines.base.EngineSpec` the plan asks;
:mod:`.engine` is the runtime (DeepSpeed's config from the plan, ``deepspeed.initialize``, the
timed step, the checkpoint IO).
"""

from __future__ import annotations

from launcher.config import is_fp8
from launcher.engines.base import Rule, RuleBook, StateBytes
from launcher.engines.state_bytes import mixed_precision_bytes


def _unsupported(key: str):
    """The fix of a parallel size the DeepSpeed path cannot split (``key`` of parallelism)."""
    def fix(cfg) -> str:
        value = getattr(cfg.parallelism, key)
        return (f"parallelism.{key}={value} is not supported by engine=deepspeed (trainwright's "
                "DeepSpeed path has no Megatron-Core schedule or expert/context-parallel gradient "
                f"groups); use engine=megatron, or set parallelism.{key}=1")
    return fix


def _pp(cfg) -> int:
    return cfg.parallelism.pipeline_parallel_size


RULES = (
    Rule(("parallelism.pipeline_parallel_size", "engine"), lambda cfg: _pp(cfg) > 1,
         lambda cfg: f"pipeline_parallel_size={_pp(cfg)}: the DeepSpeed path does not pipeline "
                     "(no stage split or schedule)",
         lambda cfg: _unsupported("pipeline_parallel_size")(cfg)
         if cfg.parallelism.zero_stage < 2 else None),  # else the next rule refuses it
    Rule(("parallelism.zero_stage", "parallelism.pipeline_parallel_size", "engine"),
         lambda cfg: _pp(cfg) > 1,
         lambda cfg: (f"zero_stage={cfg.parallelism.zero_stage}" if cfg.parallelism.zero_stage
                      >= 2 else "zero_stage=2 or 3") + f" with pipeline_parallel_size="
         f"{_pp(cfg)}: ZeRO 2/3 shard gradients that pipeline stages accumulate across "
         "micro-batches",
         lambda cfg: None if cfg.parallelism.zero_stage < 2 else (
             f"parallelism.zero_stage={cfg.parallelism.zero_stage} with pipeline_parallel_size="
             f"{_pp(cfg)} is not supported by DeepSpeed (ZeRO 2/3 shard gradients that pipeline "
             "stages accumulate across micro-batches, and trainwright's DeepSpeed path does not "
             f"pipeline); pipeline_parallel_size={_pp(cfg)} with zero_stage="
             f"{cfg.parallelism.zero_stage} needs engine=megatron with the distributed optimizer "
             "(parallelism.zero_stage=1)")),
    Rule(("parallelism.virtual_pipeline_parallel_size", "engine"),
         lambda cfg: cfg.parallelism.virtual_pipeline_parallel_size > 1,
         lambda cfg: f"virtual_pipeline_parallel_size="
                     f"{cfg.parallelism.virtual_pipeline_parallel_size}: interleaved schedule is "
                     "Megatron-Core's",
         _unsupported("virtual_pipeline_parallel_size")),
    Rule(("parallelism.context_parallel_size", "engine"),
         lambda cfg: cfg.parallelism.context_parallel_size > 1,
         lambda cfg: f"context_parallel_size={cfg.parallelism.context_parallel_size}: the "
                     "sequence split and its gradient reduction come from Megatron-Core's DDP and "
                     "schedules",
         _unsupported("context_parallel_size")),
    Rule(("parallelism.expert_parallel_size", "engine"),
         lambda cfg: cfg.parallelism.expert_parallel_size > 1,
         lambda cfg: f"expert_parallel_size={cfg.parallelism.expert_parallel_size}: expert "
                     "gradients reduce over the expert-data-parallel group, which only "
                     "Megatron-Core's DDP knows",
         _unsupported("expert_parallel_size")),
    Rule(("model.moe_router_expert_bias", "engine"),
         lambda cfg: cfg.model.num_experts > 0 and cfg.model.moe_router_expert_bias,
         lambda cfg: "model.moe_router_expert_bias=true: the bias is moved toward balanced "
                     "loads after each step by Megatron-Core's finalize_model_grads",
         lambda cfg: "model.moe_router_expert_bias=true (DeepSeek-V3's load-balancing bias) needs "
                     "engine=megatron: Megatron-Core updates the bias from the step's expert "
                     "loads in finalize_model_grads, which the DeepSpeed path does not run; use "
                     "engine=megatron"),
    Rule(("trainer.precision", "engine"), lambda cfg: is_fp8(cfg.trainer.precision),
         lambda cfg: "trainer.precision=fp8: Transformer Engine's FP8 autocast and scaling state "
                     "are wired into engine=megatron only",
         lambda cfg: "trainer.precision=fp8 needs engine=megatron (Megatron-Core's transformer "
                     "block enters Transformer Engine's FP8 autocast and reduces its scaling "
                     "state; the DeepSpeed path was not built or measured with FP8); use "
                     "engine=megatron or trainer.precision=bf16"),
    Rule(("trainer.async_save", "engine"), lambda cfg: cfg.trainer.async_save, lambda cfg: None,
         lambda cfg: "trainer.async_save=true needs engine=megatron (Megatron-Core "
                     "dist-checkpointing); DeepSpeed saves synchronously: set "
                     "trainer.async_save=false or engine=megatron"),
    Rule(("parallelism.offload_params", "parallelism.zero_stage"),
         lambda cfg: cfg.parallelism.offload_params and cfg.parallelism.zero_stage != 3,
         lambda cfg: None,
         lambda cfg: f"parallelism.offload_params=true needs zero_stage=3 (got "
                     f"{cfg.parallelism.zero_stage}); set parallelism.zero_stage=3 or "
                     "parallelism.offload_params=false"),
)
"""Every setting engine=deepspeed cannot run (the plan's notes and problems)."""


class DeepSpeedSpec(RuleBook):
    """What engine=deepspeed runs (see :class:`launcher.engines.base.EngineSpec`)."""

    name = "deepspeed"
    RULES = RULES

    def summary(self, cfg) -> str:
        return (f"engine=deepspeed: ZeRO stage {cfg.parallelism.zero_stage} around the "
                "Megatron-Core GPTModel; measured 1.22x the step of engine=megatron on one H100 "
                "(Llama 3.2 1B: backward 390 vs 202 ms, optimizer 52 vs 26 ms, docs/gpu.md), "
                "which the step time here includes")

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


SPEC = DeepSpeedSpec()
