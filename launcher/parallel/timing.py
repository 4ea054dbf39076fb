"""The one clock of every probe figure: :func:`median_seconds`.

A GPU call returns when its kernel is queued, and an NCCL collective when it is enqueued on its
stream, so a clock read after either times the launch, not the work. Every figure the probe
stores (passes, AdamW, matmuls, collectives, engine steps) is timed here: the device's queue is
drained before the clock starts and again before it stops, and ``before`` (a barrier) lines the
ranks up first, so that all of them run at once, as in training.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing for the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], *, reps: int = 5, warmup: int = 2,
                   device: Optional[torch.device] = None,
                   before: Optional[Callable[[], None]] = None) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones, each
    timed to its completion on ``device`` (the host: None); ``before`` runs ahead of every call
    (the ranks' barrier), outside the clock."""
    device = device or torch.device("cpu")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, reps)):
        if before is not None:
            before()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]
