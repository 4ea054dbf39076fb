"""A CPU's rates from this machine's own check, instead of the catalogue's placeholder.

The catalogue's ``cpu`` entry (:mod:`launcher.plan.hardware`) stands for any CPU, and CPUs
differ by more than the plan can afford: an AVX2 core emulates bf16 80x slower than an
AVX512-BF16 one computes it. The plan's CPU check (:mod:`launcher.plan.precision`: a 256^3
matmul in fp32 and bf16, and a streaming add, on one thread as each rank computes) has timed
this machine, so an uncalibrated plan prices a CPU rank's matmuls at the check's matmul rate in
the training precision times the fraction a training step reaches (below), and its memory-bound
kernels and optimizer at the check's streaming rate. A probe (``python -m launcher.probe``) still
replaces all of it with the step's own parts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from launcher.config import Precision, TrainwrightConfig
from launcher.plan.hardware import Device, resolve_device
from launcher.plan.precision import PrecisionChoice, PrecisionTiming, precision_choice

CPU_GEMM_EFFICIENCY = 0.5
"""Fraction of the check's 256^3 matmul rate that a CPU training step's matmuls reach (smaller
or thinner products, transposed operands in the backward pass, Megatron-Core's linear layers
around them). Fitted on one config, ``bench/plan_accuracy.py --uncalibrated``'s
``tiny fp32 megatron`` on a 2-core AVX2 AMD EPYC (2026-11-29: 0.500); its five other configs
are out of sample (docs/plan.md, "Without a probe")."""


def timed_cpu(device: Device, timing: Optional[PrecisionTiming], precision: Precision,
              peak_override: float = 0.0) -> Device:
    """``device`` with a CPU's rates from ``timing`` (module docstring); unchanged on a GPU,
    without a timing, or when ``cluster.peak_tflops`` (``peak_override`` > 0) sets the peak."""
    if device.name != "cpu" or timing is None or peak_override > 0:
        return device
    rate = timing.matmul_flops_per_s(precision) / 1e12
    if rate <= 0 or timing.stream_bytes_per_s <= 0:
        return device
    return replace(device, peak_tflops_fp32=rate, peak_tflops_bf16=rate,
                   gemm_efficiency=CPU_GEMM_EFFICIENCY, attention_efficiency=CPU_GEMM_EFFICIENCY,
                   hbm_bytes_per_s=timing.stream_bytes_per_s,
                   rates=f"this CPU's check ({timing.text()}; a streaming add moves "
                         f"{timing.stream_bytes_per_s / 1e9:.1f} GB/s; one thread)")


def plan_device(cfg: TrainwrightConfig, *, measure: bool) -> tuple[Device, PrecisionChoice]:
    """(the device the plan prices ``cfg`` on, the precision it trains in): the catalogue's
    ``cluster.gpu`` with the cluster's overrides, a CPU's with its own rates. Raises KeyError
    naming the known devices (:func:`launcher.plan.hardware.resolve_device`)."""
    c = cfg.cluster
    device = resolve_device(c.gpu, c.device_memory_gb, c.peak_tflops)
    choice = precision_choice(cfg, device, ranks=c.gpus_per_node * c.ranks_per_gpu,
                              measure=measure)
    return timed_cpu(device, choice.timing, choice.precision, c.peak_tflops), choice
