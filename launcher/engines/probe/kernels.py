"""Timed kernels: :func:`precision_timing` of a square matmul in fp32 and bf16 (timed by
:func:`launcher.parallel.timing.median_seconds`, re-exported here)."""

from __future__ import annotations

import torch

from launcher.parallel.timing import median_seconds

__all__ = ["median_seconds", "precision_timing"]


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
