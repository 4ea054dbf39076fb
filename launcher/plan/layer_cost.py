"""Seconds one GPU spends on one micro-batch of one pipeline stage, by cause.

The pieces of :mod:`launcher.plan.step_time`'s model that scale with layers and tokens:
compute (matmuls, attention, memory-bound kernels), tensor-parallel collectives, the
context-parallel ring exchange and the expert all-to-alls. See that module for the model and
:mod:`launcher.plan.hardware` for the rates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from launcher.plan.hardware import Device
from launcher.shape.model import ResolvedModel

FLASH_BACKWARD_FACTOR = 2.5
"""Flash attention backward / forward work (FlashAttention-2: 5 matmuls vs 2)."""
ELEMENTWISE_PER_HIDDEN = 34
"""Values read + written per token per hidden unit and layer by norms and residual adds,
forward and backward (2 norms and 2 adds: 10 forward, about twice that backward, + casts)."""
ELEMENTWISE_PER_FFN = 8
"""Values per token per MLP unit of the fused SwiGLU / GeLU (3 forward, 5 backward)."""
ELEMENTWISE_PER_ROPE = 4
"""Values per token per query/key unit of rotary embeddings (read + write, both passes)."""
ELEMENTWISE_PER_LATENT = 8
"""Values per token per latent unit of MLA's query and key/value norms (a norm's share of
ELEMENTWISE_PER_HIDDEN: read + write forward, about twice that backward, + casts)."""
LOSS_BYTES_PER_LOGIT = 24
"""Cross-entropy over the vocabulary: logits read, fp32 softmax written and read, gradient
written, forward and backward."""
GRAD_ACCUM_BYTES_PER_PARAM = 10
"""Per micro-batch: read a bf16 weight gradient, read + write its fp32 accumulator. The engines
build the model with ``gradient_accumulation_fusion=False`` (launcher/engines/model.py)."""
UNFUSED_SCORE_PASSES = 6
"""Unfused attention: times each score is written or read (scores, softmax, its backward)."""
FP8_GEMM_EFFICIENCY = 0.70
"""Fraction of the FP8 peak that large FP8 matmuls reach (1,385 of 1,979 TFLOP/s on an H100;
cuBLAS FP8 GEMMs of 8K x 8K x 8K reach 1,300-1,500)."""
FP8_HALF_RATE_FLOPS = 3.2e11
"""FLOPs of the FP8 matmul that reaches half of FP8_GEMM_EFFICIENCY: FP8 kernels need larger
tiles than bf16 ones, and TE adds amax and scaling kernels per GEMM, so small matmuls gain
little or lose. Calibrated with FP8_GEMM_EFFICIENCY fixed on the two measurements of issue 15
(one H100, Megatron-LM, TE 2.9, hybrid delayed scaling, 8 x 4096 tokens a step): Llama 3.2 1B
FP8 771 ms vs bf16 728 (ratio 1.059; the plan says 1.037), eight Llama 3 8B layers 902 vs 1026
(0.879; the plan says 0.895)."""
FP8_CAST_BYTES = 4
"""Bytes moved per element TE quantizes: read bf16 (2), write FP8 and its transpose (1 + 1);
forward quantizes the input and the weight, backward the output gradient."""


@dataclass(frozen=True)
class Workload:
    """What one GPU computes per micro-batch, and how fast (see :func:`workload`)."""

    d: ResolvedModel
    tokens: int
    """Tokens of one micro-batch on one context-parallel rank."""
    tp: int
    sp: bool
    cp: int
    ep: int
    recompute: str
    """none, selective or full."""
    flash: bool
    elem: int
    """Bytes per activation value (2: bf16/fp16, 4: fp32)."""
    gemm_rate: float
    """FLOP/s of matmuls (peak x efficiency / slowdown)."""
    attention_rate: float
    hbm_rate: float
    """Bytes/s of memory-bound kernels."""
    fp8: bool = False
    """The layer's matmuls run in FP8 (trainer.precision=fp8, not a bf16 end layer)."""
    fp8_rate: float = 0.0
    """FLOP/s of large FP8 matmuls (FP8 peak x FP8_GEMM_EFFICIENCY / slowdown); 0 = no FP8."""


def workload(d: ResolvedModel, *, micro_batch: int, tp: int, sp: bool, cp: int, ep: int, recompute: str,
             flash: bool, elem: int, peak_flops: float, dev: Device, slowdown: float) -> Workload:
    """``slowdown``: compute time multiplier (ranks sharing a GPU, a slower engine). The
    workload is bf16's; ``dataclasses.replace(w, fp8=True)`` is an FP8 layer's."""
    return Workload(d, micro_batch * d.seq // cp, tp, sp, cp, ep, recompute, flash, elem,
                    peak_flops * dev.gemm_efficiency / slowdown,
                    peak_flops * dev.attention_efficiency / slowdown,
                    dev.hbm_bytes_per_s / slowdown,
                    fp8_rate=dev.peak_tflops_fp8 * 1e12 * FP8_GEMM_EFFICIENCY / slowdown)


