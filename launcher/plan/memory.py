"""Memory per GPU: training state (weights, gradients, optimizer) and activations, in bytes.

Training state follows the ZeRO paper's accounting (Rajbhandari et al. 2020) for mixed precision:
2-byte weights, 2- or 4-byte gradients (``engine.grad_reduce_in_fp32``), 12 bytes of optimizer
state (fp32 master copy, Adam first and second moments), each sharded over the data-parallel
replicas as the ZeRO stage (DeepSpeed) or the distributed optimizer (Megatron-Core) says.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"), generalised from their GPT block to grouped-query and multi-latent attention, SwiGLU,
mixture-of-experts (shared experts, dense first layers), flash attention and context
parallelism: every tensor a layer keeps for its backward pass, divided by TP where it is
tensor-parallel (and, with sequence parallelism, where it is not), times the micro-batches a
pipeline stage holds in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import NormPlacement, Precision, Recompute
from launcher.engines import spec
from launcher.engines.base import StateBytes
from launcher.shape.dims import ParallelDims
from launcher.shape.model import ResolvedModel


def state_bytes_per_param(*, precision: Precision, engine: str, zero_stage: int,
                          grad_fp32: bool, offload_optimizer: bool, offload_params: bool,
                          shards: int) -> StateBytes:
    """Per-parameter bytes on one GPU when ``shards`` data-parallel replicas share the state, as
    the engine shards them (its spec in :mod:`launcher.engines`)."""
    return spec(engine).state_bytes(precision=precision, zero_stage=zero_stage,
                                    grad_fp32=grad_fp32, offload_optimizer=offload_optimizer,
                                    offload_params=offload_params, shards=shards)


@dataclass(frozen=True)
class ActivationSettings:
    micro_batch: int
    seq_local: int  # sequence length per context-parallel rank
    tp: int
    sequence_parallel: bool
    recompute: Recompute
    flash: bool
    elem_bytes: int  # 2 for bf16/fp16, 4 for fp32
    hidden_dropout: bool
    attention_dropout: bool
    fused_glu: bool = True  # fused bias-SwiGLU (GPU): keeps its input only; unfused keeps 4 x ffn
    logits_fp32: bool = True  # the loss keeps an fp32 copy of the logits (all but TE's fused CE)


def unfused_score_bytes(a: ActivationSettings) -> int:
    """Bytes unfused attention keeps per attention score (one query-key pair of one head).

    Megatron-Core computes the softmax in fp32 for bf16/fp16 (``attention_softmax_in_fp32``):
    softmax keeps its fp32 output for its backward, and the probabilities cast back to the
    training dtype are the saved input of the probabilities x V product; dropout adds its mask
    (1 byte) and the dropped-out copy. Measured on an H100 (Llama 3.2 1B, bf16, s=2048, b=2):
    with 2 bytes per score the plan said 39.0 GB, Megatron-Core's local attention peaked at 59.4.
    """
    e = a.elem_bytes
    kept = 4 + (e if e < 4 else 0)
    return kept + (1 + e if a.attention_dropout else 0)


def layer_activation_bytes(d: ResolvedModel, a: ActivationSettings) -> float:
    """Bytes one transformer layer keeps for backward, for one micro-batch, on one GPU."""
    sb, t, e = a.seq_local * a.micro_batch, a.tp, a.elem_bytes
    sp = t if a.sequence_parallel else 1
    if a.recompute == Recompute.full:
        return sb * d.hidden * e / sp  # only the layer input
    mask = 1 if a.hidden_dropout else 0
    # Norm inputs, QKV input, MLP input, dropout masks: split over TP only with SP; norms on
    # both sides of attention and MLP (Gemma) keep the two outputs they normalise as well.
    hidden_tensors = 6 if d.placement == NormPlacement.pre_post else 4
    replicated = sb * d.hidden * (hidden_tensors * e + 2 * mask) / sp
    if d.mla:
        attention = _latent_attention_bytes(d, a)
    else:
        attention = sb * (2 * d.q_dim + 2 * d.kv_dim) * e / t  # Q, K, V, projection input
    if d.qk_norm:  # the query and key norms' inputs
        attention += sb * (d.q_dim + d.kv_dim) * e / t
    if a.flash:
        attention += sb * d.heads * 4 / t  # softmax log-sum-exp, fp32
    elif a.recompute != Recompute.selective:
        attention += d.heads * a.seq_local ** 2 * a.micro_batch * unfused_score_bytes(a) / t
    ffn, routed = (d.expert_ffn, d.topk) if d.experts else (d.ffn, 1)
    kept = (3 if a.fused_glu else 4) if d.gated else 2  # fc1 output(s) (+ SiLU out), fc2 input
    mlp = sb * ffn * kept * e / t * routed
    if d.experts:
        mlp += sb * d.experts * 4  # router probabilities, fp32
    if d.shared_ffn:
        mlp += sb * d.shared_ffn * kept * e / t
    return replicated + attention + mlp


def _latent_attention_bytes(d: ResolvedModel, a: ActivationSettings) -> float:
    """What multi-latent attention keeps, besides the hidden-size tensors: the query and
    key/value latents, each as its norm's input and its up-projection's input (whole widths,
    over this rank's part of the sequence under sequence parallelism, all of it without), the
    rotated key; per head the query and key (head_dim + rope), the value (v_dim) and the
    output projection's input (v_dim)."""
    sb, e = a.seq_local * a.micro_batch, a.elem_bytes
    sp = a.tp if a.sequence_parallel else 1
    latents = sb * (2 * (d.q_lora + d.kv_lora) + d.rope_dim) * e / sp
    return latents + sb * (2 * d.q_dim + 2 * d.attention_out_dim) * e / a.tp


def in_flight_microbatches(dims: ParallelDims, grad_accum: int, stage: int = 0) -> float:
    """Micro-batches' worth of a stage's activations that pipeline stage ``stage`` (0 = first)
    holds at the peak of the schedule: min(PP - stage, micro-batches) under 1F1B; under the
    interleaved schedule Megatron-Core's warm-up of (PP - stage - 1) x 2 + (VPP - 1) x PP chunk
    micro-batches plus the one in flight, each 1/VPP of the stage (for the first stage
    PP x (1 + (PP - 1) / (PP x VPP)), Narayanan et al. 2021)."""
    pp, vpp = dims.pp, dims.vpp
    if pp == 1:
        return 1.0
    if vpp > 1:
        chunks = (pp - stage - 1) * 2 + (vpp - 1) * pp + 1
        return min(chunks, grad_accum * vpp) / vpp
    return float(min(pp - stage, grad_accum))


def stage_activation_bytes(d: ResolvedModel, a: ActivationSettings, *, layers: int, in_flight: float,
                           first: bool, last: bool, kinds: list | None = None) -> float:
    """Activation bytes of one GPU of a pipeline stage at the peak of the schedule; ``kinds``:
    the stage's layers by kind ((layer, count), :meth:`ResolvedModel.layer_kinds`; default
    ``layers`` layers like ``d``)."""
    kinds = kinds if kinds is not None else [(d, layers)]
    sb = a.seq_local * a.micro_batch
    sp = a.tp if a.sequence_parallel else 1
    total = sum(layer_activation_bytes(k, a) * n for k, n in kinds) * in_flight
    if a.recompute == Recompute.full:  # one layer's activations rebuilt during its backward
        kept = ActivationSettings(**{**a.__dict__, "recompute": Recompute.none})
        total += max([layer_activation_bytes(k, kept) for k, _ in kinds] or [0.0])
    if first:
        total += sb * d.hidden * a.elem_bytes / sp * in_flight  # embedding output
    if last:  # final norm input, logits and (unless TE's fused loss) their fp32 softmax
        total += 2 * sb * d.hidden * a.elem_bytes / sp
        total += sb * d.padded_vocab / a.tp * (a.elem_bytes + (4 if a.logits_fp32 else 0))
    return total
