"""The DeepSpeed engine around the Megatron-Core GPTModel, one timed training step, its checkpoints.

:func:`deepspeed_config` derives DeepSpeed's JSON config from the plan's batch (batch sizes, accumulation)
and the narrow sub-configs (ZeRO stage and offload, precision and loss scaling, clipping, bucket
sizes); no value is restated by hand. :func:`build_engine` builds the model through
:mod:`launcher.engines.model`, AdamW with weight-decay groups (none on biases and norms) and
``deepspeed.initialize`` with Megatron's parallel groups (:class:`DeepSpeedMPU`).

:meth:`Engine.train_step` runs one optimizer step (all accumulation micro-batches) and times
the phases ``data``, ``forward``, ``loss``, ``backward``, ``optimizer``. DeepSpeed reduces gradients
inside ``engine.backward`` (in hooks under ZeRO 2/3, in its epilogue otherwise), so that time is
reported as ``time/backward+grad_sync`` and ``time/grad_sync`` stays 0.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from launcher.config import (EngineConfig, ModelConfig, OptimizerConfig, ParallelismConfig,
                             Precision, TrainerConfig, compute_precision)
from launcher.core.atomic import atomic_write_json
from launcher.core.errors import CheckpointError, IncompatibleCheckpoint, NonFiniteLoss
from launcher.engines import compat
from launcher.engines.base import StepResult
from launcher.engines.common import (initialize_weights, label_scores, length_multiple,
                                     masked_mean, padded, param_groups, row_end_logits,
                                     scored_row_count, set_lr)
from launcher.engines.deepspeed.files import TP_SPLIT_FILE, ZERO_FORMATS, saved_layout
from launcher.engines.deepspeed.mpu import DeepSpeedMPU
from launcher.engines.packed_rows import on_the_device
from launcher.parallel import collectives
from launcher.shape import Batch

__all__ = ["DeepSpeedEngine", "DeepSpeedCheckpointIO", "DeepSpeedMPU", "build_engine",
           "check_layout", "deepspeed_config", "param_groups", "saved_layout", "FUSED_BACKWARD"]

NEVER_PRINT = 2 ** 31 - 1
FUSED_BACKWARD = "backward+grad_sync"
"""Metric name of the backward phase: DeepSpeed reduces gradients inside engine.backward."""


def _zero_section(batch: Batch, parallelism: ParallelismConfig, engine: EngineConfig) -> dict:
    stage = parallelism.zero_stage
    zero = {"stage": stage, "reduce_bucket_size": engine.reduce_bucket_size,
            "allgather_bucket_size": engine.reduce_bucket_size,
            "overlap_comm": engine.overlap_grad_reduce and batch.data_parallel_size > 1,
            "contiguous_gradients": True}
    if parallelism.offload_optimizer and stage >= 1:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if parallelism.offload_params and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = engine.reduce_bucket_size
    return zero


def deepspeed_config(batch: Batch, *, parallelism: ParallelismConfig, optimizer: OptimizerConfig,
                     trainer: TrainerConfig, engine: EngineConfig) -> dict:
    """DeepSpeed's config dict for ``batch``."""
    precision = compute_precision(trainer.precision)
    return {
        "train_micro_batch_size_per_gpu": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.grad_accum_steps,
        "train_batch_size": batch.global_batch_size,
        "gradient_clipping": optimizer.clip_grad,
        "zero_optimization": _zero_section(batch, parallelism, engine),
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


def _sync_replicated_norm_grads(module: torch.nn.Module) -> None:
    """Sum the gradients of the norm weights every TP rank holds whole but sees only part of the
    data through, over the TP group, as they are produced: sequence-parallel norms (each rank
    holds a slice of the sequence) and query/key norms (each rank holds some of the heads).
    Megatron's finalize_model_grads does this (``_allreduce_non_tensor_model_parallel_grads``,
    which finds the QK norms by name, as here); DeepSpeed does not."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()

    def reduce(grad):
        return collectives.sum_(grad.clone(), group)

    for name, param in module.named_parameters():
        qk_norm = (".q_layernorm." in name or ".k_layernorm." in name) and not getattr(
            param, "tensor_model_parallel", False)  # OLMo 2's over all heads: split, not summed
        if getattr(param, "sequence_parallel", False) or qk_norm:
            param.register_hook(reduce)


def build_engine(*, batch: Batch, model: ModelConfig, parallelism: ParallelismConfig,
                 optimizer: OptimizerConfig, trainer: TrainerConfig, engine: EngineConfig,
                 ds_config: Optional[dict] = None) -> "DeepSpeedEngine":
    """GPTModel + AdamW + DeepSpeed engine on an initialised parallel state (collective)."""
    import deepspeed

    from launcher.engines.compat import prepare_deepspeed
    from launcher.engines.model import build_gpt_model

    prepare_deepspeed()
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(),
                               auto_mpi_discovery=False)
    gpt = build_gpt_model(model, parallelism, trainer)
    initialize_weights([gpt], init_from=trainer.init_from, seed=trainer.seed,
                       layout_invariant=trainer.layout_invariant_init)
    if parallelism.sequence_parallel or model.qk_layernorm:
        _sync_replicated_norm_grads(gpt)
    adamw = torch.optim.AdamW(param_groups(gpt, optimizer.weight_decay), lr=optimizer.lr,
                              betas=(optimizer.adam_beta1, optimizer.adam_beta2),
                              eps=optimizer.adam_eps)
    config = ds_config or deepspeed_config(batch, parallelism=parallelism, optimizer=optimizer,
                                           trainer=trainer, engine=engine)
    ds_engine, ds_optimizer, _, _ = deepspeed.initialize(
        args=_device_args(), model=gpt, optimizer=adamw, config=config, mpu=DeepSpeedMPU())
    return DeepSpeedEngine(ds_engine, ds_optimizer, batch.grad_accum_steps, trainer.nan_policy,
                           vocab_size=model.vocab_size)


def _device_args() -> SimpleNamespace:
    """DeepSpeed's ``args.device_rank``: the GPU this rank already uses. Left alone, DeepSpeed
    takes LOCAL_RANK, which names no GPU when ranks share one (cluster.ranks_per_gpu > 1)."""
    if torch.cuda.is_available():
        return SimpleNamespace(device_rank=torch.cuda.current_device())
    return SimpleNamespace(device_rank=int(os.environ.get("LOCAL_RANK", "0")))


class DeepSpeedEngine:
    """A DeepSpeed engine plus the step logic (see module docstring)."""

    def __init__(self, ds_engine, ds_optimizer, grad_accum_steps: int, nan_policy: str,
                 vocab_size: int = 0):
        self.ds, self.optimizer = ds_engine, ds_optimizer
        self.vocab_size = vocab_size
        """The model's vocabulary before padding (label scores give padding no probability)."""
        self.grad_accum_steps, self.nan_policy = grad_accum_steps, nan_policy
        self.device = ds_engine.device
        self.checkpoint_io = DeepSpeedCheckpointIO(ds_engine)

    def forward(self, batch: dict) -> torch.Tensor:
        """Per-token losses ``[b, s]`` of one micro-batch (labels given, so no logits)."""
        return self.ds(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    masked_mean = staticmethod(masked_mean)

    def reduce_phase_times(self, times: dict) -> dict:
        """Phase times as measured on this rank (every rank runs the same phases)."""
        return times

    @staticmethod
    def _agree_finite(loss: torch.Tensor) -> tuple[float, bool]:
        """(sum of losses over all ranks, whether every rank's loss is finite): one all-reduce."""
        value = float(loss.detach())
        total, _, finite = collectives.agree_loss(value, 1, math.isfinite(value))
        return total, finite

    def _surrogate(self) -> torch.Tensor:
        """A loss with zero gradient for every parameter (backward of a skipped micro-batch)."""
        return sum((p * 0).sum() for p in self.ds.module.parameters() if p.requires_grad)

    def train_step(self, next_batch: Callable[[], dict], lr: float, timer) -> StepResult:
        """One optimizer step over ``grad_accum_steps`` micro-batches from ``next_batch``."""
        timer.rename("backward", FUSED_BACKWARD)
        world = collectives.world_size()
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
    def label_scores(self, batches: list) -> Optional[list]:
        """See :meth:`launcher.engines.base.Engine.label_scores` (no pipeline: every rank
        computes the logits; tensor-parallel rank 0's sums count). Packed rows go to the
        attention as THD sequences under Transformer Engine, else with an explicit mask
        (launcher/engines/packed_rows.py)."""
        from megatron.core import parallel_state

        from launcher.engines.model import use_transformer_engine

        self.ds.eval()
        out, multiple = [], length_multiple(getattr(self.ds.module, "config", None))
        thd = use_transformer_engine()
        for batch in batches:  # of any shapes (launcher.evals.rows)
            batch = padded(batch, multiple)
            rows = scored_row_count(batch)
            batch = on_the_device(batch, self.device, thd=thd, cp=1)
            logits = self.ds(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                             packed_seq_params=batch.get("packed_seq_params"))
            out.append(tuple(x.cpu() for x in label_scores(
                logits, batch["labels"], batch["loss_mask"], batch["row_ids"], rows,
                self.vocab_size)))
        self.ds.train()
        return out if parallel_state.get_tensor_model_parallel_rank() == 0 else None

    @torch.no_grad()
    def next_tokens(self, tokens: torch.Tensor, ends: list) -> list:
        """See :meth:`launcher.engines.base.Engine.next_tokens` (no pipeline: every rank
        computes the logits, gathered over the tensor-parallel group)."""
        self.ds.eval()
        batch = padded({"tokens": tokens},
                       length_multiple(getattr(self.ds.module, "config", None)))
        logits = self.ds(batch["tokens"].to(self.device), batch["position_ids"].to(self.device),
                         None)
        ids = row_end_logits(logits, ends)[:, :self.vocab_size].float()
        self.ds.train()
        return ids.argmax(dim=-1).tolist()

    def data_parallel(self) -> tuple[int, int]:
        from megatron.core import parallel_state

        return (parallel_state.get_data_parallel_rank(),
                parallel_state.get_data_parallel_world_size())

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
        total, count = collectives.sum_floats([total, float(count)])
        return total / max(count, 1.0)


def tensor_parallel_split(module: torch.nn.Module) -> dict:
    """{parameter name: [axis, glu]} of every tensor-parallel parameter of ``module``, as
    Megatron-Core splits it (``partition_dim``); ``glu``: the SwiGLU input projection, whose
    shards each hold [gate; up] (Megatron-Core's ``apply_swiglu_sharded_factory``). What
    :class:`launcher.engines.weights.sources.DeepSpeedSource` merges the TP shards with."""
    gated = getattr(getattr(module, "config", None), "gated_linear_unit", False)
    return {name: [int(param.partition_dim), gated and ".linear_fc1." in f".{name}"]
            for name, param in module.named_parameters()
            if getattr(param, "tensor_model_parallel", False)}


def check_layout(saved: dict, current: dict, step_dir: Path) -> None:
    """Raise IncompatibleCheckpoint (exit 2), before any tensor is read, for what DeepSpeed
    cannot convert: another TP size (its merge/split rules know Megatron-LM's old parameter
    names, not Megatron-Core's), another optimizer-state format (ZeRO 0, 1/2 and 3 each have
    their own), and, under ZeRO, another DP size ("automatic adjustment of ZeRO's optimizer
    state partitioning with a new world size is not currently supported"). ZeRO 1 <-> 2, and any
    DP size at ZeRO stage 0, load."""
    problems = []
    if saved["tp"] and saved["tp"] != current["tp"]:
        problems.append(f"it holds {saved['tp']} tensor-parallel shard(s), this run has TP="
                        f"{current['tp']}: resume with parallelism.tensor_parallel_size="
                        f"{saved['tp']}")
    if saved["zero"] and saved["zero"] != current["zero"]:
        stage = {"ZeRO stage 0": "0", "ZeRO stage 1/2": "1 or 2", "ZeRO stage 3": "3"}
        problems.append(f"its optimizer state is in the {saved['zero']} format, this run uses "
                        f"{current['zero']}: resume with parallelism.zero_stage="
                        f"{stage[saved['zero']]}")
    elif saved["dp"] and current["zero"] != ZERO_FORMATS[0] and saved["dp"] != current["dp"]:
        tp = saved["tp"] or current["tp"]
        problems.append(f"its ZeRO optimizer state is partitioned over {saved['dp']} "
                        f"data-parallel ranks, this run has {current['dp']}, and DeepSpeed "
                        f"cannot repartition it: resume with DP={saved['dp']} (a world size of "
                        f"{saved['dp'] * tp} at TP={tp})")
    if problems:
        raise IncompatibleCheckpoint(f"DeepSpeed cannot load {step_dir} into this layout: "
                                     + "; ".join(problems) + ". Nothing was loaded.")


class DeepSpeedCheckpointIO:
    """DeepSpeed's own checkpoint files (model, ZeRO partitions) inside a step directory.

    ``engine.save_checkpoint(<parent>, tag=<step dir name>)`` writes ``<step dir>/...``; the
    caller owns ``latest``, so DeepSpeed's own pointer is not written. DeepSpeed saves
    synchronously (no background writes). A read first refuses what DeepSpeed cannot convert
    (:func:`check_layout`)."""

    def __init__(self, ds_engine):
        self.ds = ds_engine

    def prepare_read(self) -> None:
        """DeepSpeed's read allocates its state itself (nothing ahead)."""

    def write(self, step_dir: Path, *, background: bool) -> bool:
        self.ds.save_checkpoint(str(step_dir.parent), tag=step_dir.name, save_latest=False)
        if self.ds.mp_world_size > 1 and collectives.rank() == 0:
            atomic_write_json(step_dir / TP_SPLIT_FILE, tensor_parallel_split(self.ds.module))
        return False

    def finish_background(self, blocking: bool) -> bool:
        return True

    def layout(self) -> dict:
        """This engine's TP size, optimizer-state format and DP size (as :func:`saved_layout`)."""
        return {"tp": self.ds.mp_world_size, "dp": self.ds.dp_world_size,
                "zero": ZERO_FORMATS[self.ds.zero_optimization_stage()]}

    def read(self, step_dir: Path) -> None:
        check_layout(saved_layout(step_dir), self.layout(), step_dir)
        with compat.checkpoint_loads_without_code():
            path, _ = self.ds.load_checkpoint(str(step_dir.parent), tag=step_dir.name,
                                              load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load {step_dir}")
