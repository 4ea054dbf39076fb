"""The batch of one run: micro-batch, accumulation, global batch and the step budget."""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.config import TrainerConfig


@dataclass(frozen=True)
class Batch:
    """How many sequences each step reads, and how many steps the run takes (build with
    :meth:`of` once the plan's batch checks have passed)."""

    micro_batch_size: int
    """Sequences per micro-batch on each data-parallel replica."""
    seq_length: int
    """Tokens per sequence."""
    data_parallel_size: int
    """Replicas that each read their own micro-batches."""
    grad_accum_steps: int
    """Micro-batches per optimizer step on each replica."""
    global_batch_size: int
    """Sequences per optimizer step over all replicas."""
    train_steps: int
    """Optimizer steps of the run."""
    train_tokens: int
    """Tokens of the run (train_steps x global batch tokens unless the budget was in tokens)."""

    @classmethod
    def of(cls, trainer: TrainerConfig, seq_length: int, data_parallel_size: int) -> "Batch":
        """The batch of ``trainer`` at ``seq_length`` over ``data_parallel_size`` replicas; the
        sentinels resolved (global batch 0 = one micro-batch per replica, one of train_steps
        and train_tokens derived from the other)."""
        t, dp = trainer, data_parallel_size
        global_batch = t.global_batch_size or t.micro_batch_size * dp
        step_tokens = global_batch * seq_length
        steps = t.train_steps or math.ceil(t.train_tokens / step_tokens)
        return cls(micro_batch_size=t.micro_batch_size, seq_length=seq_length,
                   data_parallel_size=dp,
                   grad_accum_steps=global_batch // (t.micro_batch_size * dp),
                   global_batch_size=global_batch, train_steps=steps,
                   train_tokens=t.train_tokens or steps * step_tokens)

    @property
    def micro_batch_tokens(self) -> int:
        return self.micro_batch_size * self.seq_length

    @property
    def global_batch_tokens(self) -> int:
        return self.global_batch_size * self.seq_length