def _passes(w: Workload) -> float:
    """Forward passes' worth of matmul work: 3 (forward + backward), 4 with full recompute."""
    return 4.0 if w.recompute == "full" else 3.0


def _attention_seconds(w: Workload) -> float:
    """Core attention (scores and weighted values) of one layer for one micro-batch."""
    d = w.d
    if d.mla:  # QK^T over keys of head_dim + rope, scores x V over values of v_dim
        scores = 2.0 * d.seq * (d.q_dim + d.attention_out_dim) / w.tp * w.tokens
    else:
        scores = 4.0 * d.seq * d.q_dim / w.tp * w.tokens  # forward, full square (model FLOPs)
    if not w.flash:
        passes = _passes(w) + (1 if w.recompute == "selective" else 0)
        values = d.heads / w.tp * w.tokens * d.seq * w.elem * UNFUSED_SCORE_PASSES
        return scores * passes / w.gemm_rate + values / w.hbm_rate
    extra = 1.0 if w.recompute in ("full", "selective") else 0.0
    return scores / 2 * (1 + FLASH_BACKWARD_FACTOR + extra) / w.attention_rate


def gemm_seconds(w: Workload, m: float, k: float, n: float) -> float:
    """One (m x k) @ (k x n) matmul: its FLOPs at the matmul rate plus its operands and result
    through memory once (an additive roofline: small matmuls reach less of the peak)."""
    if w.fp8:
        return fp8_gemm_seconds(w, m, k, n)
    return 2.0 * m * k * n / w.gemm_rate + (m * k + k * n + m * n) * w.elem / w.hbm_rate


def fp8_gemm_seconds(w: Workload, m: float, k: float, n: float) -> float:
    """One FP8 matmul, as a forward pass's share of its three (forward, input gradient, weight
    gradient): FLOPs at an FP8 rate that falls for small matmuls, FP8 operands and a bf16
    result through memory, and a third of TE's quantization of the three passes (input and
    weight forward, output gradient backward: FP8_CAST_BYTES per element)."""
    flops = 2.0 * m * k * n
    rate = w.fp8_rate * flops / (flops + FP8_HALF_RATE_FLOPS)
    operands = (m * k + k * n) + m * n * w.elem
    casts = FP8_CAST_BYTES * (m * k + k * n + m * n) / 3
    return flops / rate + (operands + casts) / w.hbm_rate


def _latent_attention_gemms(w: Workload) -> float:
    """MLA's projections (Transformer Engine's spec): the down-projections whole on every TP
    rank, over this rank's part of the sequence under sequence parallelism (all of it
    without); the up- and output projections split by heads."""
    d, t, tokens = w.d, w.tp, w.tokens
    local = tokens / (t if w.sp else 1)
    if d.q_lora:
        out = gemm_seconds(w, local, d.hidden, d.q_lora)
        out += gemm_seconds(w, tokens, d.q_lora, d.q_dim / t)
    else:
        out = gemm_seconds(w, tokens, d.hidden, d.q_dim / t)
    out += gemm_seconds(w, local, d.hidden, d.kv_lora + d.rope_dim)
    out += gemm_seconds(w, tokens, d.kv_lora, d.heads * (d.head_dim + d.v_dim) / t)
    return out + gemm_seconds(w, tokens, d.attention_out_dim / t, d.hidden)


def _layer_gemms(w: Workload) -> float:
    """Forward matmuls of one layer for one micro-batch on this GPU: QKV (or MLA's
    projections), projection, MLP (or the top-k experts at their share of the tokens, the
    router and the shared expert)."""
    d, t, tokens = w.d, w.tp, w.tokens
    if d.mla:
        out = _latent_attention_gemms(w)
    else:
        out = gemm_seconds(w, tokens, d.hidden, (d.q_dim + 2 * d.kv_dim) / t)
        out += gemm_seconds(w, tokens, d.q_dim / t, d.hidden)
    ffn, rows, copies = d.ffn, tokens, 1
    if d.experts:  # each local expert gets tokens x top-k x EP / experts of them
        ffn, copies = d.expert_ffn, d.experts // w.ep
        rows = tokens * d.topk * w.ep / d.experts
        out += gemm_seconds(replace(w, fp8=False), tokens, d.hidden, d.experts)  # router: bf16
        if d.shared_ffn:
            out += _mlp_gemms(w, tokens, d.shared_ffn)
    return out + copies * _mlp_gemms(w, rows, ffn)


def _mlp_gemms(w: Workload, rows: float, ffn: int) -> float:
    """fc1 and fc2 of one MLP of width ``ffn`` over ``rows`` tokens, split over TP."""
    fc1 = (2 if w.d.gated else 1) * ffn / w.tp
    return gemm_seconds(w, rows, w.d.hidden, fc1) + gemm_seconds(w, rows, ffn / w.tp, w.d.hidden)


