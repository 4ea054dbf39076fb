"""Timed kernels: :func:`cpu_check`, the plan's CPU check (a square matmul in fp32 and bf16, a
streaming add and one AdamW step), timed by :func:`launcher.parallel.timing.median_seconds`
(re-exported here)."""

from __future__ import annotations

import torch

from launcher.engines.common import multi_tensor_on_cpu
from launcher.parallel.timing import median_seconds

__all__ = ["adam_seconds", "adam_seconds_per_param", "cpu_check", "median_seconds",
           "precision_timing", "stream_bytes_per_s"]

STREAM_VALUES = 1 << 22
"""fp32 values of each vector the streaming add reads (16 MiB: past the caches of a core)."""
ADAM_VALUES = 1 << 24
"""Parameters of the check's AdamW step, in one tensor (64 MiB: past glibc's 32 MiB ceiling on
reusing freed blocks, so its temporaries are fresh pages, as a model's large tensors' are: on
an AVX2 EPYC thread 6.0-6.5 ns a parameter at 16M and 6.7 at 62M, against 3.3 at 4M)."""


def precision_timing(n: int, reps: int = 5, fp32_reps: int = 0) -> tuple[float, float]:
    """(fp32 seconds, bf16 seconds) of an n x n x n matmul on this CPU, on one thread (as each
    rank of a CPU run computes); the median of ``reps`` calls, ``fp32_reps`` in fp32 (0: as
    many)."""
    with _one_thread():
        out = []
        for dtype, count in ((torch.float32, fp32_reps or reps), (torch.bfloat16, reps)):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            out.append(median_seconds(lambda: a @ b, reps=count))
        return out[0], out[1]


def stream_bytes_per_s(values: int = STREAM_VALUES, reps: int = 5) -> float:
    """Bytes per second an out-of-place add of two fp32 vectors moves on one thread (two read,
    one written): the rate of the memory-bound kernels (norms, activations, optimizer) of a
    CPU rank."""
    with _one_thread():
        a, b = torch.randn(values), torch.randn(values)
        out = torch.empty(values)
        return 3 * 4 * values / median_seconds(lambda: torch.add(a, b, out=out), reps=reps)


def adam_seconds(numel: int, tensors: int, reps: int,
                 device: torch.device = torch.device("cpu")) -> float:
    """Median seconds of one AdamW step (torch's, with the options both engines step their fp32
    master weights with) over ``numel`` parameters in ``tensors`` tensors on ``device``."""
    size = max(1, numel // max(1, tensors))
    params = [torch.nn.Parameter(torch.zeros(size, device=device))
              for _ in range(max(1, tensors))]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4)
    multi_tensor_on_cpu(opt)  # as both engines step it (their set_lr)
    return median_seconds(opt.step, reps=reps, warmup=1, device=device)


def adam_seconds_per_param(values: int = ADAM_VALUES, reps: int = 3) -> float:
    """Seconds per parameter of one AdamW step as the engines run it (:func:`adam_seconds`)
    over ``values`` fp32 parameters in one tensor, on one thread."""
    with _one_thread():
        return adam_seconds(values, 1, reps=reps) / values


def cpu_check(n: int) -> tuple[float, float, float, float]:
    """(fp32 seconds, bf16 seconds of an n^3 matmul, streamed bytes per second, AdamW seconds
    per parameter), one thread. The fp32 matmul, a fraction of a millisecond at n=256, is timed
    41 times, since the plan takes its rate; bf16, up to 80x slower where it is emulated, 9
    times; the AdamW step (about 0.15 s) 3 times."""
    return (*precision_timing(n, reps=9, fp32_reps=41), stream_bytes_per_s(),
            adam_seconds_per_param())


class _one_thread:
    """Intra-op threads set to one inside the block (each rank of a CPU run computes on one)."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)
