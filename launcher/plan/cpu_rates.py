"""A CPU's rates from this machine's own check, instead of the catalogue's placeholder.

The catalogue's ``cpu`` entry (:mod:`launcher.plan.hardware`) stands for any CPU, and CPUs
differ by more than the plan can afford: an AVX2 core emulates bf16 80x slower than an
AVX512-BF16 one computes it. The plan's CPU check (:mod:`launcher.plan.precision`: a 256^3
matmul in fp32 and bf16, a streaming add and one AdamW step, on one thread as each rank
computes) has timed this machine, so an uncalibrated plan prices a CPU rank's matmuls at the
check's matmul rate in the training precision times the fraction a training step reaches
(below), its memory-bound kernels at the check's streaming rate, and its optimizer at the
check's AdamW step. That step is the engines' own (torch's multi-tensor AdamW); its temporaries
the size of the parameters make it about twice the 64 bytes a parameter of a fused GPU Adam
(gpt2_124m's 62M-parameter ZeRO-2 shard: 0.51 s alone on an AVX2 EPYC thread, where the
streaming rate at 64 bytes would say 0.28 s). A probe (``python -m launcher.probe``) still
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
    adam = timing.adam_seconds_per_param
    return replace(device, peak_tflops_fp32=rate, peak_tflops_bf16=rate,
                   gemm_efficiency=CPU_GEMM_EFFICIENCY, attention_efficiency=CPU_GEMM_EFFICIENCY,
                   hbm_bytes_per_s=timing.stream_bytes_per_s, optimizer_seconds_per_param=adam,
                   rates=f"this CPU's check ({timing.text()}; a streaming add moves "
                         f"{timing.stream_bytes_per_s / 1e9:.1f} GB/s"
                         + (f"; AdamW steps {adam * 1e9:.1f} ns a parameter" if adam > 0 else "")
                         + "; one thread)")


def plan_device(cfg: TrainwrightConfig, *, measure: bool) -> tuple[Device, PrecisionChoice]:
    """(the device the plan prices ``cfg`` on, the precision it trains in): the catalogue's
    ``cluster.gpu`` with the cluster's overrides, a CPU's with its own rates. Raises KeyError
    naming the known devices (:func:`launcher.plan.hardware.resolve_device`)."""
    c = cfg.cluster
    device = resolve_device(c.gpu, c.device_memory_gb, c.peak_tflops)
    choice = precision_choice(cfg, device, ranks=c.gpus_per_node * c.ranks_per_gpu,
                              measure=measure)
    return timed_cpu(device, choice.timing, choice.precision, c.peak_tflops), choice
