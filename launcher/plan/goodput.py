"""What interruptions will cost a run, and the save interval that costs least.

Model (first order, Young 1974 / Daly 2006). A job whose mean time between interruptions is
``M`` seconds saves every ``tau`` seconds of training, each save stalling the job ``delta``
seconds; each interruption throws away on average half an interval of work plus the restart
(start-up and checkpoint load, ``R``). The share of wall time that trains is then

    goodput(tau) = tau / (tau + delta) x (1 - (R + (tau + delta) / 2) / M)

whose best interval is about ``sqrt(2 x delta x M)``. Intervals are reported in optimizer steps.

The planned save time assumes every node writes its share of the checkpoint (weights and
optimizer state, one copy across the data-parallel replicas) in parallel at
``cluster.checkpoint_gbps_per_node``; loading reads it back at the same rate. An asynchronous
save (``trainer.async_save``) stalls the loop only for the copy of the GPU's shard to host
memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STARTUP_S = 60.0
"""Seconds a restart spends before the checkpoint load: process start, imports, rendezvous,
building the model (an assumption of the model; the run's own figure is in its report)."""
HOST_COPY_GBPS = 25.0
"""GPU-to-host copy rate of an asynchronous save's stall (PCIe Gen5 in practice), GB/s."""


@dataclass(frozen=True)
class GoodputPlan:
    """The plan's ``goodput`` entry (plan.json)."""

    mtbf_hours: float
    """Mean time between interruptions of the whole job (cluster.mtbf_hours / nodes)."""
    save_s: float
    """Planned time to write one checkpoint."""
    stall_s: float
    """Of it, the seconds the training loop waits (all of it unless trainer.async_save)."""
    load_s: float
    """Planned time to read the checkpoint back (part of every restart)."""
    restart_s: float
    """Planned cost of one restart: STARTUP_S + load_s."""
    checkpoint_bytes: int
    """Bytes of one checkpoint (weights and optimizer state)."""
    save_interval: int
    """The configured trainer.save_interval (steps; the whole run when it is 0)."""
    expected: float
    """Expected goodput with the configured interval (0-1)."""
    best_save_interval: int
    """The interval (steps) that maximises the expected goodput."""
    expected_at_best: float
    """Expected goodput at best_save_interval."""

    def to_dict(self) -> dict:
        return {"mtbf_hours": self.mtbf_hours, "save_s": self.save_s, "stall_s": self.stall_s,
                "load_s": self.load_s, "restart_s": self.restart_s,
                "checkpoint_bytes": self.checkpoint_bytes, "save_interval": self.save_interval,
                "expected": self.expected, "best_save_interval": self.best_save_interval,
                "expected_at_best": self.expected_at_best}


def expected_goodput(interval_s: float, stall_s: float, restart_s: float, mtbf_s: float) -> float:
    """The share of wall time that trains (module docstring), clamped to [0, 1]."""
    period = interval_s + stall_s
    value = interval_s / period * (1.0 - (restart_s + period / 2.0) / mtbf_s)
    return min(1.0, max(0.0, value))


def plan_goodput(*, checkpoint_bytes: int, bytes_per_gpu: int, nodes: int,
                 gbps_per_node: float, node_mtbf_hours: float, async_save: bool,
                 step_time_s: float, save_interval: int, train_steps: int) -> GoodputPlan:
    """The expected goodput of a configured save interval, and the best interval."""
    save_s = checkpoint_bytes / nodes / (gbps_per_node * 1e9)
    stall_s = min(save_s, bytes_per_gpu / (HOST_COPY_GBPS * 1e9)) if async_save else save_s
    restart_s = STARTUP_S + save_s
    mtbf_s = node_mtbf_hours * 3600.0 / nodes
    interval = save_interval or train_steps

    def at(steps: int) -> float:
        return expected_goodput(steps * step_time_s, stall_s, restart_s, mtbf_s)

    best = max(1, round(math.sqrt(2.0 * stall_s * mtbf_s) / step_time_s))
    best = min((best, best + 1, max(1, best - 1)), key=lambda k: -at(k))
    return GoodputPlan(mtbf_hours=mtbf_s / 3600.0, save_s=save_s, stall_s=stall_s,
                       load_s=save_s, restart_s=restart_s, checkpoint_bytes=checkpoint_bytes,
                       save_interval=save_interval, expected=at(interval),
                       best_save_interval=best, expected_at_best=at(best))
