"""``engine=megatron``: Megatron-Core DDP + optimizer, driven by Megatron-Core's schedules.

:func:`build_megatron_engine` builds this rank's model chunks (one per virtual pipeline stage,
through :func:`launcher.engines.model.build_gpt_model`), wraps each in Megatron-Core's
``DistributedDataParallel`` (gradients reduced in fp32 and overlapped with backward as
``engine.*`` says; ``parallelism.zero_stage=1`` = ``use_distributed_optimizer``, ZeRO-1) and builds
``get_megatron_optimizer`` (AdamW, no decay on biases and norms, clipping, fp16 loss scaling).

:meth:`MegatronEngine.train_step` hands the step's micro-batches to
``get_forward_backward_func()``: no pipelining at PP=1, 1F1B at PP>1, interleaved with virtual
stages. It implements :class:`launcher.engines.base.Engine` (StepResult, nan policy, phase
timers), as the DeepSpeed engine does, so :class:`launcher.runtime.loop.TrainLoop` drives both. Phases: ``data``
(fetching the step's micro-batches), ``forward`` and ``loss`` (timed inside the schedule's
forward step), ``grad_sync`` (``finalize_model_grads``: the wait for the reduce, the tied-embedding
and sequence-parallel reductions), ``backward`` (the rest of the schedule: backward passes and
pipeline communication) and ``optimizer``. At log steps
:meth:`MegatronEngine.reduce_phase_times` makes each phase time the maximum over the pipeline
stages (rank 0 logs the metrics; only the last stage computes the loss).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import Callable, Optional

import torch

from launcher.config import (EngineConfig, ModelConfig, OptimizerConfig, ParallelismConfig,
                             Precision, TrainerConfig, compute_precision, is_fp8)
from launcher.core.errors import NonFiniteLoss
from launcher.core.phases import PHASES
from launcher.engines.base import StepResult
from launcher.engines.common import masked_mean, set_lr
from launcher.engines.megatron.generation import next_tokens
from launcher.engines.packed_rows import on_the_device
from launcher.engines.megatron.scoring import data_parallel, score_batches
from launcher.engines.model import use_transformer_engine
from launcher.parallel import collectives
from launcher.shape import Batch
from launcher.shape.model import ResolvedModel
from launcher.shape.stages import StageSplit, stage_layers

LOAD_BALANCING_METRIC = "moe/load_balancing_loss"
"""Metric name of the MoE router's load-balancing (aux) loss, mean over MoE layers."""


def build_model_chunks(model: ModelConfig, parallelism: ParallelismConfig,
                       trainer: TrainerConfig) -> list:
    """This rank's GPTModel chunks: one per virtual pipeline stage (one without VPP)."""
    from megatron.core import parallel_state as ps

    from launcher.engines.model import build_gpt_model

    vpp = parallelism.virtual_pipeline_parallel_size
    chunks = []
    for index in range(vpp):
        vp = index if vpp > 1 else None
        chunks.append(build_gpt_model(
            model, parallelism, trainer,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            vp_stage=vp))
    return chunks


def ddp_config(parallelism: ParallelismConfig, engine: EngineConfig,
               fp8_param_gather: bool = False):
    """Megatron-Core DDP settings from ``engine.*`` and ``parallelism.zero_stage``;
    ``fp8_param_gather``: FP8 weights all-gathered in FP8 (trainer.fp8.param_gather)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    distributed = parallelism.zero_stage == 1
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=engine.grad_reduce_in_fp32,
        overlap_grad_reduce=engine.overlap_grad_reduce,
        overlap_param_gather=engine.overlap_param_gather and distributed,
        use_distributed_optimizer=distributed,
        bucket_size=engine.reduce_bucket_size,
        fp8_param_gather=fp8_param_gather and distributed,
        check_for_nan_in_grad=False)


def optimizer_config(optimizer: OptimizerConfig, trainer: TrainerConfig, distributed: bool):
    """Megatron-Core OptimizerConfig: AdamW, clipping, mixed precision and loss scaling."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    precision = Precision(compute_precision(trainer.precision))  # fp8: bf16 outside FP8 GEMMs
    dtype = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}.get(
        precision, torch.float32)
    return MegatronOptimizerConfig(
        optimizer="adam", lr=optimizer.lr, min_lr=optimizer.min_lr,
        weight_decay=optimizer.weight_decay, adam_beta1=optimizer.adam_beta1,
        adam_beta2=optimizer.adam_beta2, adam_eps=optimizer.adam_eps,
        clip_grad=optimizer.clip_grad, bf16=precision == Precision.bf16,
        fp16=precision == Precision.fp16, params_dtype=dtype,
        initial_loss_scale=2.0 ** 16, min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2,
        use_distributed_optimizer=distributed, decoupled_weight_decay=True)


