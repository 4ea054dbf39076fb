"""The training loop: steps, metrics, evaluation, health checks, checkpoints and stop requests.

Every rank runs :meth:`TrainLoop.run` in lockstep; the collectives it makes (loss agreement inside
the step, evaluation, straggler gathers, stop agreement, checkpoint barriers; all in
:mod:`launcher.parallel.collectives`) happen at the same step on every rank. Only the metrics
logger knows about rank 0. The engine, the checkpoint manager and the stop request are handed
in; the loop finds nothing through module globals.

Per optimizer step it records ``time/<phase>`` for the seven phases of
:data:`launcher.core.phases.PHASES` (under DeepSpeed ``backward`` is reported as
``backward+grad_sync``, see :mod:`launcher.engines.deepspeed.engine`; the Megatron engine times
them apart and reports each phase's maximum over the pipeline stages:
``Engine.reduce_phase_times``),
tokens/s, TFLOP/s per GPU and MFU (from the plan's FLOPs per token and peak), memory, loss, lr,
grad norm, loss scale and the engine's extra metrics (``StepResult.extra``).
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from launcher.config import OptimizerConfig, TrainerConfig
from launcher.core.errors import NonFiniteLoss, TrainingAborted
from launcher.core.exits import REQUEUE_EXIT
from launcher.core.phases import PhaseTimer
from launcher.core.stop import StopRequest
from launcher.engines.base import Engine, StepResult
from launcher.plan import Plan
from launcher.runtime.checkpoint import CheckpointManager
from launcher.runtime.eval_jobs import NullEvalJobs
from launcher.runtime.heartbeat import Heartbeat
from launcher.runtime.metrics import Metrics
from launcher.runtime.schedule import lr_at
from launcher.runtime.straggler import find_stragglers, gather_times

SPIKE_WINDOW = 20
"""Recent steps whose maximum loss a new loss is compared with (spike detection)."""


@dataclass
class LoopState:
    """What changes from step to step (step and consumed samples are checkpointed)."""

    step: int = 0
    consumed_samples: int = 0
    consecutive_skips: int = 0
    last_saved: int = -1
    recent_losses: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=SPIKE_WINDOW))
    window_start: float = field(default_factory=time.perf_counter)
    window_steps: int = 0
    window_data_time: float = 0.0


def memory_gb() -> float:
    """Peak GPU memory allocated (GB) on GPU; resident set size of this process on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    import psutil

    return psutil.Process().memory_info().rss / 1e9


