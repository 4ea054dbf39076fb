"""The model as it is built: one :class:`ResolvedModel` with every 0-sentinel of the config
resolved, once.

``model.num_query_groups=0`` means multi-head attention, ``kv_channels=0`` hidden / heads,
``moe_ffn_hidden_size=0`` the dense MLP's width, ``max_position_embeddings=0`` the sequence
length; the arch decides the norm, the activation and the position embedding. Those rules live
here and nowhere else: parameter counts, memory, FLOPs and validation (:mod:`launcher.plan`),
Megatron-Core's ``TransformerConfig`` and ``GPTModel`` (:mod:`launcher.engines.model`), the
Hugging Face mapping (:mod:`launcher.engines.weights`) and the architecture a checkpoint records
and a resume is checked against (:meth:`ResolvedModel.architecture`) all read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from launcher.config import (Activation, Arch, HfFamily, ModelConfig, NormPlacement, RopeScaling,
                             RouterScore)

ARCHITECTURE_KEYS = (
    "arch", "normalization", "activation", "position_embedding", "num_layers", "hidden_size",
    "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size",
    "max_position_embeddings", "rotary_base", "rope_scaling", "rope_scaling_factor",
    "norm_epsilon", "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "qk_layernorm_all_heads", "norm_placement", "norm_zero_centered",
    "scale_embeddings", "softmax_scale_dim", "window_size", "full_attention_every",
    "rotary_base_local", "rope_original_max_positions", "yarn_beta_fast", "yarn_beta_slow",
    "yarn_mscale", "yarn_mscale_all_dim", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
    "moe_router_score", "moe_router_expert_bias", "moe_router_groups", "moe_router_group_topk",
    "moe_router_scaling", "moe_shared_expert_ffn_hidden_size", "moe_dense_layers")
"""What the architecture record holds, in message order: every model setting that gives the
weights their meaning (dropout, init and the MoE loss and capacity are training settings). The
padded vocabulary is not part of it: it follows TP, and Megatron-Core loads embeddings padded
differently (the padding rows carry no token)."""

DERIVED = {"normalization": "from model.arch", "activation": "from model.arch and model.activation",
           "position_embedding": "from model.arch"}
"""Architecture entries that are not a config key of their own: what sets them."""

_ENUMS = {"arch": Arch, "activation": Activation, "rope_scaling": RopeScaling,
          "hf_family": HfFamily, "norm_placement": NormPlacement,
          "moe_router_score": RouterScore}


_RESOLVED: dict = {}
"""ResolvedModel.of's results by (the ModelConfig's field values, TP)."""
_RESOLVED_KEPT = 256


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int = 1) -> int:
    """Rows of the embedding table: vocab_size rounded up to divisible_by x TP."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class ResolvedModel:
    """A ModelConfig at a tensor-parallel size, sentinels resolved (build with :meth:`of`)."""

    arch: Arch
    layers: int
    hidden: int
    ffn: int
    """Dense MLP inner width (each of gate and up for SwiGLU)."""
    heads: int
    groups: int
    """Key/value heads (num_query_groups, 0 = heads)."""
    head_dim: int
    """Per-head dimension (kv_channels, 0 = hidden / heads)."""
    vocab: int
    padded_vocab: int
    """Embedding rows at this tensor-parallel size."""
    seq: int
    max_positions: int
    """Longest context (max_position_embeddings, 0 = seq)."""
    positions: int
    """Rows of the learned position table (gpt2), 0 for rotary."""
    gated: bool
    """SwiGLU MLP (llama) rather than GeLU (gpt2)."""
    normalization: str
    """``RMSNorm`` (llama) or ``LayerNorm`` (gpt2)."""
    activation: str
    """``swiglu``, ``gelu`` (exact) or ``gelu_tanh``."""
    norm_params: int
    """Parameters of one norm over the hidden size."""
    bias: bool
    qkv_bias: bool
    qk_norm: bool
    """A norm over each query and key head (model.qk_layernorm)."""
    qk_all_heads: bool
    """The query and key norms run over all heads at once (model.qk_layernorm_all_heads)."""
    placement: NormPlacement
    """Where the layer's hidden-size norms sit (model.norm_placement)."""
    zero_centered: bool
    """Norms multiply by 1 + weight (model.norm_zero_centered)."""
    scale_embeddings: bool
    """Input embeddings times sqrt(hidden) (model.scale_embeddings)."""
    softmax_dim: int
    """Attention scores scaled by 1/sqrt(softmax_dim) (model.softmax_scale_dim, 0 resolved to
    the head dimension)."""
    window: int
    """Keys a query attends to at most, itself included (model.window_size; 0 = all before)."""
    full_every: int
    """With a window: every full_every-th layer attends to all before it (0 = none does)."""
    rotary_base_local: int
    """RoPE base of the windowed layers (0 = rotary_base, as the others)."""
    family: HfFamily
    """The Hugging Face family of the weights' names (model.hf_family, auto resolved)."""
    experts: int
    topk: int
    """Experts a token is routed to (0 for a dense model)."""
    expert_ffn: int
    """Inner width of each expert (moe_ffn_hidden_size, 0 = ffn)."""
    pre_softmax: bool
    """The chosen experts weighed by the softmax over all experts (model.moe_router_pre_softmax)."""
    score: RouterScore
    """How router logits become expert probabilities (model.moe_router_score)."""
    expert_bias: bool
    """A load-balancing bias on the scores that choose experts (model.moe_router_expert_bias)."""
    router_groups: int
    """Expert groups a token picks among first (0 = none)."""
    group_topk: int
    """Groups a token picks (with router_groups)."""
    router_scaling: float
    """Factor on the chosen experts' weights (model.moe_router_scaling)."""
    shared_ffn: int
    """Inner width of the shared expert of each MoE layer (0 = none)."""
    dense_layers: int
    """Leading layers with a dense MLP in a MoE model (model.moe_dense_layers)."""
    kv_lora: int
    """Multi-latent attention's key/value latent width (model.kv_lora_rank; 0 = not MLA)."""
    q_lora: int
    """MLA's query latent width (0 = queries projected directly)."""
    rope_dim: int
    """MLA's rotated query/key part per head (model.qk_rope_head_dim)."""
    v_dim: int
    """Value width per head (model.v_head_dim, 0 resolved to head_dim; head_dim without MLA)."""
    tied: bool
    """The output layer reuses the input embedding."""
    rotary_base: int
    yarn: Optional[tuple]
    """rope_scaling=yarn: (original context, beta_fast, beta_slow, mscale, mscale_all_dim);
    None otherwise."""
    rope_scaling: RopeScaling
    rope_scaling_factor: float
    norm_epsilon: float

    @classmethod
    def of(cls, model: ModelConfig, tensor_parallel_size: int = 1) -> "ResolvedModel":
        """``model`` as Megatron-Core builds it at ``tensor_parallel_size``. Cached on the
        config's field values (a layout search resolves one model ~60,000 times), so a config
        changed in place resolves afresh."""
        key = (tuple(vars(model).values()), tensor_parallel_size)
        try:
            return _RESOLVED[key]
        except KeyError:
            pass
        except TypeError:  # a field holding a list: not hashable, not cached
            return cls._resolve(model, tensor_parallel_size)
        if len(_RESOLVED) >= _RESOLVED_KEPT:
            _RESOLVED.clear()
        resolved = _RESOLVED[key] = cls._resolve(model, tensor_parallel_size)
        return resolved

    @classmethod
    def _resolve(cls, model: ModelConfig, tensor_parallel_size: int) -> "ResolvedModel":
        gpt2, heads = model.arch == Arch.gpt2, model.num_attention_heads
        max_positions = model.max_position_embeddings or model.seq_length
        return cls(
            arch=Arch(model.arch), layers=model.num_layers, hidden=model.hidden_size,
            ffn=model.ffn_hidden_size, heads=heads, groups=model.num_query_groups or heads,
            head_dim=model.kv_channels or model.hidden_size // heads, vocab=model.vocab_size,
            padded_vocab=padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by,
                                           tensor_parallel_size),
            seq=model.seq_length, max_positions=max_positions,
            positions=max_positions if gpt2 else 0, gated=not gpt2,
            normalization="LayerNorm" if gpt2 else "RMSNorm",
            activation=_activation(model), norm_params=model.hidden_size * (2 if gpt2 else 1),
            bias=model.add_bias_linear, qkv_bias=model.add_bias_linear or model.add_qkv_bias,
            qk_norm=model.qk_layernorm,
            qk_all_heads=model.qk_layernorm and model.qk_layernorm_all_heads,
            placement=NormPlacement(model.norm_placement), zero_centered=model.norm_zero_centered,
            scale_embeddings=model.scale_embeddings,
            softmax_dim=model.softmax_scale_dim or model.kv_channels or model.hidden_size // heads,
            window=model.window_size, full_every=model.full_attention_every if model.window_size
            else 0, rotary_base_local=model.rotary_base_local if model.window_size else 0,
            family=hf_family_of(model),
            experts=model.num_experts, topk=model.moe_router_topk if model.num_experts else 0,
            expert_ffn=model.moe_ffn_hidden_size or model.ffn_hidden_size,
            pre_softmax=bool(model.num_experts and model.moe_router_pre_softmax),
            **_router(model), **_latent_attention(model),
            tied=not model.untie_embeddings_and_output_weights, rotary_base=model.rotary_base,
            yarn=(model.rope_original_max_positions, model.yarn_beta_fast, model.yarn_beta_slow,
                  model.yarn_mscale, model.yarn_mscale_all_dim)
            if model.rope_scaling == RopeScaling.yarn else None,
            rope_scaling=RopeScaling(model.rope_scaling),
            rope_scaling_factor=model.rope_scaling_factor, norm_epsilon=model.norm_epsilon)

    @classmethod
    def of_fields(cls, fields: Mapping[str, Any], tensor_parallel_size: int = 1) -> "ResolvedModel":
        """From ModelConfig fields as JSON holds them (a checkpoint's config, an HF import);
        fields the mapping lacks take ModelConfig's defaults."""
        return cls.of(model_config(fields), tensor_parallel_size)

    @property
    def pre_norm(self) -> bool:
        """Norms on the inputs of attention and MLP."""
        return self.placement in (NormPlacement.pre, NormPlacement.pre_post)

    @property
    def post_norm(self) -> bool:
        """Norms on the outputs of attention and MLP, before the residual add."""
        return self.placement in (NormPlacement.post, NormPlacement.pre_post)

    @property
    def layer_norms(self) -> int:
        """Hidden-size norms a layer holds (2, or 4 with norms on both sides)."""
        return 4 if self.placement == NormPlacement.pre_post else 2

    @property
    def local_layers(self) -> bool:
        """Built from trainwright's rewrite of Megatron-Core's local layer spec, GPU included:
        norms other than pre-norms of the usual kind, QK norms over all heads, or a second RoPE
        (launcher/engines/layer_spec.py). Attention is then Megatron-Core's unfused one."""
        return (self.placement != NormPlacement.pre or self.zero_centered or self.qk_all_heads
                or bool(self.rotary_base_local))

    def windowed(self, layer_number: int) -> bool:
        """Layer ``layer_number`` (counted from 1, as Megatron-Core's ``is_layer_window_attention``
        counts) attends within the window: all but every full_every-th, when there is one."""
        return bool(self.window) and not (self.full_every and layer_number % self.full_every == 0)

    @property
    def windowed_layers(self) -> int:
        """Layers that attend within the window (all but every full_every-th)."""
        if not self.window:
            return 0
        return sum(self.windowed(n) for n in range(1, self.layers + 1))

    @property
    def mla(self) -> bool:
        """Multi-latent attention (model.kv_lora_rank > 0)."""
        return self.kv_lora > 0

    def moe_layer(self, layer: int) -> bool:
        """Layer ``layer`` (from 0) holds experts."""
        return self.experts > 0 and layer >= self.dense_layers

    @property
    def moe_layers(self) -> int:
        """Layers that hold experts."""
        return max(0, self.layers - self.dense_layers) if self.experts else 0

    def dense_layer(self) -> "ResolvedModel":
        """One of a MoE model's dense first layers (model.moe_dense_layers) as a model of its
        own: the same attention and norms, an MLP of ``ffn``, no router, experts or shared
        expert. What counts one layer of a dense model counts it."""
        return dataclasses.replace(self, experts=0, topk=0, pre_softmax=False, expert_bias=False,
                                   router_groups=0, group_topk=0, router_scaling=1.0,
                                   shared_ffn=0, dense_layers=0)

    def layer_kinds(self, numbers) -> list[tuple["ResolvedModel", int]]:
        """The layers numbered ``numbers`` (from 0) by kind: (a layer as :meth:`dense_layer`
        gives it, how many) for a MoE model's dense first layers, (this model, how many) for
        the others; kinds with no layer left out. A model whose layers are alike: one entry."""
        numbers = list(numbers)
        dense = sum(1 for i in numbers if not self.moe_layer(i)) if self.experts else 0
        kinds = [(self.dense_layer(), dense)] if dense else []
        if len(numbers) > dense:
            kinds.append((self, len(numbers) - dense))
        return kinds

    @property
    def q_dim(self) -> int:
        """Query width over all heads (with MLA: each head's unrotated and rotated parts)."""
        return self.heads * (self.head_dim + self.rope_dim)

    @property
    def attention_out_dim(self) -> int:
        """Width of the attention output that the output projection reads (heads x value)."""
        return self.heads * self.v_dim

    @property
    def kv_dim(self) -> int:
        return self.groups * self.head_dim

    @property
    def qk_norm_params(self) -> int:
        """Parameters of a layer's query and key norms (whole), 0 without them."""
        if not self.qk_norm:
            return 0
        if self.qk_all_heads:
            return self.q_dim + self.kv_dim
        return 2 * self.head_dim * (2 if self.normalization == "LayerNorm" else 1)

    def qk_norm_params_per_gpu(self, tp: int) -> int:
        """Of those, what one GPU of a TP group holds (per-head norms are replicated; norms over
        all heads are split with the heads)."""
        return self.qk_norm_params // tp if self.qk_all_heads else self.qk_norm_params

    @property
    def llama(self) -> bool:
        return self.arch == Arch.llama

    def architecture(self) -> dict:
        """The architecture record (:data:`ARCHITECTURE_KEYS`), as a checkpoint stores it; a
        setting the arch does not use is None."""
        llama, moe = self.llama, self.experts > 0
        return {
            "arch": self.arch.value, "normalization": self.normalization,
            "activation": self.activation,
            "position_embedding": "rope" if llama else "learned_absolute",
            "num_layers": self.layers, "hidden_size": self.hidden, "ffn_hidden_size": self.ffn,
            "num_attention_heads": self.heads, "num_query_groups": self.groups,
            "kv_channels": self.head_dim, "vocab_size": self.vocab,
            "max_position_embeddings": None if llama else self.max_positions,
            "rotary_base": self.rotary_base if llama else None,
            "rope_scaling": self.rope_scaling.value if llama else None,
            "rope_scaling_factor": float(self.rope_scaling_factor)
            if llama and self.rope_scaling != RopeScaling.none else None,
            "norm_epsilon": self.norm_epsilon,
            "untie_embeddings_and_output_weights": not self.tied,
            "add_bias_linear": self.bias, "add_qkv_bias": self.qkv_bias,
            "qk_layernorm": self.qk_norm,
            "qk_layernorm_all_heads": self.qk_all_heads if self.qk_norm else None,
            "norm_placement": self.placement.value, "norm_zero_centered": self.zero_centered,
            "scale_embeddings": self.scale_embeddings, "softmax_scale_dim": self.softmax_dim,
            "window_size": self.window,
            "full_attention_every": self.full_every if self.window else None,
            "rotary_base_local": (self.rotary_base_local or None) if self.window else None,
            **dict(zip(("rope_original_max_positions", "yarn_beta_fast", "yarn_beta_slow",
                        "yarn_mscale", "yarn_mscale_all_dim"), self.yarn or (None,) * 5)),
            "num_experts": self.experts, "moe_router_topk": self.topk if moe else None,
            "moe_ffn_hidden_size": self.expert_ffn if moe else None,
            "moe_router_pre_softmax": self.pre_softmax if moe else None,
            "kv_lora_rank": self.kv_lora, "q_lora_rank": self.q_lora if self.mla else None,
            "qk_rope_head_dim": self.rope_dim if self.mla else None,
            "v_head_dim": self.v_dim if self.mla else None,
            "moe_router_score": self.score.value if moe else None,
            "moe_router_expert_bias": self.expert_bias if moe else None,
            "moe_router_groups": self.router_groups if moe else None,
            "moe_router_group_topk": self.group_topk if moe else None,
            "moe_router_scaling": float(self.router_scaling) if moe else None,
            "moe_shared_expert_ffn_hidden_size": self.shared_ffn if moe else None,
            "moe_dense_layers": self.dense_layers if moe else None,
        }


