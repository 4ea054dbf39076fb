"""Catalogue of accelerators: usable memory and dense peak throughput, for the plan's estimates."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    """Memory a training process can allocate (what torch reports as total_memory); 0 = unchecked."""
    peak_tflops_bf16: float
    """Dense (no sparsity) bf16/fp16 tensor-core peak, TFLOP/s."""
    peak_tflops_fp32: float
    """Dense fp32 peak (TF32 tensor cores where the device has them), TFLOP/s."""


# Peaks are the vendors' published dense figures; memory is the device total as CUDA reports it.
DEVICES: dict[str, Device] = {
    "H100": Device("H100", 85_520_809_984, 989.4, 494.7),   # H100 SXM5 80 GB
    "H200": Device("H200", 150_754_820_096, 989.4, 494.7),  # H200 SXM 141 GB
    "A100": Device("A100", 85_198_045_184, 312.0, 156.0),   # A100 SXM4 80 GB
    "B200": Device("B200", 191_514_411_008, 2250.0, 1100.0),  # B200 192 GB (HGX)
    "cpu": Device("cpu", 0, 0.2, 0.2),  # a few CPU cores; memory is the host's, not checked
}


def resolve_device(gpu: str, memory_gb: float = 0.0, peak_tflops: float = 0.0) -> Device:
    """The catalogue entry for ``gpu``, with the cluster's overrides (0 = keep catalogue value).

    Raises KeyError naming the known devices when ``gpu`` is not in the catalogue.
    """
    known = {name.lower(): name for name in DEVICES}  # h200, H200 and H200 alike
    if gpu.lower() not in known:
        raise KeyError(f"cluster.gpu={gpu!r} is not a known device; use one of "
                       f"{', '.join(DEVICES)} (or add it to launcher/plan/hardware.py)")
    base = DEVICES[known[gpu.lower()]]
    memory = int(memory_gb * 1e9) if memory_gb > 0 else base.memory_bytes
    bf16 = peak_tflops if peak_tflops > 0 else base.peak_tflops_bf16
    fp32 = peak_tflops if peak_tflops > 0 else base.peak_tflops_fp32
    return Device(base.name, memory, bf16, fp32)
