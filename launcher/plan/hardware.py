"""Catalogue of accelerators: memory, peak throughput, achievable rates and links.

The plan's memory check reads ``memory_bytes``; the step-time model
(:mod:`launcher.plan.step_time`) reads the rest. Every constant names its source. Link figures
are per GPU and per direction; "achievable" means what NCCL / cuBLAS / flash attention reach in
practice, a fraction of the datasheet figure that is stated next to it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    """Memory a training process can allocate (what torch reports as total_memory); 0 = unchecked."""
    peak_tflops_bf16: float
    """Dense (no sparsity) bf16/fp16 tensor-core peak, TFLOP/s."""
    peak_tflops_fp32: float
    """Dense fp32 peak (TF32 tensor cores where the device has them), TFLOP/s."""
    gemm_efficiency: float = 0.55
    """Fraction of the dense peak that a training step's matrix multiplications reach."""
    attention_efficiency: float = 0.45
    """Fraction of the dense peak that fused (flash) attention reaches, on the FLOPs it really
    does (causal: half the score matrix)."""
    hbm_bytes_per_s: float = 0.0
    """Achievable device-memory bandwidth (bytes/s) of memory-bound kernels (norms,
    activations, loss, optimizer)."""
    intra_node_bytes_per_s: float = 0.0
    """Achievable NCCL bus bandwidth per GPU inside a node (NVLink), bytes/s per direction."""
    inter_node_bytes_per_s: float = 0.0
    """Achievable NCCL bus bandwidth per GPU between nodes (one InfiniBand NIC per GPU)."""
    link_latency_s: float = 0.0
    """Fixed cost of one collective or point-to-point transfer (launch + latency), seconds."""
    peak_tflops_fp8: float = 0.0
    """Dense FP8 tensor-core peak, TFLOP/s; 0 = no FP8 tensor cores (trainer.precision=fp8 is
    refused)."""
    mxfp8: bool = False
    """The tensor cores scale FP8 blocks of 32 values in hardware (Blackwell), which
    trainer.fp8.recipe=mxfp8 needs."""
    optimizer_seconds_per_param: float = 0.0
    """Seconds of one AdamW step per parameter, measured on this machine (a CPU's check,
    launcher/plan/cpu_rates.py); 0 = priced from ``hbm_bytes_per_s`` at
    launcher/plan/step_time.OPTIMIZER_BYTES_PER_PARAM."""
    rates: str = ""
    """Where the rates were measured when not taken from this catalogue (a CPU's own check,
    launcher/plan/cpu_rates.py); "" = the catalogue's figures."""


GB = 1e9

# Achievable fractions, the same for every GPU generation here:
GEMM_EFFICIENCY = 0.62
"""Calibrated on the Llama 3.2 1B measurement of docs/gpu.md (H100, engine=megatron, TE,
fused SwiGLU: 0.659 s per 8 x 4096 tokens, 45.3% MFU) once attention, memory-bound kernels and
the optimizer are counted separately (docs/plan.md, "Step time"); the Llama 3 405B published
throughput (tests/test_search_published.py) checks it at the other end of the size range."""
ATTENTION_EFFICIENCY = 0.45
"""cuDNN / flash attention on H100, head dim 128, causal, forward + backward: about 450
TFLOP/s of 989 (Shah et al. 2024, FlashAttention-3, Fig. 6-7: FA2 ~350, cuDNN and FA3
450-650 at 4-16K)."""
HBM_FRACTION = 0.9
"""Memory-bound kernels reach about 90% of the datasheet HBM bandwidth (STREAM-like copies
on H100 reach 3.0 of 3.35 TB/s)."""
NVLINK_FRACTION = 0.8
"""NCCL all-gather / reduce-scatter bus bandwidth on 8 NVLink-4 GPUs: about 360 of 450 GB/s
per direction (nccl-tests on DGX H100)."""
IB_FRACTION = 0.8
"""NCCL bus bandwidth between nodes: about 40 of the 50 GB/s of a 400 Gb/s NIC per GPU
(nccl-tests all_reduce_perf across DGX H100 nodes)."""
LATENCY_S = 20e-6
"""NCCL latency of one collective of a ring over NVLink / InfiniBand, ~10-30 us."""