def _elementwise_values(w: Workload) -> float:
    """Values one token moves through memory-bound kernels in one layer on this GPU (both
    passes): norms and residual adds, the MLP's activation (the routed experts' and the shared
    expert's), RoPE over the query and key widths; MLA's latent norms (whole on every TP rank,
    over this rank's part of the sequence under SP) and its rotated query/key parts joined to
    the unrotated ones."""
    d = w.d
    routed = d.topk if d.experts else 1
    ffn = d.expert_ffn if d.experts else d.ffn
    shards = w.tp if w.sp else 1
    mlp = ffn * routed + (d.shared_ffn if d.experts else 0)
    values = (ELEMENTWISE_PER_HIDDEN * d.hidden / shards
              + ELEMENTWISE_PER_FFN * mlp / w.tp * (1 if d.gated else 0.67))
    if not d.mla:
        return values + ELEMENTWISE_PER_ROPE * (d.q_dim + d.kv_dim) / w.tp
    keys = d.heads * (d.head_dim + d.rope_dim)
    return (values + ELEMENTWISE_PER_ROPE * (d.q_dim + keys) / w.tp
            + ELEMENTWISE_PER_LATENT * (d.q_lora + d.kv_lora) / shards)


def layer_compute(w: Workload, layer_params: int) -> tuple[float, float]:
    """(forward, backward + recompute) seconds of one layer for one micro-batch;
    ``layer_params``: the layer's parameters on this GPU (for the gradient accumulation)."""
    gemm = _layer_gemms(w)
    memory = _elementwise_values(w) * w.elem * w.tokens / w.hbm_rate
    attention = _attention_seconds(w)
    forward = gemm + memory / 3 + attention / (1 + FLASH_BACKWARD_FACTOR)
    total = gemm * _passes(w) + memory * (4 / 3 if w.recompute == "full" else 1) + attention
    accumulate = layer_params * GRAD_ACCUM_BYTES_PER_PARAM / w.hbm_rate
    return forward, total - forward + accumulate


def output_compute(w: Workload) -> float:
    """Output layer and loss of one micro-batch on the last stage (forward + backward)."""
    d = w.d
    gemm = 3 * gemm_seconds(w, w.tokens, d.hidden, d.padded_vocab / w.tp)
    loss = LOSS_BYTES_PER_LOGIT * d.padded_vocab / w.tp * w.tokens / w.hbm_rate
    return gemm + loss


def layer_tp_seconds(w: Workload, per_byte: float, latency: float) -> float:
    """Tensor-parallel collectives of one layer for one micro-batch (all passes)."""
    if w.tp == 1 or per_byte == 0:
        return 0.0
    passes = 3 if w.recompute == "full" else 2
    if w.d.mla and w.sp:
        volume = _latent_sp_width(w.d) * (w.tp - 1) / w.tp * w.tokens * w.elem
        count = 6
    else:
        volume = 4 * (w.tp - 1) / w.tp * w.tokens * w.d.hidden * w.elem
        count = 4 if w.sp else 2
    return passes * (volume * per_byte + count * latency)


def _latent_sp_width(d: ResolvedModel) -> int:
    """Values per token an MLA layer's TP collectives move under sequence parallelism: the
    down-projections read this rank's part of the sequence, so the query latent (the hidden
    state without one), the key/value latent and the rotated key are gathered instead of the
    hidden state; the output projection's reduce-scatter and the MLP's two as in any layer."""
    return (d.q_lora or d.hidden) + d.kv_lora + d.rope_dim + 3 * d.hidden


def layer_cp_seconds(w: Workload, per_byte: float, latency: float, attention: float) -> float:
    """Context-parallel ring exchange of one layer not hidden behind its attention."""
    if w.cp == 1 or per_byte == 0:
        return 0.0
    kv = w.tokens * _ring_kv_width(w.d) / w.tp * w.elem
    forward = (w.cp - 1) * (kv * per_byte + latency)
    backward = 2 * forward
    share = attention / (1 + FLASH_BACKWARD_FACTOR)
    hidden_forward = max(0.0, forward - share)
    return hidden_forward * (2 if w.recompute == "full" else 1) + max(
        0.0, backward - share * FLASH_BACKWARD_FACTOR)


def _ring_kv_width(d: ResolvedModel) -> int:
    """Key and value values per token the context-parallel ring passes on: with MLA each
    head's key (head_dim + rope) and value (v_dim), the heads expanded from the latent."""
    if d.mla:
        return d.heads * (d.head_dim + d.rope_dim + d.v_dim)
    return 2 * d.kv_dim


def layer_ep_seconds(w: Workload, per_byte: float, latency: float) -> float:
    """Expert all-to-alls (dispatch + combine) of one MoE layer for one micro-batch."""
    d = w.d
    if not d.experts or w.ep == 1 or per_byte == 0:
        return 0.0
    passes = 3 if w.recompute == "full" else 2
    shards = w.tp if w.sp else 1
    volume = 2 * (w.ep - 1) / w.ep * w.tokens / shards * d.topk * d.hidden * w.elem
    return passes * (volume * per_byte + 2 * latency)


def attention_seconds(w: Workload) -> float:
    """Core attention time of one layer and micro-batch (for the CP overlap window)."""
    return _attention_seconds(w)
