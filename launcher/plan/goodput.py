"""What interruptions will cost a run, and the save interval that costs least.

Model (first order, Young 1974 / Daly 2006). A job whose mean time between interruptions is
``M`` seconds saves every ``tau`` seconds of training, each save stalling the job ``delta``
seconds; each interruption throws away on average half an interval of work plus the restart
(start-up and checkpoint load, ``R``). The share of wall time that trains is then

    goodput(tau) = tau / (tau + delta) x (1 - (R + (tau + delta) / 2) / M)

whose best interval is about ``sqrt(2 x delta x M)``. Intervals are reported in optimizer steps.

Every launch also pays its start-up ``S`` (launch to the first step: imports, process groups,
the build, the data, the load, the first step's warm-up) and its tear-down ``E`` (the last step
to exit: the final save and the processes' exit), and the run pays its evaluations ``V``; none
of them trains. For ``T`` seconds of training the expected goodput of the run is

    goodput = T / (T / goodput(tau) + S + E + V)

which is the formula above for a run of weeks and what a short run (a demo, a CPU test) really
gets. ``S`` and ``E`` are the machine profile's when a run measured them (``launcher.probe
--from-run``), else the assumptions :data:`STARTUP_S` / :data:`CPU_STARTUP_S` and
:data:`EXIT_S`; :attr:`GoodputPlan.launch_source` says which.

The planned save time assumes every node writes its share of the checkpoint (weights and
optimizer state, one copy across the data-parallel replicas) in parallel at
``cluster.checkpoint_gbps_per_node``; loading reads it back at the same rate. An asynchronous
save (``trainer.async_save``) stalls the loop only for the copy of the GPU's shard to host
memory.

With an object store (``trainer.checkpoint_uri=s3://...``) a save is first written to local disk
(as above: the stall), then every node uploads its share at ``cluster.store_gbps_per_node`` in
the background; the step is durable (committed) only after both, so ``save_s`` is their sum and
the run's last save waits for all of it. A restart downloads the whole checkpoint on every node
at that rate (each node reads what any of its ranks may need), then reads its share from local
disk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STARTUP_S = 60.0
"""Seconds a restart spends before the checkpoint load: process start, imports, rendezvous,
building the model (an assumption of the model; the run's own figure is in its report)."""
CPU_STARTUP_S = 6.0
"""The same on a CPU machine (no CUDA context, no NCCL; the tiny models of development): 4.5-5
s measured for 2 ranks on a 2-core machine (bench/startup.py, docs/training.md), rounded up; a
run's measured start-up replaces it (launcher.probe --from-run)."""
EXIT_S = 1.0
"""Seconds from the final save to the processes' exit (process groups, data-loader workers,
the run's summary and report): 0.5-0.9 s measured on CPU; an assumption unless a run measured
it."""
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
    startup_s: float = 0.0
    """Planned launch to first step of one launch."""
    shutdown_s: float = 0.0
    """Planned last step to exit of one launch: the final save's stall and the exit."""
    eval_s: float = 0.0
    """Planned seconds of all the run's evaluations."""
    launch_source: str = "assumed"
    """Where startup_s and shutdown_s come from: "measured: <profile>" or "assumed"."""
    upload_s: float = 0.0
    """Of save_s, the upload to the object store (0: checkpoints on a file system)."""

    def to_dict(self) -> dict:
        return {"mtbf_hours": self.mtbf_hours, "save_s": self.save_s, "stall_s": self.stall_s,
                "load_s": self.load_s, "restart_s": self.restart_s,
                "checkpoint_bytes": self.checkpoint_bytes, "save_interval": self.save_interval,
                "expected": self.expected, "best_save_interval": self.best_save_interval,
                "expected_at_best": self.expected_at_best, "startup_s": self.startup_s,
                "shutdown_s": self.shutdown_s, "eval_s": self.eval_s,
                "launch_source": self.launch_source, "upload_s": self.upload_s}


def expected_goodput(interval_s: float, stall_s: float, restart_s: float, mtbf_s: float) -> float:
    """The share of wall time that trains (module docstring), clamped to [0, 1]."""
    period = interval_s + stall_s
    value = interval_s / period * (1.0 - (restart_s + period / 2.0) / mtbf_s)
    return min(1.0, max(0.0, value))


def run_goodput(interval_goodput: float, train_s: float, fixed_s: float) -> float:
    """The run's expected goodput: ``train_s`` seconds of training at ``interval_goodput``
    (:func:`expected_goodput`) plus ``fixed_s`` seconds that never train (start-up, tear-down,
    evaluations)."""
    if interval_goodput <= 0 or train_s <= 0:
        return 0.0
    return train_s / (train_s / interval_goodput + fixed_s)


@dataclass(frozen=True)
class LaunchCost:
    """What one launch costs besides its steps (seconds), and where the figures come from."""

    startup_s: float
    exit_s: float
    source: str = "assumed"


def plan_goodput(*, checkpoint_bytes: int, bytes_per_gpu: int, nodes: int,
                 gbps_per_node: float, node_mtbf_hours: float, async_save: bool,
                 step_time_s: float, save_interval: int, train_steps: int,
                 launch: LaunchCost = LaunchCost(STARTUP_S, EXIT_S),
                 eval_s: float = 0.0, store_gbps_per_node: float = 0.0) -> GoodputPlan:
    """The expected goodput of a configured save interval, and the best interval; ``launch``:
    one launch's start-up and exit, ``eval_s``: the run's evaluations in all;
    ``store_gbps_per_node``: an object store's rate per node (0: none)."""
    local_s = checkpoint_bytes / nodes / (gbps_per_node * 1e9)
    stall_s = min(local_s, bytes_per_gpu / (HOST_COPY_GBPS * 1e9)) if async_save else local_s
    upload_s = checkpoint_bytes / nodes / (store_gbps_per_node * 1e9) \
        if store_gbps_per_node > 0 else 0.0
    download_s = checkpoint_bytes / (store_gbps_per_node * 1e9) if store_gbps_per_node > 0 \
        else 0.0
    save_s, load_s = local_s + upload_s, local_s + download_s
    restart_s = launch.startup_s + load_s
    mtbf_s = node_mtbf_hours * 3600.0 / nodes
    interval = save_interval or train_steps
    train_s = train_steps * step_time_s
    shutdown_s = save_s + launch.exit_s  # the final save always waits
    fixed_s = launch.startup_s + launch.exit_s + eval_s  # the final save ends the last interval

    def at(steps: int) -> float:
        return run_goodput(expected_goodput(steps * step_time_s, stall_s, restart_s, mtbf_s),
                           train_s, fixed_s)

    best = max(1, round(math.sqrt(2.0 * stall_s * mtbf_s) / step_time_s))
    best = min((best, best + 1, max(1, best - 1)), key=lambda k: -at(k))
    return GoodputPlan(mtbf_hours=mtbf_s / 3600.0, save_s=save_s, stall_s=stall_s,
                       load_s=load_s, restart_s=restart_s, checkpoint_bytes=checkpoint_bytes,
                       save_interval=save_interval, expected=at(interval),
                       best_save_interval=best, expected_at_best=at(best),
                       startup_s=launch.startup_s, shutdown_s=shutdown_s, eval_s=eval_s,
                       launch_source=launch.source, upload_s=upload_s)