def _gpu(name: str, memory: int, bf16: float, fp32: float, hbm_tb_s: float,
         nvlink_gb_s: float, nic_gb_s: float, fp8: float = 0.0, mxfp8: bool = False) -> Device:
    """A GPU from datasheet figures (HBM TB/s, NVLink GB/s per direction, NIC GB/s per GPU,
    dense FP8 TFLOP/s or 0)."""
    return Device(name, memory, bf16, fp32, GEMM_EFFICIENCY, ATTENTION_EFFICIENCY,
                  hbm_tb_s * 1e12 * HBM_FRACTION, nvlink_gb_s * GB * NVLINK_FRACTION,
                  nic_gb_s * GB * IB_FRACTION, LATENCY_S, fp8, mxfp8)


# Peaks are the vendors' published dense figures (FP8: half the datasheets' "with sparsity"
# figure); memory is the device total as CUDA reports it.
DEVICES: dict[str, Device] = {
    # H100 SXM5 80 GB: 3.35 TB/s HBM3; NVLink 4, 900 GB/s bidirectional = 450 per direction;
    # DGX H100: eight ConnectX-7 400 Gb/s (50 GB/s) NICs, one per GPU (NVIDIA datasheets).
    # FP8: 3,958 TFLOP/s with sparsity = 1,979 dense (H100 SXM datasheet).
    "H100": _gpu("H100", 85_520_809_984, 989.4, 494.7, 3.35, 450, 50, fp8=1978.9),
    # H200 SXM 141 GB: 4.8 TB/s HBM3e; NVLink 4 and ConnectX-7 as H100 (HGX H200 datasheet).
    "H200": _gpu("H200", 150_754_820_096, 989.4, 494.7, 4.8, 450, 50, fp8=1978.9),
    # A100 SXM4 80 GB: 2.039 TB/s HBM2e; NVLink 3, 600 GB/s bidirectional = 300 per direction;
    # DGX A100: eight ConnectX-6 200 Gb/s (25 GB/s) NICs. Ampere has no FP8 tensor cores.
    "A100": _gpu("A100", 85_198_045_184, 312.0, 156.0, 2.039, 300, 25),
    # B200 192 GB (HGX): 8 TB/s HBM3e; NVLink 5, 1.8 TB/s bidirectional = 900 per direction;
    # DGX B200: eight ConnectX-7 400 Gb/s NICs. FP8/FP6: 9 PFLOP/s sparse = 4.5 dense (HGX B200);
    # fifth-generation tensor cores scale MXFP8 blocks in hardware.
    "B200": _gpu("B200", 191_514_411_008, 2250.0, 1100.0, 8.0, 900, 50, fp8=4500.0, mxfp8=True),
    # A few CPU cores (development). The peaks and the DRAM rate are placeholders that the
    # plan's CPU check replaces with this machine's (launcher/plan/cpu_rates.py). The links are
    # gloo over loopback between 2 ranks of one thread each, as the probe measured them on a
    # 2-core AMD EPYC (2026-11-29): 10 MB all-reduce 14 ms (0.72 GB/s of bus bandwidth),
    # reduce-scatter 20 ms (0.25 GB/s), all-gather 33 ms (0.15 GB/s); an 8-byte all-reduce
    # 0.55 ms, all-gather 1.2 ms. ZeRO and sequence parallelism move their bytes by the last two.
    "cpu": Device("cpu", 0, 0.2, 0.2, 0.5, 0.5, 20 * GB, 0.25 * GB, 0.25 * GB, 0.5e-3),
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
    return replace(base, memory_bytes=memory, peak_tflops_bf16=bf16, peak_tflops_fp32=fp32)
