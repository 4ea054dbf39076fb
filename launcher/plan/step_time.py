"""Step time of one layout: compute, communication, pipeline bubble and optimizer, per GPU.

The slowest pipeline stage sets the pace. Per micro-batch and transformer layer it spends:

* compute: matrix multiplications (forward + 2x backward, + 1 forward with full recompute) at
  ``Device.gemm_efficiency`` of the peak; fused attention on the FLOPs it really does (causal:
  half the scores; backward 2.5x forward, FlashAttention-2's 5 vs 2 matmuls) at
  ``attention_efficiency``; memory-bound kernels (norms, residuals, SwiGLU, RoPE, fp32
  gradient accumulation) at ``hbm_bytes_per_s``;
* tensor parallel: 4 all-gathers + reduce-scatters per pass (sequence parallel) or 2
  all-reduces (same bytes) of the micro-batch's activations, not overlapped (Megatron-Core's
  ``tp_comm_overlap`` is off), over NVLink, or InfiniBand when the TP group spans nodes;
* context parallel: the ring exchange of K and V (and their gradients), hidden behind the
  attention it overlaps with, only the excess counted;
* expert parallel: 2 all-to-alls (dispatch, combine) per pass, not overlapped.

The last stage adds the output layer and the loss (fp32 softmax over the vocabulary), the first
the embedding. A step is ``(m + (PP - 1) / VPP) x`` the slowest stage's micro-batch time (m
micro-batches, the pipeline bubble being the second term), plus pipeline transfers (every one
under 1F1B, the fill and drain under the interleaved schedule), the data-parallel gradient
reduce-scatter / all-reduce and parameter all-gather beyond what hides behind the backward /
forward of a micro-batch, and the optimizer step (memory-bound, or on the CPU when offloaded).
Constants and sources: :mod:`launcher.plan.hardware` and below; docs/plan.md explains the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from launcher.plan.hardware import Device
from launcher.plan.layer_cost import (Workload, attention_seconds, layer_compute, layer_cp_seconds,
                                      layer_ep_seconds, layer_tp_seconds, output_compute)
from launcher.shape.dims import ParallelDims

OPTIMIZER_BYTES_PER_PARAM = 64
"""HBM traffic of one fused Adam step per parameter (fp32 master, moments, gradient, bf16 copy,
gradient-norm pass), calibrated: docs/gpu.md measures 26 ms for Llama 3.2 1B's 1.24 B
parameters on an H100 (TE FusedAdam): 1.24e9 x 64 B / 3.0 TB/s = 26 ms."""
DEEPSPEED_COMPUTE_FACTOR = 0.803 / 0.659
"""engine=deepspeed is slower per step on the same model: 0.803 vs 0.659 s for Llama 3.2 1B on
an H100 (docs/gpu.md: per-parameter fp32 gradient copies from backward hooks)."""
CPU_ADAM_PARAMS_PER_S = 1.0e9
"""Parameters per second one GPU's share of host cores updates with DeepSpeed's CPU-Adam
(assumed; offloaded optimizers are rarely competitive and the search reports them last)."""
PCIE_BYTES_PER_S = 25e9
"""Host <-> GPU copies of offloaded gradients and parameters: about half of PCIe Gen5 x16."""


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the slowest pipeline stage, by cause."""

    compute: float
    """Forward, backward and recompute of every micro-batch (memory-bound kernels included)."""
    tensor_parallel: float
    context_parallel: float
    expert_parallel: float
    pipeline_bubble: float
    pipeline_p2p: float
    data_parallel: float
    """Gradient reduce and parameter gather not hidden behind backward / forward."""
    optimizer: float
    compute_only_mfu: float = 0.0
    """Model FLOPs over the compute time alone (what the GPU reaches while computing)."""
    framework: float = 0.0
    """The engine's fixed cost per step beyond the parts above (measured by the machine probe;
    0 in the catalogue model)."""
    measured: bool = False
    """Composed from a machine profile's measured parts (launcher/plan/calibrated.py), not
    the catalogue's rates."""

    @property
    def total(self) -> float:
        return (self.compute + self.tensor_parallel + self.context_parallel
                + self.expert_parallel + self.pipeline_bubble + self.pipeline_p2p
                + self.data_parallel + self.optimizer + self.framework)

    def parts(self) -> dict:
        """{cause: seconds} in a fixed order."""
        return {k: getattr(self, k) for k in PARTS}

    @property
    def dominant(self) -> str:
        """The largest cost other than compute (compute when nothing else matters)."""
        others = {k: v for k, v in self.parts().items() if k != "compute"}
        name = max(others, key=others.get)
        return name if others[name] > 0.05 * self.total else "compute"


