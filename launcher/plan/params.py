"""Parameter counts of the Megatron-Core GPTModel a ModelConfig builds, whole and per GPU.

The counts follow Megatron-Core's module layout (local and Transformer Engine specs hold the same
parameters): per layer an input norm, a fused QKV projection, an output projection, a pre-MLP norm
and an MLP (or a router plus experts); a word embedding padded to a multiple of
``make_vocab_size_divisible_by * tensor_parallel_size`` (and a learned position table for gpt2);
a final norm and, with untied embeddings, an output layer. Tests check them against
``sum(p.numel())`` of built models.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import ModelConfig
from launcher.shape import ParallelDims, ResolvedModel


@dataclass(frozen=True)
class LayerParams:
    """One transformer layer on one GPU, split into what is sharded how."""

    attention: int
    norms: int
    mlp: int  # dense MLP, or the router (replicated over TP and EP)
    experts: int  # the experts held by this GPU (0 for dense models)

    @property
    def total(self) -> int:
        return self.attention + self.norms + self.mlp + self.experts


def _mlp_params(hidden: int, ffn: int, gated: bool, bias: bool, tp: int) -> int:
    fc1_out = ffn * (2 if gated else 1) // tp
    fc1 = hidden * fc1_out + (fc1_out if bias else 0)
    fc2 = (ffn // tp) * hidden + (hidden if bias else 0)  # row-parallel bias is replicated
    return fc1 + fc2


def layer_params(d: ResolvedModel, tp: int = 1, ep: int = 1) -> LayerParams:
    """Parameters of one layer held by one GPU of a TP (and EP) group."""
    qkv_out = (d.q_dim + 2 * d.kv_dim) // tp
    attention = d.hidden * qkv_out + (qkv_out if d.qkv_bias else 0)
    attention += (d.q_dim // tp) * d.hidden + (d.hidden if d.bias else 0)
    if d.experts:
        router = d.experts * d.hidden + (d.experts if d.bias else 0)
        experts = (d.experts // ep) * _mlp_params(d.hidden, d.expert_ffn, d.gated, d.bias, tp)
        return LayerParams(attention, d.layer_norms * d.norm_params + d.qk_norm_params_per_gpu(tp), router,
                           experts)
    return LayerParams(attention, d.layer_norms * d.norm_params + d.qk_norm_params_per_gpu(tp),
                       _mlp_params(d.hidden, d.ffn, d.gated, d.bias, tp), 0)


@dataclass(frozen=True)
class ParamCounts:
    """Whole-model parameter counts by component (one copy of every weight)."""

    embedding: int  # word embedding (padded) + learned positions
    attention: int
    mlp: int  # dense MLPs, or routers + experts
    norms: int  # per-layer norms + final norm
    output_layer: int  # 0 when tied to the embedding
    vocab_padding: int  # of the above, rows added by vocabulary padding
    total: int
    total_unpadded: int  # total without vocabulary padding (the published figure)
    active_per_token: int  # parameters a token passes through (top-k experts only)


def count_parameters(model: ModelConfig, tensor_parallel_size: int = 1) -> ParamCounts:
    d = ResolvedModel.of(model, tensor_parallel_size)
    layer = layer_params(d)
    word = d.padded_vocab * d.hidden
    embedding = word + d.positions * d.hidden
    output = 0 if d.tied else word
    attention, mlp = layer.attention * d.layers, (layer.mlp + layer.experts) * d.layers
    norms = layer.norms * d.layers + d.norm_params
    total = embedding + attention + mlp + norms + output
    padding = (d.padded_vocab - d.vocab) * d.hidden * (1 if d.tied else 2)
    inactive = 0
    if d.experts:
        per_expert = _mlp_params(d.hidden, d.expert_ffn, d.gated, d.bias, 1)
        inactive = (d.experts - d.topk) * per_expert * d.layers
    return ParamCounts(embedding, attention, mlp, norms, output, padding, total,
                       total - padding, total - padding - inactive)


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one GPU of a pipeline stage."""

    dense: int  # replicated across data-parallel (x context-parallel) replicas
    expert: int  # replicated across expert-data-parallel replicas
    largest_layer: int  # parameters of the largest single layer on this GPU (ZeRO-3 gathers)

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_params(model: ModelConfig, dims: ParallelDims, first: bool, last: bool,
                 layers: int | None = None) -> StageParams:
    """What one GPU of the first and/or last pipeline stage holds (both flags for PP=1; neither:
    a middle stage). ``layers``: the stage's transformer layers, by default those the stage
    split gives the first, last or second stage (:meth:`ParallelDims.stage_layers`)."""
    tp, pp = dims.tp, dims.pp
    d = ResolvedModel.of(model, tp)
    layer = layer_params(d, tp, dims.ep)
    if layers is None:
        split = dims.stage_layers(d.layers)
        layers = split[0] if first else split[-1] if last else split[min(1, pp - 1)]
    dense = (layer.attention + layer.norms + layer.mlp) * layers
    word = d.padded_vocab // tp * d.hidden
    if first:
        dense += word + d.positions * d.hidden
    if last:
        dense += d.norm_params
        if not d.tied or pp > 1:  # a tied output layer keeps its own copy on the last stage
            dense += word
    return StageParams(dense, layer.experts * layers, max(layer.total, word))
