"""Learning-rate schedules: pure functions of the optimizer config, the step and the step budget.

``step`` counts optimizer steps already taken (0 for the first update), so the lr of an update
depends on nothing but that number: resuming at step N gives exactly the lrs of an unbroken run,
and the only scheduler state a checkpoint needs is N.

Every schedule starts with ``warmup_steps`` of linear warmup reaching ``lr`` on the last warmup
step (step ``warmup_steps - 1``), so the very first update already moves the weights. Then:

- ``cosine``: cosine decay from ``lr`` to ``min_lr`` over the remaining steps;
- ``wsd``: constant ``lr``, then linear decay to ``min_lr`` over the last ``decay_fraction`` of
  all steps (the final step uses ``min_lr``);
- ``constant``: ``lr`` to the end.
"""

from __future__ import annotations

import math

from launcher.config import OptimizerConfig, Schedule


def _warmup(step: int, optimizer: OptimizerConfig) -> float:
    return optimizer.lr * (step + 1) / optimizer.warmup_steps


def _cosine(step: int, optimizer: OptimizerConfig, total_steps: int) -> float:
    span = max(1, total_steps - optimizer.warmup_steps)
    progress = min(1.0, (step - optimizer.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return optimizer.min_lr + (optimizer.lr - optimizer.min_lr) * cosine


def wsd_decay_start(optimizer: OptimizerConfig, total_steps: int) -> int:
    """First step of the wsd decay phase (never inside the warmup)."""
    decay_steps = round(optimizer.decay_fraction * total_steps)
    return max(optimizer.warmup_steps, total_steps - decay_steps)


def _wsd(step: int, optimizer: OptimizerConfig, total_steps: int) -> float:
    start = wsd_decay_start(optimizer, total_steps)
    if step < start:
        return optimizer.lr
    span = max(1, total_steps - start)
    progress = min(1.0, (step - start + 1) / span)
    return optimizer.lr + (optimizer.min_lr - optimizer.lr) * progress


def lr_at(step: int, *, optimizer: OptimizerConfig, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of a ``total_steps`` run."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < optimizer.warmup_steps:
        return _warmup(step, optimizer)
    schedule = Schedule(optimizer.schedule)
    if schedule == Schedule.cosine:
        return _cosine(step, optimizer, total_steps)
    if schedule == Schedule.wsd:
        return _wsd(step, optimizer, total_steps)
    return optimizer.lr
