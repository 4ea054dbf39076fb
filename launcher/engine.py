"""The DeepSpeed engine around the Megatron-Core GPTModel, and one timed training step.

:func:`deepspeed_config` derives DeepSpeed's JSON config from the plan (batch sizes, accumulation)
and the narrow sub-configs (ZeRO stage and offload, precision and loss scaling, clipping, bucket
sizes); no value is restated by hand. :func:`build_engine` builds the model through
:mod:`launcher.model`, AdamW with weight-decay groups (none on biases and norms) and
``deepspeed.initialize`` with Megatron's parallel groups (:class:`cpu_compat.DeepSpeedMPU`).

:meth:`Engine.train_step` runs one optimizer step (all accumulation micro-batches) and times
the phases ``data``, ``forward``, ``loss``, ``backward``, ``optimizer``. DeepSpeed reduces gradients
inside ``engine.backward`` (in hooks under ZeRO 2/3, in its epilogue otherwise), so that time is
reported as ``time/backward+grad_sync`` and ``time/grad_sync`` stays 0.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from launcher.config import (EngineConfig, ModelConfig, OptimizerConfig, ParallelismConfig,
                             Precision, TrainerConfig)
from launcher.engine_common import (NonFiniteLoss, StepResult, agree_loss, masked_mean,
                                    param_groups)
from launcher.schedule import set_lr

__all__ = ["Engine", "NonFiniteLoss", "StepResult", "build_engine", "deepspeed_config",
           "param_groups", "FUSED_BACKWARD"]

NEVER_PRINT = 2 ** 31 - 1
FUSED_BACKWARD = "backward+grad_sync"
"""Metric name of the backward phase: DeepSpeed reduces gradients inside engine.backward."""


def _zero_section(plan, parallelism: ParallelismConfig, engine: EngineConfig) -> dict:
    stage = parallelism.zero_stage
    zero = {"stage": stage, "reduce_bucket_size": engine.reduce_bucket_size,
            "allgather_bucket_size": engine.reduce_bucket_size,
            "overlap_comm": engine.overlap_grad_reduce and plan.data_parallel_size > 1,
            "contiguous_gradients": True}
    if parallelism.offload_optimizer and stage >= 1:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if parallelism.offload_params and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = engine.reduce_bucket_size
    return zero


def deepspeed_config(plan, *, parallelism: ParallelismConfig, optimizer: OptimizerConfig,
                     trainer: TrainerConfig, engine: EngineConfig) -> dict:
    """DeepSpeed's config dict for ``plan`` (a :class:`launcher.plan.Plan`)."""
    precision = Precision(trainer.precision)
    return {
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "train_batch_size": plan.global_batch_size,
        "gradient_clipping": optimizer.clip_grad,
        "zero_optimization": _zero_section(plan, parallelism, engine),
        "bf16": {"enabled": precision == Precision.bf16},
        # loss_scale 0 = dynamic loss scaling, starting at 2**initial_scale_power.
        "fp16": {"enabled": precision == Precision.fp16, "loss_scale": 0,
                 "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                 "min_loss_scale": 1},
        "communication_data_type": "fp32" if engine.grad_reduce_in_fp32 else None,
        "data_types": {"grad_accum_dtype": "fp32" if engine.grad_reduce_in_fp32 else None},
        # The client optimizer (torch AdamW with decay groups) is used under every stage/offload.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": NEVER_PRINT,
        "wall_clock_breakdown": False,
    }


def _sync_sequence_parallel_grads(module: torch.nn.Module) -> None:
    """Sum the gradients of sequence-parallel norm weights over the TP group as they are
    produced (Megatron's finalize_model_grads does this; DeepSpeed does not)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()

    def reduce(grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        return grad

    for param in module.parameters():
        if getattr(param, "sequence_parallel", False):
            param.register_hook(reduce)


def build_engine(plan, *, model: ModelConfig, parallelism: ParallelismConfig,
                 optimizer: OptimizerConfig, trainer: TrainerConfig, engine: EngineConfig,
                 ds_config: Optional[dict] = None) -> "Engine":
    """GPTModel + AdamW + DeepSpeed engine on an initialised parallel state (collective)."""
    import deepspeed

    from launcher import cpu_compat
    from launcher.model import build_gpt_model

    cpu_compat.enable()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               auto_mpi_discovery=False)
    gpt = build_gpt_model(model, parallelism, trainer)
    if parallelism.sequence_parallel:
        _sync_sequence_parallel_grads(gpt)
    adamw = torch.optim.AdamW(param_groups(gpt, optimizer.weight_decay), lr=optimizer.lr,
                              betas=(optimizer.adam_beta1, optimizer.adam_beta2),
                              eps=optimizer.adam_eps)
    config = ds_config or deepspeed_config(plan, parallelism=parallelism, optimizer=optimizer,
                                           trainer=trainer, engine=engine)
    ds_engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=gpt, optimizer=adamw, config=config, mpu=cpu_compat.DeepSpeedMPU())
    return Engine(ds_engine, ds_optimizer, plan.grad_accum_steps, trainer.nan_policy)


class Engine:
    """A DeepSpeed engine plus the step logic (see module docstring)."""

    def __init__(self, ds_engine, ds_optimizer, grad_accum_steps: int, nan_policy: str):
        self.ds, self.optimizer = ds_engine, ds_optimizer
        self.grad_accum_steps, self.nan_policy = grad_accum_steps, nan_policy
        self.device = ds_engine.device

    def forward(self, batch: dict) -> torch.Tensor:
        """Per-token losses ``[b, s]`` of one micro-batch (labels given, so no logits)."""
        return self.ds(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    masked_mean = staticmethod(masked_mean)

    @property
    def checkpoint_io(self):
        """The object launcher.checkpoint saves and loads (DeepSpeed's engine itself)."""
        return self.ds

    def _agree_finite(self, loss: torch.Tensor) -> tuple[float, bool]:
        """(sum of losses over all ranks, whether every rank's loss is finite): one all-reduce."""
        total, _, finite = agree_loss(loss, 1, bool(torch.isfinite(loss.detach())))
        return total, finite

    def _surrogate(self) -> torch.Tensor:
        """A loss with zero gradient for every parameter (backward of a skipped micro-batch)."""
        return sum((p * 0).sum() for p in self.ds.module.parameters() if p.requires_grad)

    def train_step(self, next_batch: Callable[[], dict], lr: float, timer) -> StepResult:
        """One optimizer step over ``grad_accum_steps`` micro-batches from ``next_batch``."""
        timer.rename("backward", FUSED_BACKWARD)
        world = torch.distributed.get_world_size()
        total, bad = 0.0, False
        set_lr(self.optimizer, lr)
        for _ in range(self.grad_accum_steps):
            with timer.phase("data"):
                batch = {k: v.to(self.device) for k, v in next_batch().items()}
            with timer.phase("forward"):
                token_losses = self.forward(batch)
            with timer.phase("loss"):
                loss = self.masked_mean(token_losses, batch["loss_mask"])
                loss_sum, finite = self._agree_finite(loss)
                total += loss_sum / world
            if not finite:
                if self.nan_policy != "skip":
                    raise NonFiniteLoss("non-finite loss on at least one rank")
                bad = True
                set_lr(self.optimizer, 0.0)  # weights stay as they are for this step
            with timer.phase("backward"):
                self.ds.backward(loss if finite else self._surrogate())
            with timer.phase("optimizer"):
                self.ds.step()
        return StepResult(loss=math.nan if bad else total / self.grad_accum_steps,
                          grad_norm=self.grad_norm(), loss_scale=self.loss_scale(), skipped=bad,
                          micro_batches=self.grad_accum_steps)

    def grad_norm(self) -> Optional[float]:
        norm = self.ds.get_global_grad_norm()
        return None if norm is None else float(norm)

    def loss_scale(self) -> float:
        """The current (dynamic) loss scale under fp16; 1.0 otherwise."""
        scale = getattr(self.optimizer, "cur_scale", None)
        if scale is None:
            scaler = getattr(self.optimizer, "loss_scaler", None)
            scale = getattr(scaler, "cur_scale", 1.0)
        return float(scale)

    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        """Mean masked loss over ``batches`` on all ranks (model in eval mode meanwhile)."""
        self.ds.eval()
        total, count = 0.0, 0
        for batch in batches:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            total += float(self.masked_mean(self.forward(batch), batch["loss_mask"]))
            count += 1
        self.ds.train()
        packed = torch.tensor([total, float(count)], device=self.device)
        torch.distributed.all_reduce(packed)
        return float(packed[0] / packed[1].clamp(min=1))