def hf_family_of(model: ModelConfig) -> HfFamily:
    """model.hf_family, or the family its features imply (HfFamily.auto)."""
    if model.hf_family != HfFamily.auto:
        return HfFamily(model.hf_family)
    if model.arch == Arch.gpt2:
        return HfFamily.gpt2
    if model.kv_lora_rank:
        return HfFamily.deepseek_v3
    if model.norm_zero_centered:
        return HfFamily.gemma3_text
    if model.norm_placement == NormPlacement.post:
        return HfFamily.olmo2
    if model.num_experts:
        return HfFamily.qwen3_moe if model.qk_layernorm else HfFamily.mixtral
    if model.qk_layernorm:
        return HfFamily.qwen3
    if model.add_qkv_bias:
        return HfFamily.qwen2
    return HfFamily.mistral if model.window_size else HfFamily.llama


def _router(model: ModelConfig) -> dict:
    """The router and MLP-layout settings of a MoE model (dense-model values otherwise)."""
    moe = model.num_experts > 0
    groups = model.moe_router_groups if moe else 0
    return dict(score=RouterScore(model.moe_router_score) if moe else RouterScore.softmax,
                expert_bias=moe and model.moe_router_expert_bias, router_groups=groups,
                group_topk=model.moe_router_group_topk if groups else 0,
                router_scaling=model.moe_router_scaling if moe else 1.0,
                shared_ffn=model.moe_shared_expert_ffn_hidden_size if moe else 0,
                dense_layers=model.moe_dense_layers if moe else 0)


