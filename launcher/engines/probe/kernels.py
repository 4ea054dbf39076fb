"""Timed kernels: :func:`median_seconds` of any callable, :func:`precision_timing` of a square
matmul in fp32 and bf16."""

from __future__ import annotations

import time
from typing import Callable

import torch

WARMUP = 2
"""Calls dropped before timing (allocation, first-call dispatch, AMX tile set-up)."""


def median_seconds(fn: Callable[[], object], reps: int = 5, warmup: int = WARMUP,
                   sync: Callable[[], None] | None = None) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` calls after ``warmup`` (``sync`` waits for
    a device's queued work before each clock read)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if sync:
            sync()
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def precision_timing(n: int, reps: int = 5) -> tuple[float, float]:
    """(fp32 seconds, bf16 seconds) of an n x n x n matmul on this CPU, on one thread (as each
    rank of a CPU run computes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = []
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            out.append(median_seconds(lambda: a @ b, reps=reps))
        return out[0], out[1]
    finally:
        torch.set_num_threads(threads)