PARTS = ("compute", "tensor_parallel", "context_parallel", "expert_parallel", "pipeline_bubble",
         "pipeline_p2p", "data_parallel", "optimizer", "framework")
"""The causes of :class:`StepTime`, in report order."""


@dataclass(frozen=True)
class Links:
    """Seconds per byte (0 = free: ranks on one GPU) and latency of each group's link."""

    tp: float
    cp: float
    ep: float
    pp: float
    dp: float
    expert_dp: float
    latency: float


def _per_byte(span: int, gpus_per_node: int, ranks_per_gpu: int, dev: Device) -> float:
    """Seconds per byte of a group covering ``span`` consecutive ranks."""
    if span <= ranks_per_gpu:
        return 0.0
    if span <= gpus_per_node * ranks_per_gpu:
        return 1.0 / dev.intra_node_bytes_per_s
    return 1.0 / dev.inter_node_bytes_per_s


def group_links(dims: ParallelDims, gpus_per_node: int, ranks_per_gpu: int,
                dev: Device) -> Links:
    """Links of every group in Megatron-Core's rank order (TP fastest, then CP, DP, PP; experts
    TP, EP, expert-DP): a group inside a node uses NVLink, one spanning nodes InfiniBand."""
    g, r = gpus_per_node, ranks_per_gpu
    tp, cp, ep, dp = dims.tp, dims.cp, dims.ep, dims.dp
    pp_span = tp * cp * dp * 2 if dims.pp > 1 else 1  # a stage and the next one
    return Links(
        tp=_per_byte(tp, g, r, dev), cp=_per_byte(tp * cp, g, r, dev),
        ep=_per_byte(tp * ep, g, r, dev), pp=_per_byte(pp_span, g, r, dev),
        dp=_per_byte(tp * cp * dp, g, r, dev), expert_dp=_per_byte(dims.world // dims.pp, g, r, dev),
        latency=dev.link_latency_s)


@dataclass(frozen=True)
class StageCost:
    """Seconds of one micro-batch on one pipeline stage."""

    compute: float
    forward: float
    """Of compute, the forward pass (the window that hides a parameter all-gather)."""
    tensor_parallel: float
    context_parallel: float
    expert_parallel: float

    @property
    def total(self) -> float:
        return self.compute + self.tensor_parallel + self.context_parallel + self.expert_parallel


def stage_cost(w: Workload, links: Links, *, layers: int, layer_params: int, first: bool,
               last: bool, fp8_layers: int = 0) -> StageCost:
    """One micro-batch through ``layers`` layers, ``fp8_layers`` of them with FP8 matmuls (+
    the embedding / output layer and loss, bf16)."""
    forward, backward = layer_compute(w, layer_params)
    compute, fwd = (layers - fp8_layers) * (forward + backward), (layers - fp8_layers) * forward
    if fp8_layers:
        forward, backward = layer_compute(replace(w, fp8=True), layer_params)
        compute, fwd = compute + fp8_layers * (forward + backward), fwd + fp8_layers * forward
    if last:
        out = output_compute(w)
        compute, fwd = compute + out, fwd + out / 3
    tp = layers * layer_tp_seconds(w, links.tp, links.latency)
    if w.tp > 1 and links.tp:  # embedding scatter / output gather of the sequence shards
        edge = (w.tp - 1) / w.tp * w.tokens * w.d.hidden * w.elem * links.tp + links.latency
        tp += 2 * edge * (int(first) + int(last))
    cp = layers * layer_cp_seconds(w, links.cp, links.latency, attention_seconds(w))
    ep = layers * layer_ep_seconds(w, links.ep, links.latency)
    return StageCost(compute, fwd, tp, cp, ep)


def mixed_stage_cost(w: Workload, links: Links, kinds: list[tuple], *, first: bool,
                     last: bool) -> StageCost:
    """One micro-batch through a stage whose layers are of several kinds (a MoE model's dense
    first layers and its expert layers): ``kinds`` = (the layer, how many, its parameters on
    this GPU, how many of them run FP8 matmuls), each priced as :func:`stage_cost` prices
    alike layers; the embedding and output layer counted once."""
    kinds = kinds or [(w.d, 0, 0, 0)]
    costs = [stage_cost(replace(w, d=layer), links, layers=n, layer_params=params,
                        first=first and i == 0, last=last and i == len(kinds) - 1,
                        fp8_layers=fp8) for i, (layer, n, params, fp8) in enumerate(kinds)]
    if len(costs) == 1:
        return costs[0]
    return StageCost(*(sum(getattr(c, f) for c in costs) for f in (
        "compute", "forward", "tensor_parallel", "context_parallel", "expert_parallel")))


def p2p_seconds(w: Workload, dims: ParallelDims, links: Links, grad_accum: int) -> float:
    """Pipeline sends and receives on the critical path: every micro-batch's under 1F1B (the
    calls block), only the fill and drain under the interleaved schedule (overlapped)."""
    if dims.pp == 1 or links.pp == 0:
        return 0.0
    shards = w.tp if w.sp else 1
    one = w.tokens * w.d.hidden * w.elem / shards * links.pp + links.latency
    transfers = 2 * (grad_accum + dims.pp - 1) if dims.vpp == 1 else 2 * (dims.pp - 1)
    return transfers * one


@dataclass(frozen=True)
class DataParallelWork:
    """The gradient and parameter traffic of one GPU's data-parallel groups."""

    engine: str
    zero_stage: int
    dense_params: int
    expert_params: int
    dense_shards: int
    expert_shards: int
    grad_bytes: int
    param_bytes: int
    overlap_grad: bool
    overlap_param: bool
    bucket_elements: int


def _traffic(work: DataParallelWork, grad_accum: int) -> tuple[float, float]:
    """(bytes per parameter reduced, bytes per parameter gathered) per shard fraction (n-1)/n,
    over the step: reduce-scatter + all-gather (distributed optimizer, ZeRO-1), all-reduce
    (no sharding), per-micro-batch reduce-scatter (ZeRO-2) and gathers (ZeRO-3)."""
    g, e = work.grad_bytes, work.param_bytes
    if work.zero_stage == 0:
        return 2.0 * g, 0.0
    if work.engine == "deepspeed" and work.zero_stage == 2:
        return float(g * grad_accum), float(e)
    if work.engine == "deepspeed" and work.zero_stage == 3:
        return float(g * grad_accum), 2.0 * e * grad_accum
    return float(g), float(e)


def data_parallel_seconds(work: DataParallelWork, links: Links, grad_accum: int,
                          backward_window: float, forward_window: float) -> float:
    """Data-parallel traffic not hidden behind the last backward (gradients) and the first
    forward (parameters); without overlap all of it. ZeRO-2/3 traffic is per micro-batch and
    hides behind every micro-batch's passes."""
    reduce_b, gather_b = _traffic(work, grad_accum)
    frac_d = (work.dense_shards - 1) / work.dense_shards
    frac_e = (work.expert_shards - 1) / work.expert_shards
    per_param = work.dense_params * frac_d * links.dp + work.expert_params * frac_e * links.expert_dp
    if per_param == 0:
        return 0.0
    reduce_s, gather_s = reduce_b * per_param, gather_b * per_param
    repeats = grad_accum if (work.engine == "deepspeed" and work.zero_stage >= 2) else 1
    if work.overlap_grad:
        reduce_s = max(0.0, reduce_s - repeats * backward_window)
    if work.overlap_param or work.zero_stage == 3:
        gather_s = max(0.0, gather_s - repeats * forward_window)
    bucket = work.bucket_elements * work.grad_bytes * max(links.dp, links.expert_dp)
    tail = min(bucket, reduce_b * per_param) if work.overlap_grad else 0.0
    return reduce_s + gather_s + tail + 2 * links.latency


def optimizer_seconds(params: float, dev: Device, offload: bool, grad_bytes: int,
                      param_bytes: int, slowdown: float) -> float:
    """One optimizer step over this GPU's (shard of the) parameters: at the rate measured on
    this machine where there is one (a CPU's check), else its memory traffic."""
    if offload:
        copies = params * (grad_bytes + param_bytes) / PCIE_BYTES_PER_S
        return params / CPU_ADAM_PARAMS_PER_S + copies
    if dev.optimizer_seconds_per_param > 0:
        return params * dev.optimizer_seconds_per_param * slowdown
    return params * OPTIMIZER_BYTES_PER_PARAM / dev.hbm_bytes_per_s * slowdown


def pipeline_step(costs: list[StageCost], dims: ParallelDims, grad_accum: int) -> dict:
    """Per-cause seconds of the pipelined micro-batches: m x the slowest stage, plus the bubble
    (PP - 1) / VPP stage-times; the slowest stage's forward / backward windows."""
    slow = max(costs, key=lambda c: c.total)
    m = grad_accum
    bubble = (dims.pp - 1) / dims.vpp * slow.total if dims.pp > 1 else 0.0
    return dict(compute=m * slow.compute, tensor_parallel=m * slow.tensor_parallel,
                context_parallel=m * slow.context_parallel,
                expert_parallel=m * slow.expert_parallel, pipeline_bubble=bubble,
                forward_window=slow.forward / dims.vpp,
                backward_window=(slow.compute - slow.forward) / dims.vpp)