def _latent_attention(model: ModelConfig) -> dict:
    """Multi-latent attention's widths (zero without it); the value width (head_dim without
    MLA)."""
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    if not model.kv_lora_rank:
        return dict(kv_lora=0, q_lora=0, rope_dim=0, v_dim=head_dim)
    return dict(kv_lora=model.kv_lora_rank, q_lora=model.q_lora_rank,
                rope_dim=model.qk_rope_head_dim, v_dim=model.v_head_dim or head_dim)


def _activation(model: ModelConfig) -> str:
    """The MLP activation's name: swiglu (or geglu_tanh) for llama, gelu or gelu_tanh for
    gpt2."""
    if model.arch == Arch.llama:
        return "geglu_tanh" if model.activation == Activation.gelu_tanh else "swiglu"
    return "gelu_tanh" if model.activation == Activation.gelu_tanh else "gelu"


def model_config(fields: Mapping[str, Any], base: Optional[ModelConfig] = None) -> ModelConfig:
    """A ModelConfig from JSON fields (enums from their strings; unknown keys ignored), on top
    of ``base`` (ModelConfig's defaults when None)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    values = {k: _ENUMS[k](v) if k in _ENUMS and v is not None else v
              for k, v in fields.items() if k in known}
    return dataclasses.replace(base or ModelConfig(), **values)
