"""Parameter counts of the Megatron-Core GPTModel a ModelConfig builds, whole and per GPU.

The counts follow Megatron-Core's module layout: per layer an input norm, a fused QKV projection
(with multi-latent attention: the query and key/value down- and up-projections and the norms of
their latents), an output projection, a pre-MLP norm and an MLP (or a router, the experts and a
shared expert; a MoE model's first ``moe_dense_layers`` layers hold a dense MLP); a word
embedding padded to a multiple of ``make_vocab_size_divisible_by * tensor_parallel_size`` (and a
learned position table for gpt2); a final norm and, with untied embeddings, an output layer.
Local and Transformer Engine specs hold the same parameters, except MLA's query
down-projection: TE's spec keeps it whole on every tensor-parallel rank, trainwright's local
layers (Megatron-Core's local spec) split it over TP (``te``); the key/value down-projection is
whole in both.
Tests check the counts against ``sum(p.numel())`` of built models.
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
    mlp: int  # dense MLP, or the router (replicated over TP and EP) + the shared expert (TP)
    experts: int  # the experts held by this GPU (0 for dense layers)

    @property
    def total(self) -> int:
        return self.attention + self.norms + self.mlp + self.experts


def _mlp_params(hidden: int, ffn: int, gated: bool, bias: bool, tp: int) -> int:
    fc1_out = ffn * (2 if gated else 1) // tp
    fc1 = hidden * fc1_out + (fc1_out if bias else 0)
    fc2 = (ffn // tp) * hidden + (hidden if bias else 0)  # row-parallel bias is replicated
    return fc1 + fc2


def _latent_attention_params(d: ResolvedModel, tp: int, te: bool) -> int:
    """MLA's projections on one GPU: query down (q_lora x hidden) and up (heads x (head_dim +
    rope) x q_lora), or one query projection without a query latent; key/value down ((kv_lora +
    rope) x hidden) and up (heads x (head_dim + v_dim) x kv_lora); the output projection. The
    key/value down-projection is whole on every TP rank, the query's too with TE (``te``) and
    split over TP in the local layers (launcher/engines/layer_spec.py)."""
    if d.q_lora:
        query = d.q_lora * d.hidden // (1 if te else tp) + d.q_dim // tp * d.q_lora
    else:
        query = d.q_dim // tp * d.hidden
    key_value = (d.kv_lora + d.rope_dim) * d.hidden
    key_value += d.heads * (d.head_dim + d.v_dim) // tp * d.kv_lora
    return query + key_value + d.attention_out_dim // tp * d.hidden


def _attention_params(d: ResolvedModel, tp: int, te: bool) -> int:
    if d.mla:
        return _latent_attention_params(d, tp, te)
    qkv_out = (d.q_dim + 2 * d.kv_dim) // tp
    attention = d.hidden * qkv_out + (qkv_out if d.qkv_bias else 0)
    return attention + (d.q_dim // tp) * d.hidden + (d.hidden if d.bias else 0)


def _norm_params(d: ResolvedModel, tp: int) -> int:
    """A layer's norms on one GPU: the hidden-size ones, the QK norms, MLA's latent norms (whole
    on every TP rank)."""
    latent = d.q_lora + d.kv_lora if d.mla else 0
    return d.layer_norms * d.norm_params + d.qk_norm_params_per_gpu(tp) + latent


def layer_params(d: ResolvedModel, tp: int = 1, ep: int = 1, te: bool = True) -> LayerParams:
    """Parameters of one layer held by one GPU of a TP (and EP) group: a layer with experts
    for a MoE model (``d.dense_layer()`` is one of its dense first layers)."""
    attention, norms = _attention_params(d, tp, te), _norm_params(d, tp)
    if d.experts:
        router = d.experts * d.hidden + (d.experts if d.bias else 0)
        if d.shared_ffn:
            router += _mlp_params(d.hidden, d.shared_ffn, d.gated, d.bias, tp)
        experts = (d.experts // ep) * _mlp_params(d.hidden, d.expert_ffn, d.gated, d.bias, tp)
        return LayerParams(attention, norms, router, experts)
    return LayerParams(attention, norms, _mlp_params(d.hidden, d.ffn, d.gated, d.bias, tp), 0)


@dataclass(frozen=True)
class ParamCounts:
    """Whole-model parameter counts by component (one copy of every weight)."""

    embedding: int  # word embedding (padded) + learned positions
    attention: int
    mlp: int  # dense MLPs, or routers + shared experts + experts
    norms: int  # per-layer norms (MLA's latent norms included) + final norm
    output_layer: int  # 0 when tied to the embedding
    vocab_padding: int  # of the above, rows added by vocabulary padding
    total: int
    total_unpadded: int  # total without vocabulary padding (the published figure)
    active_per_token: int  # parameters a token passes through (top-k experts only)


def count_parameters(model: ModelConfig, tensor_parallel_size: int = 1) -> ParamCounts:
    d = ResolvedModel.of(model, tensor_parallel_size)
    kinds = [(layer_params(kind), n) for kind, n in d.layer_kinds(range(d.layers))]
    word = d.padded_vocab * d.hidden
    embedding = word + d.positions * d.hidden
    output = 0 if d.tied else word
    attention = sum(layer.attention * n for layer, n in kinds)
    mlp = sum((layer.mlp + layer.experts) * n for layer, n in kinds)
    norms = sum(layer.norms * n for layer, n in kinds) + d.norm_params
    total = embedding + attention + mlp + norms + output
    padding = (d.padded_vocab - d.vocab) * d.hidden * (1 if d.tied else 2)
    inactive = 0
    if d.experts:
        per_expert = _mlp_params(d.hidden, d.expert_ffn, d.gated, d.bias, 1)
        inactive = (d.experts - d.topk) * per_expert * d.moe_layers
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


def stage_index(dims: ParallelDims, first: bool, last: bool) -> int:
    """The stage the flags name: the first, the last, or (neither) the second."""
    return 0 if first else dims.pp - 1 if last else min(1, dims.pp - 1)


def stage_layer_numbers(d: ResolvedModel, dims: ParallelDims, stage: int,
                        layers: int | None = None) -> list[int]:
    """The layers (from 0) pipeline stage ``stage`` holds; ``layers``: that many from its first
    one instead (a stage split of its own)."""
    numbers = list(dims.stage_layer_numbers(d.layers)[stage])
    if layers is not None and layers != len(numbers):
        start = numbers[0] if numbers else 0
        numbers = list(range(start, start + layers))
    return numbers


def stage_params(model: ModelConfig, dims: ParallelDims, first: bool, last: bool,
                 layers: int | None = None, *, stage: int | None = None,
                 te: bool = True) -> StageParams:
    """What one GPU of the first and/or last pipeline stage holds (both flags for PP=1; neither:
    a middle stage, by default the second). ``layers``: the stage's transformer layer count, by
    default the split's (:meth:`ParallelDims.stage_layers`); ``stage``: which stage (its layers
    decide which are dense in a MoE model with dense first layers); ``te``: Transformer
    Engine's layer spec (the GPU build) rather than the local one."""
    tp, pp = dims.tp, dims.pp
    d = ResolvedModel.of(model, tp)
    stage = stage_index(dims, first, last) if stage is None else stage
    numbers = stage_layer_numbers(d, dims, stage, layers)
    kinds = [(layer_params(kind, tp, dims.ep, te), n) for kind, n in d.layer_kinds(numbers)]
    dense = sum((layer.attention + layer.norms + layer.mlp) * n for layer, n in kinds)
    word = d.padded_vocab // tp * d.hidden
    if first:
        dense += word + d.positions * d.hidden
    if last:
        dense += d.norm_params
        if not d.tied or pp > 1:  # a tied output layer keeps its own copy on the last stage
            dense += word
    expert = sum(layer.experts * n for layer, n in kinds)
    return StageParams(dense, expert, max([layer.total for layer, _ in kinds] + [word]))


def stage_views(d: ResolvedModel, dims: ParallelDims) -> list[int]:
    """The stages that can be the most loaded (parameters, activations, time): the first, the
    last, and of the middle stages the first of each mix of layers (count, and dense vs expert
    layers): the second alone where every middle stage holds alike, as in a model whose layers
    are all alike."""
    if dims.pp == 1:
        return [0]
    numbers = dims.stage_layer_numbers(d.layers)
    seen, middle = set(), []
    for stage in range(1, dims.pp - 1):
        mix = tuple((kind.experts > 0, n) for kind, n in d.layer_kinds(numbers[stage]))
        if mix not in seen:
            seen.add(mix)
            middle.append(stage)
    return [0] + middle + [dims.pp - 1]