def _wrap_chunks(chunks: list, parallelism: ParallelismConfig, engine: EngineConfig,
                 trainer: TrainerConfig) -> list:
    """Float16Module (bf16/fp16/fp8) then Megatron DDP around every chunk."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    precision = Precision(compute_precision(trainer.precision))
    fp8_gather = is_fp8(trainer.precision) and trainer.fp8.param_gather
    config = ddp_config(parallelism, engine, fp8_param_gather=fp8_gather)
    wrapped = []
    for index, chunk in enumerate(chunks):
        if precision in (Precision.bf16, Precision.fp16):
            chunk = Float16Module(chunk.config, chunk)
        wrapped.append(DistributedDataParallel(chunk.config, config, chunk,
                                               disable_bucketing=index > 0))
    return wrapped


def _one_or_list(values: list):
    return values[0] if len(values) == 1 else values


def _configure_schedule(chunks: list, optimizer, engine: EngineConfig, timer_box: dict) -> None:
    """The TransformerConfig hooks the schedules call (as Megatron's own training loop sets)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    if torch.distributed.get_backend() == "gloo":
        # Batched p2p (p2p_communication._batched_p2p_ops) posts send_prev before send_next; the
        # peer posts recv_prev before recv_next. gloo matches messages between two ranks in
        # posting order, so at PP=2 (prev = next) the interleaved schedule's activation and
        # gradient swap. The unbatched path orders sends and receives by even/odd rank.
        config.batch_p2p_comm = False
    if engine.overlap_grad_reduce:
        config.no_sync_func = _one_or_list([c.no_sync for c in chunks])
        config.grad_sync_func = _one_or_list([c.start_grad_sync for c in chunks])

    def timed_finalize(*args, **kwargs):
        start = time.perf_counter()
        finalize_model_grads(*args, **kwargs)
        timer_box["grad_sync"] = timer_box.get("grad_sync", 0.0) + time.perf_counter() - start

    config.finalize_model_grads_func = timed_finalize
    config.grad_scale_func = optimizer.scale_loss


def build_megatron_engine(*, batch: Batch, model: ModelConfig, parallelism: ParallelismConfig,
                          optimizer: OptimizerConfig, trainer: TrainerConfig,
                          engine: EngineConfig) -> "MegatronEngine":
    """Model chunks + DDP + Megatron optimizer on an initialised parallel state (collective)."""
    from megatron.core.optimizer import get_megatron_optimizer

    from launcher.engines import compat
    from launcher.engines.common import initialize_weights

    compat.start_save_results_queue(trainer.stop_signal)  # forked while the rank holds no model
    chunks = build_model_chunks(model, parallelism, trainer)
    initialize_weights(chunks, init_from=trainer.init_from, seed=trainer.seed,
                       layout_invariant=trainer.layout_invariant_init)
    chunks = _wrap_chunks(chunks, parallelism, engine, trainer)
    opt = get_megatron_optimizer(
        optimizer_config(optimizer, trainer, parallelism.zero_stage == 1), chunks)
    return MegatronEngine(chunks, opt, batch=batch, engine=engine, trainer=trainer,
                          moe_layers=ResolvedModel.of(model).moe_layers,
                          vocab_size=model.vocab_size,
                          stage_layers=stage_layers(model.num_layers,
                                                    parallelism.pipeline_parallel_size,
                                                    StageSplit.of(parallelism)))


class _Clock:
    """Seconds per phase measured inside the schedule (added to the PhaseTimer afterwards)."""

    def __init__(self):
        self.seconds: dict = {}

    def add(self, name: str, start: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class MegatronEngine:
    """Megatron-Core model chunks, DDP and optimizer plus the step logic (see module docstring).

    ``chunks`` are the DDP-wrapped model chunks (one per virtual stage); ``optimizer`` is the
    Megatron optimizer; :attr:`checkpoint_io` writes and reads them with dist-checkpointing."""

    def __init__(self, chunks: list, optimizer, *, batch: Batch, engine: EngineConfig,
                 trainer: TrainerConfig, moe_layers: int = 0, stage_layers: tuple = (),
                 vocab_size: int = 0):
        from megatron.core import parallel_state

        from launcher.engines.megatron.checkpoint import MegatronCheckpointIO, buffer_layout

        self.chunks, self.optimizer = chunks, optimizer
        self.grad_accum_steps, self.nan_policy = batch.grad_accum_steps, trainer.nan_policy
        self.per_token = bool(trainer.per_token_loss)
        """The loss summed per target token over the global batch (trainer.per_token_loss)."""
        self.micro_batch_size, self.moe_layers = batch.micro_batch_size, moe_layers
        self.vocab_size = vocab_size
        """The model's vocabulary before padding (label scores give padding no probability)."""
        self.cp = parallel_state.get_context_parallel_world_size()
        self.seq_length = batch.seq_length // self.cp
        self.packed_thd = use_transformer_engine()
        """Chat rows go through TE's attention as packed THD sequences (packed_rows)."""
        self.device = collectives.device_for()
        self._box: dict = {}
        self._grad_norm: Optional[float] = None
        _configure_schedule(chunks, optimizer, engine, self._box)
        self.checkpoint_io = MegatronCheckpointIO(
            chunks, optimizer, engine.optimizer_checkpoint,
            buffer_layout(stage_layers=stage_layers, engine=engine, trainer=trainer))

    def _prepare(self, batch: dict) -> dict:
        """Move to the device and keep this context-parallel rank's part of the sequence; chat
        rows (they carry segment ids) become one THD sequence under TE, or get their attention
        mask built on the device for the local attention (packed_rows)."""
        return on_the_device(batch, self.device, thd=self.packed_thd, cp=self.cp)

    def _loss_func(self, loss_mask: torch.Tensor, clock: _Clock, token_losses: torch.Tensor):
        """Masked mean over the whole (context-parallel) sequence; the schedule multiplies by CP
        and divides by the number of micro-batches."""
        from megatron.core import parallel_state

        start = time.perf_counter()
        if self.per_token:  # the sum and its tokens; the schedule and DDP divide by the total
            count = loss_mask.float().sum().detach()
            total = (token_losses.float() * loss_mask.float()).sum()
            clock.add("loss", start)
            return total, count.int(), {"lm loss": torch.stack([total.detach(), count])}
        count = loss_mask.float().sum().detach()
        if self.cp > 1:
            collectives.sum_(count, parallel_state.get_context_parallel_group())
        loss = masked_mean(token_losses, loss_mask, count)
        reported = loss.detach().clone() * self.cp
        clock.add("loss", start)
        return loss, {"lm loss": reported}

    def _forward_step(self, clock: _Clock):
        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            start = time.perf_counter()
            output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                           labels=batch["labels"],
                           packed_seq_params=batch.get("packed_seq_params"))
            clock.add("forward", start)
            return output, functools.partial(self._loss_func, batch["loss_mask"], clock)
        return forward_step

    def _run_schedule(self, batches: list, clock: _Clock, forward_only: bool) -> list:
        """Every micro-batch through Megatron-Core's schedule; the loss dicts of the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        seq_length, micro_batch_size = self.seq_length, self.micro_batch_size
        if batches and "packed_seq_params" in batches[0]:  # [1, b * s]: the stages' shapes
            seq_length, micro_batch_size = seq_length * micro_batch_size, 1
        return get_forward_backward_func()(
            forward_step_func=self._forward_step(clock),
            data_iterator=_one_or_list([iter(batches) for _ in self.chunks]),
            model=_one_or_list(self.chunks), num_microbatches=len(batches),
            seq_length=seq_length, micro_batch_size=micro_batch_size,
            forward_only=forward_only)

    def _agree(self, losses: list) -> tuple[float, bool, float]:
        """(mean loss over micro-batches and ranks that computed one, all finite, target tokens
        per replica); ranks without a loss (every pipeline stage but the last) contribute
        nothing. With per-token loss, the mean is over every target token of the step."""
        if self.per_token:
            pair = torch.stack([d["lm loss"].float() for d in losses]).sum(0) if losses \
                else torch.zeros(2)
            local, tokens = float(pair[0]), float(pair[1])
            total, count, finite = collectives.agree_loss(local, tokens, math.isfinite(local))
            return total / max(count, 1.0), finite, count
        local = float(torch.stack([d["lm loss"].float() for d in losses]).sum()) if losses \
            else 0.0
        total, count, finite = collectives.agree_loss(local, len(losses), math.isfinite(local))
        return total / max(count, 1.0), finite, 0.0

    def train_step(self, next_batch: Callable[[], dict], lr: float, timer) -> StepResult:
        """One optimizer step over ``grad_accum_steps`` micro-batches from ``next_batch``."""
        with timer.phase("data"):
            batches = [self._prepare(next_batch()) for _ in range(self.grad_accum_steps)]
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        set_lr(self.optimizer, lr)
        clock, self._box["grad_sync"] = _Clock(), 0.0
        start = time.perf_counter()
        losses = self._run_schedule(batches, clock, forward_only=False)
        self._charge(timer, clock, time.perf_counter() - start)
        loss, finite, tokens = self._agree(losses)
        extra = self._moe_metrics()
        if self.per_token:  # counted on every last-stage rank: TP and CP ranks repeat a replica's
            extra["target_tokens"] = tokens / self._loss_ranks_per_replica()
        if not finite:
            if self.nan_policy != "skip":
                raise NonFiniteLoss("non-finite loss on at least one rank")
            return StepResult(math.nan, None, self.loss_scale(), True, len(batches), extra)
        with timer.phase("optimizer"):
            _, grad_norm, _ = self.optimizer.step()
        self._grad_norm = None if grad_norm is None else float(grad_norm)
        return StepResult(loss=loss, grad_norm=self._grad_norm,
                          loss_scale=self.loss_scale(), skipped=False,
                          micro_batches=len(batches), extra=extra)

    @staticmethod
    def _loss_ranks_per_replica() -> int:
        """Ranks of one data-parallel replica that report its loss (the last stage's TP ranks;
        their CP ranks each count their part of the tokens)."""
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_world_size()

    def _charge(self, timer, clock: _Clock, schedule_seconds: float) -> None:
        """Split the schedule's wall time into forward, loss, grad_sync and backward."""
        inside = dict(clock.seconds, grad_sync=self._box["grad_sync"])
        for name, seconds in inside.items():
            timer.add(name, seconds)
        timer.add("backward", max(0.0, schedule_seconds - sum(inside.values())))

    def reduce_phase_times(self, times: dict) -> dict:
        """``times`` (a PhaseTimer snapshot) with each phase of :data:`PHASES` replaced by its
        maximum over the pipeline stages (collective over the pipeline group; the loop calls it
        on every rank at log steps). Rank 0, the first stage, writes the metrics, but only the
        last stage computes the loss and each stage runs the forward of its own layers."""
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return times
        return collectives.max_phase_times(
            times, PHASES, parallel_state.get_pipeline_model_parallel_group())

    def _moe_metrics(self) -> dict:
        """{'moe/load_balancing_loss': mean over MoE layers and micro-batches} (collective)."""
        if not self.moe_layers:
            return {}
        from megatron.core.transformer.moe import moe_utils

        moe_utils.reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
        values = moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
        value = float(values.sum()) / self.moe_layers / self.grad_accum_steps
        moe_utils.clear_aux_losses_tracker()
        return {LOAD_BALANCING_METRIC: value}

    def grad_norm(self) -> Optional[float]:
        """Gradient norm of the last step (computed by the optimizer step)."""
        return self._grad_norm

    def loss_scale(self) -> float:
        """The current (dynamic) loss scale under fp16; 1.0 otherwise."""
        return float(self.optimizer.get_loss_scale())

    def label_scores(self, batches: list) -> Optional[list]:
        """See :meth:`launcher.engines.base.Engine.label_scores` (every pipeline schedule,
        forward only; launcher/engines/megatron/scoring.py)."""
        with self._evaluating():
            return score_batches(self.chunks, batches, device=self.device,
                                 vocab_size=self.vocab_size)

    @torch.no_grad()
    def next_tokens(self, tokens: torch.Tensor, ends: list) -> list:
        """See :meth:`launcher.engines.base.Engine.next_tokens` (generation.next_tokens)."""
        with self._evaluating():
            return next_tokens(self.chunks, tokens, ends, vocab_size=self.vocab_size,
                               device=self.device)

    @contextlib.contextmanager
    def _evaluating(self):
        """The model chunks in eval mode for the block, in train mode again after it."""
        for chunk in self.chunks:
            chunk.eval()
        try:
            yield
        finally:
            for chunk in self.chunks:
                chunk.train()

    data_parallel = staticmethod(data_parallel)

    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        """Mean masked loss over ``batches`` on all ranks (model in eval mode meanwhile)."""
        batches = [self._prepare(b) for b in batches]
        with self._evaluating():
            losses = self._run_schedule(batches, _Clock(), forward_only=True) if batches else []
        loss, _, _ = self._agree(losses)
        return loss