@dataclass
class TrainLoop:
    """The objects one training run needs (built by launcher.train)."""

    engine: Engine
    plan: Plan
    trainer: TrainerConfig
    optimizer: OptimizerConfig
    next_batch: Callable[[], dict]
    eval_batches: Optional[Callable[[], Iterable[dict]]]
    """A fresh iterable of validation micro-batches per call; None: no validation data."""
    metrics: Metrics
    timer: PhaseTimer
    stop: StopRequest
    checkpoints: CheckpointManager
    saved_extras: dict
    """{"config": ..., "plan": ...}, stored with every checkpoint."""
    state: LoopState = field(default_factory=LoopState)
    heartbeat: Optional[Heartbeat] = None
    """This rank's progress for the launcher's hang watchdog (phases beat through the timer)."""
    downstream: Optional[Callable[[], dict]] = None
    """Downstream tasks (:class:`launcher.runtime.evaluation.DownstreamEval`: ``due(step,
    last)`` and a call that scores them, collective); None: no eval.tasks."""

    eval_jobs: NullEvalJobs = field(default_factory=NullEvalJobs)
    """Checkpoints scored in their own jobs (eval.asynchronous): their scores merged back every
    log interval and before the run ends (a no-op off rank 0)."""

    def run(self) -> int:
        """Train to the plan's train_steps; returns 0, or REQUEUE_EXIT after a stop request.
        The ranks agree on stopping after each step, and once before the first: a stop that
        arrived between the end of start-up and the first step runs no step."""
        self.state.window_start = time.perf_counter()  # throughput excludes start-up
        first = self.state.step
        if self.stop.agree():
            return self._stopped(since=first)
        while self.state.step < self.plan.batch.train_steps:
            self._one_step()
            if self.stop.agree():
                return self._stopped(since=first)
        self.save(background=False)
        self.eval_jobs.merge()
        return 0

    def _stopped(self, since: int) -> int:
        """The ranks agreed to stop: save the step reached (when this launch ran one) and
        return REQUEUE_EXIT."""
        step = self.state.step
        if step > since:
            self.metrics.log_event("stop", f"stop requested; saving at step {step} and exiting "
                                   f"{REQUEUE_EXIT} for requeue")
            self.save(background=False)
        else:
            self.metrics.log_event("stop", f"stop requested before the first step; nothing new "
                                   f"to save; exiting {REQUEUE_EXIT} for requeue")
        self.eval_jobs.merge()
        return REQUEUE_EXIT

    def _one_step(self) -> None:
        s = self.state
        if self.heartbeat is not None:
            self.heartbeat.step = s.step
        lr = lr_at(s.step, optimizer=self.optimizer, total_steps=self.plan.batch.train_steps)
        if self.checkpoints.pending:  # a background save: complete it once every rank wrote it
            with self.timer.phase("checkpoint"):
                self.checkpoints.poll()
        start = time.perf_counter()
        try:
            result = self.engine.train_step(self.next_batch, lr, self.timer)
        except NonFiniteLoss as exc:
            raise TrainingAborted(f"step {s.step + 1}: {exc} (trainer.nan_policy=abort); no "
                                  "checkpoint written after it") from exc
        s.step += 1
        s.consumed_samples += self.plan.batch.global_batch_size
        s.window_steps += 1
        step_time = time.perf_counter() - start
        self._check_health(result)
        events = self._spike(result)
        if self.trainer.save_interval and s.step % self.trainer.save_interval == 0:
            self.save()
        if s.step % self.trainer.log_interval == 0 or s.step == self.plan.batch.train_steps:
            self._log(result, lr, events)
            self.eval_jobs.merge()
        if self.trainer.eval_interval and s.step % self.trainer.eval_interval == 0:
            self.evaluate()
        if self.downstream is not None and \
                self.downstream.due(s.step, s.step == self.plan.batch.train_steps):
            self.score_tasks()
        if self.trainer.straggler_interval and s.step % self.trainer.straggler_interval == 0:
            self._stragglers(step_time)

    def _check_health(self, result: StepResult) -> None:
        s, policy = self.state, self.trainer.nan_policy
        bad = result.skipped or (result.grad_norm is not None
                                 and not math.isfinite(result.grad_norm))
        if not bad:
            s.consecutive_skips = 0
            return
        if policy != "skip":
            raise TrainingAborted(f"step {s.step}: non-finite gradient norm {result.grad_norm} "
                                  "(trainer.nan_policy=abort); no checkpoint written after it")
        s.consecutive_skips += 1
        self.metrics.log_event("nan_skip", f"step {s.step}: non-finite loss or gradient, update "
                               f"skipped ({s.consecutive_skips} in a row)", step=s.step)
        if s.consecutive_skips >= self.trainer.max_consecutive_skips:
            raise TrainingAborted(f"step {s.step}: {s.consecutive_skips} consecutive non-finite "
                                  "steps (trainer.max_consecutive_skips); aborting")

    def _spike(self, result: StepResult) -> dict:
        """{'loss_spike': 1.0} when the loss exceeds spike_factor x the recent maximum."""
        s, factor = self.state, self.trainer.spike_factor
        if not math.isfinite(result.loss):
            return {}
        spike = bool(factor and s.recent_losses and result.loss > factor * max(s.recent_losses))
        s.recent_losses.append(result.loss)
        if spike:
            self.metrics.log_event("loss_spike", f"step {s.step}: loss {result.loss:.4f} > "
                                   f"{factor} x recent max", step=s.step, loss=result.loss)
        return {"loss_spike": 1.0 if spike else 0.0}

    def _log(self, result: StepResult, lr: float, extra: dict) -> None:
        s, plan = self.state, self.plan
        elapsed = time.perf_counter() - s.window_start
        times = self.timer.snapshot()
        s.window_data_time = times.get("data", 0.0)  # this rank's own (straggler check)
        times = self.engine.reduce_phase_times(times)  # collective (e.g. max over stages)
        steps = max(1, s.window_steps)
        tokens_per_s = plan.batch.global_batch_tokens * steps / elapsed if elapsed > 0 else 0.0
        gpus = plan.dims.world / plan.machines.ranks_per_gpu  # ranks sharing a GPU share its FLOP/s
        tflops = plan.compute.flops_per_token * tokens_per_s / gpus / 1e12
        causal = plan.compute.flops_per_token_causal * tokens_per_s / gpus / 1e12
        metrics = {
            "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
            "loss_scale": result.loss_scale, "tokens_per_s": tokens_per_s,
            "tflops_per_gpu": tflops, "mfu": tflops / plan.machines.peak_tflops_per_gpu,
            "tflops_per_gpu_causal": causal,
            "mfu_causal": causal / plan.machines.peak_tflops_per_gpu,
            "consumed_samples": s.consumed_samples, "step_time": elapsed / steps,
            "memory_gb": memory_gb(), "skipped": float(result.skipped), **result.extra, **extra,
            **{f"time/{name}": seconds / steps for name, seconds in times.items()},
        }
        self.metrics.log(s.step, {k: v for k, v in metrics.items() if v is not None})
        s.window_start, s.window_steps = time.perf_counter(), 0

    def evaluate(self) -> None:
        if self.eval_batches is None:
            return
        with self.timer.phase("eval"):  # time/eval in the next step line; a heartbeat phase
            loss = self.engine.eval_loss(self.eval_batches())
        ppl = math.exp(min(loss, 80.0))
        self.metrics.log(self.state.step, {"eval/loss": loss, "eval/perplexity": ppl})

    def score_tasks(self) -> None:
        """The downstream tasks on the model as it is, logged with the tokens trained so far."""
        with self.timer.phase("eval"):
            scores = self.downstream()
        tokens = self.state.consumed_samples * self.plan.batch.seq_length
        self.metrics.log(self.state.step, {**scores, "eval/tokens": tokens})

    def _stragglers(self, step_time: float) -> None:
        step_times, data_times = gather_times(step_time, self.state.window_data_time)
        if self.heartbeat is not None:
            self.heartbeat.agree(step_times)
        for slow in find_stragglers(step_times, data_times, self.trainer.straggler_threshold):
            self.metrics.log_event("straggler", f"rank {slow['rank']} is slow: "
                                   f"{', '.join(slow['slow'])}", step=self.state.step, **slow)

    def save(self, background: bool = True) -> None:
        """Save a checkpoint of the current step (once per step), timed as phase checkpoint;
        ``background`` allows an async write (trainer.async_save) unless this is the last step.

        First waits for a background save still being written and completes it, also when this
        step is already saved: a stop request right after an async periodic save must not exit
        before that checkpoint gets ``complete`` and ``latest``."""
        s = self.state
        if s.last_saved == s.step and not self.checkpoints.pending:
            return
        with self.timer.phase("checkpoint"):
            self.checkpoints.wait()
            if s.last_saved != s.step:
                self.checkpoints.save(s.step, consumed_samples=s.consumed_samples,
                                      background=background, **self.saved_extras)
        s.last_saved = s.step
