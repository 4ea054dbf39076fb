"""Typed schemas of the trainwright config tree.

Every group of ``conf/`` (model, parallelism, data, optimizer, trainer, cluster, engine, logger,
resilience, run, plan) has one dataclass here. The root schema :class:`TrainwrightConfig` is
registered in Hydra's ConfigStore as ``trainwright_schema`` and is the first entry of ``conf/config.yaml``'s
defaults list, so every YAML file and every command-line override is merged into a typed,
struct-mode config: an unknown key or a value of the wrong type fails at compose time.

Schemas hold primitives only (ints, floats, strings, bools, enums of strings, lists of those).
Each value is owned by exactly one group; anything that follows from other values (data-parallel
size, gradient accumulation, padded vocabulary, ...) is derived in :mod:`launcher.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional, Dict, List

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class Arch(StrEnum):
    llama = "llama"
    """RMSNorm, SwiGLU MLP, rotary positions, no biases, untied embeddings by default."""
    gpt2 = "gpt2"
    """LayerNorm, GELU MLP, learned absolute positions, biases, tied embeddings by default."""


class HfFamily(StrEnum):
    """The Hugging Face family (``model_type``) whose tensor names and config.json the weights
    take in and out. The math is the ModelConfig's; a family only names it."""

    auto = "auto"
    """From the model's features: multi-latent attention deepseek_v3, zero-centred norms
    gemma3_text, post-norms olmo2, experts with QK-norm qwen3_moe, experts mixtral, QK-norm
    qwen3, QKV biases qwen2, a window mistral, arch=gpt2 gpt2, else llama."""
    llama = "llama"
    mixtral = "mixtral"
    gpt2 = "gpt2"
    qwen2 = "qwen2"
    qwen3 = "qwen3"
    mistral = "mistral"
    qwen3_moe = "qwen3_moe"
    """Qwen3's mixture of experts: QK-norm, experts named as a Llama MLP, no shared expert."""
    olmo2 = "olmo2"
    """OLMo 2: norms after attention and MLP, a query norm and a key norm over all heads."""
    gemma3_text = "gemma3_text"
    """Gemma 3's language model: four norms a layer, zero-centred, scaled embeddings, GeGLU,
    sliding-window layers with a RoPE base of their own between full-attention layers."""
    deepseek_v3 = "deepseek_v3"
    """DeepSeek-V3: multi-latent attention, dense first layers, then experts with a shared
    expert and a sigmoid router with a load-balancing bias and expert groups."""
    phi3 = "phi3"
    """Phi-3: the query, key and value projections fused into one ``qkv_proj`` (all queries,
    then keys, then values) and the gate and up projections into one ``gate_up_proj``."""


class NormPlacement(StrEnum):
    """Where a layer's two hidden-size norms sit (arch=llama)."""

    pre = "pre"
    """On the input of attention and of the MLP (Llama, GPT-2)."""
    post = "post"
    """On the output of attention and of the MLP, before the residual add; the inputs are not
    normalised (OLMo 2)."""
    pre_post = "pre_post"
    """Both: four norms a layer, on the inputs and on the outputs (Gemma 2 and 3)."""


class Activation(StrEnum):
    auto = "auto"
    """The architecture's own: SwiGLU for llama, exact (erf) GeLU for gpt2."""
    gelu = "gelu"
    """Exact GeLU (gpt2 arch)."""
    gelu_tanh = "gelu_tanh"
    """GeLU with the tanh approximation, GPT-2's original ("gelu_new" in Hugging Face); with
    arch=llama the gated MLP's activation (GeGLU, Gemma's "gelu_pytorch_tanh")."""


class RopeScaling(StrEnum):
    none = "none"
    """Plain RoPE frequencies."""
    llama3 = "llama3"
    """Llama 3.1's frequency scaling for long context (factor model.rope_scaling_factor; low and
    high frequency factors 1 and 4, original context 8,192, fixed by Megatron-Core)."""
    linear = "linear"
    """Positions divided by model.rope_scaling_factor (position interpolation; Gemma 3's global
    layers: 8)."""
    yarn = "yarn"
    """YaRN: frequencies interpolated by model.rope_scaling_factor below the yarn_beta range,
    kept above it, and attention sharpened by the yarn_mscale terms (DeepSeek-V3: factor 40
    over a 4,096-token original context); multi-latent attention only."""


class RouterScore(StrEnum):
    softmax = "softmax"
    """Expert probabilities from a softmax over the router's logits (Mixtral, Qwen3-MoE)."""
    sigmoid = "sigmoid"
    """Each expert's score is the sigmoid of its logit; the chosen experts' scores are
    renormalised to sum to 1 (DeepSeek-V3)."""


class Recompute(StrEnum):
    none = "none"
    """Keep every activation needed by the backward pass."""
    selective = "selective"
    """Recompute the core attention (softmax, dropout, scores x values) in the backward pass."""
    full = "full"
    """Keep only each transformer layer's input; recompute the whole layer in the backward pass."""


class Precision(StrEnum):
    auto = "auto"
    """bf16 where the device computes it fast (GPUs with bf16 tensor cores; CPUs with AMX or
    AVX512-BF16, confirmed by timing a short matmul), fp32 elsewhere; the plan says which and
    why (launcher/plan/precision.py). Resolved once per job, before anything is built."""
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"
    fp8 = "fp8"
    """bf16 training whose transformer-layer matrix multiplications (QKV, projection, MLP,
    experts) run in FP8 through Transformer Engine (recipe: trainer.fp8); embedding, output
    layer, attention core, norms and loss stay bf16. Needs a GPU with FP8 and engine=megatron."""


def is_fp8(precision: Precision | str) -> bool:
    """Whether ``precision`` (a Precision or its string) is fp8."""
    return precision == Precision.fp8


def compute_precision(precision: Precision | str) -> Precision:
    """The dtype of weights and activations outside FP8 GEMMs: bf16 for fp8, else ``precision``.
    ``auto`` has no dtype: the plan resolves it for the job before anything is built."""
    if precision == Precision.auto:
        raise ValueError("trainer.precision=auto reached a builder unresolved; the job's plan "
                         "resolves it (launcher.plan.precision.resolve_precision)")
    return Precision.bf16 if is_fp8(precision) else Precision(precision)


def loss_kernel(choice: "CrossEntropyFusion | str", *, precision: Precision | str, gpu: bool,
                te: bool) -> "CrossEntropyFusion":
    """The cross-entropy kernel ``trainer.cross_entropy_fusion=choice`` runs: ``te``, ``native``
    or ``off``. ``auto``: Transformer Engine's on a GPU in bf16 where TE imports (``te``),
    Megatron-Core's fused one without it; off on CPU and for fp32/fp16, where Megatron-Core's
    fused kernel would return bf16 logit gradients. Only ``te`` keeps no fp32 logits."""
    if choice != CrossEntropyFusion.auto:
        return CrossEntropyFusion(choice)
    if not gpu or compute_precision(precision) != Precision.bf16:  # fp8: the loss is bf16
        return CrossEntropyFusion.off
    return CrossEntropyFusion.te if te else CrossEntropyFusion.native


class Fp8Recipe(StrEnum):
    """How Transformer Engine scales FP8 tensors (megatron-core 0.16 ``fp8_recipe``)."""

    delayed = "delayed"
    """One scale per tensor from the amax history of earlier steps (TE DelayedScaling)."""
    tensorwise = "tensorwise"
    """One scale per tensor from its current amax (TE Float8CurrentScaling, TE >= 2.2)."""
    blockwise = "blockwise"
    """Scales per 1x128 / 128x128 block (TE Float8BlockScaling, TE >= 2.3; Hopper)."""
    mxfp8 = "mxfp8"
    """Hardware block scaling, one scale per 32 values (TE MXFP8BlockScaling; Blackwell only)."""


class Fp8Format(StrEnum):
    hybrid = "hybrid"
    """E4M3 for activations and weights, E5M2 (more range) for gradients."""
    e4m3 = "e4m3"
    """E4M3 everywhere."""


class AmaxAlgo(StrEnum):
    max = "max"
    """The largest amax of the history window."""
    most_recent = "most_recent"
    """The latest amax."""


class EngineName(StrEnum):
    deepspeed = "deepspeed"
    """DeepSpeed engine with ZeRO stages 0-3 around the Megatron-Core GPTModel."""
    megatron = "megatron"
    """Megatron-Core DDP + optimizer (zero_stage=1 means the distributed optimizer)."""


class OptimizerCheckpoint(StrEnum):
    dp_reshardable = "dp_reshardable"
    """Each rank writes its own shard as it is (the default, as Megatron-LM's): saves at about
    70% of the disk's write rate and about 5x faster loads than fully_reshardable, measured on
    CPU; a resume may change DP, another layout needs the checkpoint converted once with
    ``python -m launcher.convert reshard`` (or a new run from its weights, trainer.init_from)."""
    fully_reshardable = "fully_reshardable"
    """Optimizer state in model space: a resume may change TP, PP, VPP, CP, EP and DP. Every
    data-parallel rank first gathers the whole optimizer state (about 4x slower saves)."""


class Schedule(StrEnum):
    cosine = "cosine"
    """Linear warmup, then cosine decay from lr to min_lr over the remaining steps."""
    wsd = "wsd"
    """Warmup-stable-decay: linear warmup, constant lr, then decay over the last decay_fraction."""
    constant = "constant"
    """Linear warmup, then constant lr."""


class AttentionBackend(StrEnum):
    auto = "auto"
    """Flash attention (Transformer Engine) on a GPU, unfused attention on CPU."""
    flash = "flash"
    """Fused flash attention: attention scores are never stored."""
    unfused = "unfused"
    """Plain softmax(QK^T)V: scores (and their dropout mask) are stored for the backward pass."""


class CrossEntropyFusion(StrEnum):
    auto = "auto"
    """On a GPU with bf16: Transformer Engine's fused cross-entropy where TE is importable, else
    Megatron-Core's; off on CPU and for fp32/fp16."""
    te = "te"
    """Transformer Engine's parallel cross-entropy (GPU, bf16): the gradient is written into the
    bf16 logits, no fp32 copy of them is kept."""
    native = "native"
    """Megatron-Core's fused cross-entropy (bf16 only: it returns bf16 logit gradients)."""
    off = "off"
    """Megatron-Core's unfused vocab-parallel cross-entropy (an fp32 copy of the logits)."""


class LaunchMode(StrEnum):
    torchrun = "torchrun"
    """One elastic agent per node (srun, one task per node) with a c10d rendezvous on the first
    node; each agent composes and plans once and starts gpus_per_node training processes, which
    it watches for hangs and restarts inside the allocation (group resilience)."""
    srun = "srun"
    """One srun task per GPU; every task maps Slurm's variables to its rank and composes and
    plans the job itself. Nothing watches the tasks: no hang detection, no in-job restart."""


class DataFormat(StrEnum):
    text = "text"
    """Documents: every token trained (data_prep format=text, or mock data)."""
    chat = "chat"
    """Conversations packed into rows with a loss mask in <prefix>.mask.bin/.idx (data_prep
    format=chat); engine=megatron only."""


class GenerateFormat(StrEnum):
    text = "text"
    """The continuation (decoded, or its token ids without a tokenizer)."""
    json = "json"
    """One JSON object: prompt_ids, output_ids, text."""


class EvalFormat(StrEnum):
    text = "text"
    """One line per task: its metrics."""
    json = "json"
    """One JSON object: checkpoint, step, tasks (the scores), seconds."""


class PlanFormat(StrEnum):
    table = "table"
    json = "json"
    html = "html"
    """A self-contained HTML page with charts, written to plan.output (its path printed)."""


@dataclass
class ModelConfig:
    name: str = MISSING
    """Preset name, used in run names and reports."""
    arch: Arch = Arch.llama
    """Block flavour; sets norm, activation, position embedding and bias defaults (see Arch)."""
    num_layers: int = MISSING
    """Transformer layers."""
    hidden_size: int = MISSING
    """Model width h (elements)."""
    ffn_hidden_size: int = MISSING
    """MLP inner width (elements); for SwiGLU the width of each of the gate and up projections."""
    num_attention_heads: int = MISSING
    """Query heads."""
    num_query_groups: int = 0
    """Key/value heads for grouped-query attention; 0 = num_attention_heads (multi-head)."""
    kv_channels: int = 0
    """Per-head dimension; 0 = hidden_size / num_attention_heads."""
    vocab_size: int = MISSING
    """Tokenizer vocabulary (tokens), before padding (the plan reports the padding)."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this times tensor_parallel_size."""
    seq_length: int = MISSING
    """Training sequence length (tokens). The only place the sequence length is set."""
    max_position_embeddings: int = 0
    """Longest context the model supports (tokens): the rows of the learned position table
    (gpt2 arch), the context written to exported Hugging Face configs (llama arch);
    0 = seq_length."""
    rotary_base: int = 10000
    """RoPE base frequency (llama arch)."""
    rope_scaling: RopeScaling = RopeScaling.none
    """RoPE frequency scaling (llama arch; see RopeScaling)."""
    rope_scaling_factor: float = 8.0
    """rope_scaling=llama3: how much the low frequencies are slowed down (Llama 3.1: 8, 3.2: 32);
    rope_scaling=linear: what positions are divided by."""
    rope_original_max_positions: int = 0
    """rope_scaling=yarn: the context the model was pretrained at before scaling (tokens;
    DeepSeek-V3: 4,096); must be set with yarn, unused otherwise."""
    yarn_beta_fast: float = 32.0
    """rope_scaling=yarn: rotations over the original context above which a frequency is kept
    as it is."""
    yarn_beta_slow: float = 1.0
    """rope_scaling=yarn: rotations below which a frequency is fully interpolated."""
    yarn_mscale: float = 1.0
    """rope_scaling=yarn: the weight of log(factor) in the cos/sin magnitude's numerator."""
    yarn_mscale_all_dim: float = 0.0
    """rope_scaling=yarn: the weight of log(factor) in the denominator of that magnitude and in
    the attention scale, which is multiplied by (1 + 0.1 x this x log(factor))^2; 0 = neither."""
    rotary_base_local: int = 0
    """RoPE base frequency of the sliding-window layers, which take no rope_scaling (Gemma 3:
    10,000); 0 = rotary_base and rope_scaling, as every layer."""
    activation: Activation = Activation.auto
    """MLP activation; auto = the arch's own (see Activation); llama accepts auto (SwiGLU) and
    gelu_tanh (GeGLU)."""
    norm_epsilon: float = 1e-5
    """Epsilon of RMSNorm / LayerNorm."""
    untie_embeddings_and_output_weights: bool = True
    """True: separate output layer; False: the output layer reuses the input embedding."""
    add_bias_linear: bool = False
    """Biases in every linear layer."""
    add_qkv_bias: bool = False
    """Bias in the QKV projection only (Qwen style); implied by add_bias_linear."""
    hf_family: HfFamily = HfFamily.auto
    """The Hugging Face family the weights are named after when they are read from or written
    to a Hugging Face directory (an import sets it; auto: inferred from the features)."""
    window_size: int = 0
    """Sliding-window attention, in tokens: each token attends to itself and the
    window_size - 1 tokens before it, in every layer (Mistral's ``sliding_window``) or in all but
    every full_attention_every-th; 0 = full causal attention."""
    full_attention_every: int = 0
    """With window_size: layers N, 2N, 3N, ... (counted from 1) attend to every token before them,
    the others within the window (Gemma 3 uses 6); 0 = every layer within the window."""
    qk_layernorm: bool = False
    """A norm (the model's kind: RMSNorm for llama) of every query and key head over its head
    dimension, before RoPE and attention, one weight vector shared by the heads (Qwen3's
    q_norm/k_norm)."""
    qk_layernorm_all_heads: bool = False
    """With qk_layernorm: the query norm runs over all query heads of a token at once (one
    weight of heads x head-dimension elements) and the key norm over all key/value heads
    (OLMo 2's q_norm/k_norm), instead of over each head with one shared weight (Qwen3)."""
    norm_placement: NormPlacement = NormPlacement.pre
    """Where each layer's norms sit: pre = on the inputs of attention and MLP; post = on their
    outputs, before the residual add (OLMo 2); pre_post = both (Gemma 3). arch=llama only."""
    norm_zero_centered: bool = False
    """Every RMSNorm multiplies by 1 + weight, its weight stored as the offset from 1 (Gemma;
    Megatron-Core's layernorm_zero_centered_gamma)."""
    scale_embeddings: bool = False
    """The input embeddings multiplied by sqrt(hidden_size), rounded to the weights' dtype
    (Gemma)."""
    softmax_scale_dim: int = 0
    """Attention scores scaled by 1/sqrt(softmax_scale_dim) (Gemma 3's query_pre_attn_scalar);
    0 = kv_channels (the usual 1/sqrt(head dimension))."""
    kv_lora_rank: int = 0
    """Multi-latent attention (DeepSeek-V2/V3): keys and values are projected up from one
    compressed latent of this width (elements) per token; kv_channels is then the width of each
    head's unrotated query/key part; 0 = ordinary attention."""
    q_lora_rank: int = 0
    """With kv_lora_rank: queries projected up from a compressed latent of this width (elements);
    0 = queries projected from the hidden state directly (DeepSeek-V2-Lite)."""
    qk_rope_head_dim: int = 0
    """With kv_lora_rank: the rotated part of each query head (elements), and of the one rotated
    key all heads share."""
    v_head_dim: int = 0
    """With kv_lora_rank: value width per head (elements); 0 = kv_channels."""
    hidden_dropout: float = 0.0
    """Dropout probability after attention and MLP blocks."""
    attention_dropout: float = 0.0
    """Dropout probability on attention probabilities."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    num_experts: int = 0
    """Experts per MoE layer; 0 = dense model (no MoE)."""
    moe_router_topk: int = 2
    """Experts each token is routed to (MoE only)."""
    moe_ffn_hidden_size: int = 0
    """Inner width of each expert; 0 = ffn_hidden_size (MoE only)."""
    moe_aux_loss_coeff: float = 0.01
    """Weight of the load-balancing auxiliary loss (MoE only)."""
    moe_router_pre_softmax: bool = False
    """How the router weighs a token's top-k experts (MoE only). False: a softmax over the
    chosen experts' logits, which sum to 1 (Mixtral; Qwen3-MoE with ``norm_topk_prob``). True:
    the chosen experts' probabilities under a softmax over all experts, as they are (Qwen3-MoE
    without ``norm_topk_prob``)."""
    moe_capacity_factor: float = 0.0
    """Expert capacity as a multiple of the even share of tokens; 0 = no token dropping."""
    moe_router_score: RouterScore = RouterScore.softmax
    """How router logits become expert probabilities (MoE only; see RouterScore)."""
    moe_router_expert_bias: bool = False
    """A per-expert bias added to the scores when experts are chosen, not to their weights,
    nudged after each step toward balanced loads instead of an auxiliary loss (DeepSeek-V3's
    e_score_correction_bias; moe_router_score=sigmoid only)."""
    moe_router_groups: int = 0
    """Experts split into this many equal groups; a token first picks moe_router_group_topk
    groups by the sum of each group's two best scores, then its experts among them (DeepSeek-V3:
    8 of 256 experts); 0 = no groups."""
    moe_router_group_topk: int = 0
    """With moe_router_groups: groups each token picks."""
    moe_router_scaling: float = 1.0
    """The chosen experts' weights multiplied by this (DeepSeek-V3's routed_scaling_factor:
    2.5); 1 = as the router gives them."""
    moe_shared_expert_ffn_hidden_size: int = 0
    """Inner width of an MLP every token passes through beside its routed experts (DeepSeek's
    shared experts, as their count times moe_ffn_hidden_size); 0 = no shared expert."""
    moe_dense_layers: int = 0
    """The first this many layers have a dense MLP of width ffn_hidden_size instead of experts
    (3 in DeepSeek-V3); 0 = every layer a mixture of experts."""


@dataclass
class ParallelismConfig:
    tensor_parallel_size: int = 1
    """GPUs that split every layer's matrices (TP); 1 = no tensor parallelism."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (PP); 1 = no pipelining."""
    virtual_pipeline_parallel_size: int = 1
    """Model chunks per pipeline stage for the interleaved schedule; 1 = not interleaved."""
    context_parallel_size: int = 1
    """GPUs that split each sequence (CP); 1 = no context parallelism."""
    expert_parallel_size: int = 1
    """GPUs that split the experts of each MoE layer (EP); 1 = no expert parallelism."""
    sequence_parallel: bool = False
    """Shard norm/dropout activations along the sequence across the TP group (needs TP > 1)."""
    zero_stage: int = 1
    """DeepSpeed: ZeRO stage 0-3. Megatron engine: 0 = plain DDP, 1 = distributed optimizer."""
    offload_optimizer: bool = False
    """Keep optimizer state (and its step) in CPU memory (DeepSpeed ZeRO-Offload)."""
    offload_params: bool = False
    """Keep parameters in CPU memory between uses (DeepSpeed ZeRO-3 only)."""
    layers_in_first_stage: int = 0
    """Transformer layers on the first pipeline stage (Megatron-Core
    ``num_layers_in_first_pipeline_stage``); 0 = an even share. The other stages split the rest
    evenly. engine=megatron with pipeline_parallel_size > 1 only."""
    layers_in_last_stage: int = 0
    """Transformer layers on the last pipeline stage (Megatron-Core
    ``num_layers_in_last_pipeline_stage``); 0 = an even share. engine=megatron with
    pipeline_parallel_size > 1 only."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the input embedding as one layer of the first stage when splitting layers
    (Megatron-Core option of that name): every stage gets (layers + 1 [+ 1]) / PP, the first one
    layer fewer. Not together with layers_in_first_stage / layers_in_last_stage."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and loss as one layer of the last stage when splitting layers
    (Megatron-Core option of that name): the last stage builds one layer fewer. Not together
    with layers_in_first_stage / layers_in_last_stage."""


@dataclass
class DataConfig:
    name: str = MISSING
    """Data preset name."""
    prefixes: List[str] = field(default_factory=list)
    """Megatron indexed-dataset path prefixes (file names without .bin/.idx); empty = mock data."""
    weights: List[float] = field(default_factory=list)
    """Blend weight per prefix; empty = proportional to equal weights."""
    split: str = "98,1,1"
    """Train, validation, test proportions of every prefix."""
    eod_token_id: int = 0
    """End-of-document token id written by data_prep."""
    tokenizer_path: str = ""
    """Tokenizer file used by data_prep (for decoding samples); empty = none."""
    format: DataFormat = DataFormat.text
    """What the shards hold: text (documents, every token trained) or chat (data_prep
    format=chat: conversations packed into rows with a loss mask in <prefix>.mask.bin/.idx)."""
    num_workers: int = 2
    """DataLoader worker processes per rank; 0 = load in the training process."""
    cache_dir: str = ""
    """Where GPTDataset index caches go; empty = <run dir>/cache."""
    shard_cache_dir: str = ""
    """Where the shards of s3:// prefixes are copied before training reads them (once per node,
    shared by its ranks and later runs; docs/data_prep.md, Data on object storage); empty =
    $TRAINWRIGHT_CACHE/shards, by default ~/.cache/trainwright/shards."""
    shard_cache_gb: float = 0.0
    """Bound on that cache in GB (1e9 bytes): shards this run does not read are evicted, least
    recently used first, to keep under it; a run whose own shards exceed it is refused (exit
    2); 0 = no bound."""


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    """Optimizer; AdamW (decoupled weight decay) is the one supported."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to biases and norms)."""
    adam_beta1: float = 0.9
    """Adam decay rate of the first moment."""
    adam_beta2: float = 0.95
    """Adam decay rate of the second moment."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold; 0 = no clipping."""
    schedule: Schedule = Schedule.cosine
    """Learning-rate schedule (see Schedule)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""
    decay_fraction: float = 0.2
    """wsd only: fraction of all steps spent decaying to min_lr at the end."""


@dataclass
class Fp8Config:
    """FP8 settings, read only with trainer.precision=fp8 (group trainer, key fp8)."""

    recipe: Fp8Recipe = Fp8Recipe.delayed
    """Scaling recipe (see Fp8Recipe); mxfp8 needs Blackwell (cluster.gpu=B200)."""
    format: Fp8Format = Fp8Format.hybrid
    """FP8 encodings (see Fp8Format)."""
    amax_history_len: int = 1024
    """recipe=delayed: steps of amax history a scale is computed from (>= 1)."""
    amax_compute_algo: AmaxAlgo = AmaxAlgo.max
    """recipe=delayed: how the history becomes a scale (see AmaxAlgo)."""
    param_gather: bool = False
    """Keep the GEMM weights in FP8 and all-gather them in FP8 (half the bf16 bytes); needs
    engine=megatron with the distributed optimizer (parallelism.zero_stage=1)."""
    bf16_first_layers: int = 0
    """Transformer layers at the start of the model kept in bf16 (not with recipe=delayed)."""
    bf16_last_layers: int = 0
    """Transformer layers at the end of the model kept in bf16 (not with recipe=delayed)."""


@dataclass
class TrainerConfig:
    micro_batch_size: int = 1
    """Sequences per micro-batch on each data-parallel replica."""
    global_batch_size: int = 0
    """Sequences per optimizer step; 0 = micro_batch_size x data-parallel size (no accumulation)."""
    train_tokens: int = 0
    """Token budget; 0 = derived from train_steps. Set exactly one of the two."""
    train_steps: int = 0
    """Optimizer steps; 0 = derived from train_tokens. Set exactly one of the two."""
    precision: Precision = Precision.auto
    """Compute dtype of weights and activations (fp32 master weights under bf16/fp16/fp8);
    auto: bf16 where the device computes it fast, else fp32; fp8: bf16 with FP8 matrix
    multiplications in the transformer layers (see Precision)."""
    fp8: Fp8Config = field(default_factory=Fp8Config)
    """FP8 recipe and scaling settings (used with precision=fp8 only)."""
    activation_recompute: Recompute = Recompute.none
    """What the backward pass recomputes instead of storing (see Recompute)."""
    attention_backend: AttentionBackend = AttentionBackend.auto
    """Attention kernel; decides whether attention scores are stored (see AttentionBackend)."""
    cross_entropy_fusion: CrossEntropyFusion = CrossEntropyFusion.auto
    """Fused loss kernel (see CrossEntropyFusion); te keeps no fp32 copy of the logits."""
    seed: int = 1234
    """Seed of weights init, dropout and data order."""
    layout_invariant_init: bool = True
    """Draw every random weight from (seed, the tensor's global name, its tile), so every
    TP/PP/VPP/EP/CP layout and both engines start from the same weights; false = Megatron-Core's
    per-rank draw (different per layout). Ignored with init_from."""
    per_token_loss: Optional[bool] = None
    """Normalise the loss per target token over the whole global batch (Megatron-Core's
    calculate_per_token_loss: summed over micro-batches and replicas, divided by their target
    tokens), instead of a mean per micro-batch averaged over micro-batches; null = on for
    data.format=chat (where micro-batches hold different numbers of target tokens), off
    otherwise. engine=megatron only."""
    log_interval: int = 1
    """Optimizer steps between metric lines."""
    eval_interval: int = 0
    """Optimizer steps between validation passes; 0 = no validation."""
    eval_iters: int = 10
    """Micro-batches per validation pass."""
    save_interval: int = 0
    """Optimizer steps between checkpoints; 0 = only at the end."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after a new one is complete; 0 = all."""
    load: str = ""
    """Checkpoint to start from: a local step, checkpoints or run directory, or an
    ``s3://bucket/prefix`` (a committed step folder, or a prefix: its newest commit); empty =
    resume from the run's own latest (checkpoint_uri's when that is a store), if any."""
    checkpoint_uri: str = ""
    """Where the checkpoints live: empty = ``<run dir>/checkpoints``; ``s3://bucket/prefix`` =
    object storage with the S3 API (endpoint and credentials from the AWS chain, never from
    here: docs/storage.md), each step under ``<prefix>/step_<N>/`` and visible only once
    committed. The run directory's checkpoints/ then stages each save and keeps the newest
    as a cache for restarts."""
    checkpoint_retry_s: float = 0.0
    """Seconds a save (or a load) keeps retrying an object store's transient failures before it
    counts as failed; 0 means derived from the plan: 2 x the planned save time, at least 30 s and
    at most half the hang watchdog's first-phase allowance (resilience.first_phase_timeout_s)."""
    checkpoint_failures_allowed: int = 3
    """Saves in a row that may fail to reach the object store before the run ends (exit 4,
    never restarted: a requeue would lose its work the same way); each failure is one line and
    the run trains on; 0 = never end for it. The run's last save must succeed."""
    init_from: str = ""
    """Weights to start a new run from: a Hugging Face model directory, or a trainwright run,
    checkpoints or step directory (either engine, any layout). Weights only: the optimizer
    starts fresh at step 0. Ignored when the run directory already has a checkpoint (the run
    resumes from it). Without an explicit model=/model.* the model is read from there; empty =
    random initialisation."""
    async_save: bool = False
    """engine=megatron only (engine=deepspeed saves synchronously; true is a validation error
    there): write checkpoint tensors in a background process while training goes on
    (Megatron-Core async dist-checkpointing); the checkpoint is marked complete and becomes
    ``latest`` only once every rank's write has finished (checked each step, waited for at the
    next save and before the run exits). The last save of a run and a save on a stop request are
    written synchronously."""
    straggler_interval: int = 50
    """Optimizer steps between cross-rank comparisons of step and data-wait times; 0 = never."""
    straggler_threshold: float = 1.2
    """A rank slower than this multiple of the median step or data-wait time is named."""
    nan_policy: str = "abort"
    """On a non-finite loss or gradient norm: abort (exit non-zero, no checkpoint of the bad
    step) or skip (drop the step's update; abort after max_consecutive_skips in a row)."""
    max_consecutive_skips: int = 5
    """nan_policy=skip: consecutive skipped steps that abort the run."""
    spike_factor: float = 3.0
    """A loss above this multiple of the recent maximum is flagged as a spike; 0 = off."""
    stop_signal: str = "SIGUSR1"
    """Early-warning signal (besides SIGTERM) that makes every rank save and exit for requeue."""


class KubernetesApi(StrEnum):
    """Which Kubernetes API a ``cluster.launcher=kubernetes`` job is rendered for."""

    trainjob = "trainjob"
    """Kubeflow Trainer v2 (``trainer.kubeflow.org/v1alpha1``): a TrainJob and the
    TrainingRuntime it runs on (a JobSet template carrying the stop contract)."""
    jobset = "jobset"
    """A JobSet (``jobset.x-k8s.io/v1alpha2``) alone, for clusters without the Trainer; the
    rendezvous variables are set in the pod template."""
    pytorchjob = "pytorchjob"
    """training-operator v1 (``kubeflow.org/v1``) PyTorchJob, restartPolicy ExitCode; it cannot
    express the whole stop contract (docs/launching.md says where)."""


@dataclass
class VolumeConfig:
    """A PersistentVolumeClaim mounted into every pod of a Kubernetes job."""

    name: str = MISSING
    """Volume name in the pod spec (a DNS label: lower case, digits, '-')."""
    claim: str = MISSING
    """Name of the PersistentVolumeClaim (it must exist in cluster.namespace)."""
    mount_path: str = MISSING
    """Absolute path inside the container."""
    read_only: bool = False
    """Mount read-only (data); the run directory must be on a writable volume."""


@dataclass
class TolerationConfig:
    """A pod toleration (Kubernetes' own fields)."""

    key: str = ""
    """Taint key; empty with operator=Exists = every taint."""
    operator: str = "Exists"
    """Exists or Equal."""
    value: str = ""
    """Taint value (operator=Equal only)."""
    effect: str = ""
    """NoSchedule, PreferNoSchedule or NoExecute; empty = every effect."""


@dataclass
class SecretEnvConfig:
    """An environment variable of the pods read from a Kubernetes Secret (only the reference
    is ever written, never the value)."""

    name: str = MISSING
    """Variable name in the container, e.g. WANDB_API_KEY."""
    secret: str = MISSING
    """Secret name in cluster.namespace."""
    key: str = MISSING
    """Key inside the Secret."""


@dataclass
class ClusterConfig:
    name: str = MISSING
    """Cluster preset name."""
    launcher: str = "local"
    """How processes start: local (this machine), slurm (launcher.submit renders an sbatch
    script) or kubernetes (launcher.submit renders cluster.kubernetes_api's manifests)."""
    nodes: int = 1
    """Machines in the job."""
    gpus_per_node: int = 1
    """Accelerators per machine; on CPU clusters, training processes per machine."""
    ranks_per_gpu: int = 1
    """Training processes per accelerator: 1 = one training process per GPU; N > 1 (development
    only, local launcher): N processes share each GPU, each its own NCCL host id, world =
    nodes x gpus_per_node x ranks_per_gpu. The plan refuses it when N x the memory of one rank
    exceeds the GPU's memory, and with launcher=slurm."""
    gpu: str = MISSING
    """Accelerator model, a key of launcher.plan.hardware.DEVICES (H100, H200, A100, cpu, ...)."""
    device_memory_gb: float = 0.0
    """Usable memory per accelerator (GB, 1e9 bytes); 0 = the model's catalogue value."""
    peak_tflops: float = 0.0
    """Dense peak TFLOP/s per accelerator at the training precision (bf16 for trainer.precision=
    fp8, whose FP8 matmul peak stays the catalogue's); 0 = catalogue value."""
    partition: str = ""
    """Slurm partition; empty = the cluster's default."""
    account: str = ""
    """Slurm account; empty = the user's default."""
    time_limit: str = "04:00:00"
    """Slurm wall-clock limit (HH:MM:SS or D-HH:MM:SS)."""
    cpus_per_task: int = 0
    """Slurm CPUs per training process (per agent in torchrun mode: times gpus_per_node);
    0 = the cluster's default."""
    mem: str = ""
    """Slurm memory per node (``--mem``, e.g. 0 for all, 512G); empty = the cluster's default."""
    qos: str = ""
    """Slurm quality of service; empty = the account's default."""
    exclusive: bool = False
    """Ask Slurm for whole nodes (``--exclusive``)."""
    constraint: str = ""
    """Slurm node features the nodes must have (``--constraint``); empty = any."""
    container_image: str = ""
    """Container image: for Slurm, of every srun task (pyxis ``--container-image``; empty = no
    container); for Kubernetes, of every pod (required), with trainwright installed."""
    container_mounts: str = ""
    """pyxis ``--container-mounts`` (``src:dst[,src:dst]``); only with container_image."""
    signal_lead_s: int = 120
    """Seconds before the time limit at which Slurm sends trainer.stop_signal to the training
    processes (``--signal``); 0 = no early warning."""
    max_restarts: int = 3
    """Times the job requeues itself after a stop for requeue (exit 75); other failures never
    requeue (they are restarted inside the allocation: resilience.restarts_in_job)."""
    mtbf_hours: float = 6330.0
    """Mean time between interruptions of ONE node (hours): failures of its GPUs, host, network
    or software that stop the job. The job's MTBF is this / cluster.nodes. The default is Llama 3
    405B's pre-training: 419 interruptions in 54 days on 2,048 nodes of 8 H100 (one every 3.1 h
    for the job). The plan turns it into the expected goodput and the best save interval."""
    checkpoint_gbps_per_node: float = 1.0
    """Rate at which each node writes (and reads) its share of a checkpoint, GB/s (1e9 bytes);
    the plan's save and load times assume every node writes in parallel at this rate."""
    store_gbps_per_node: float = 1.0
    """With trainer.checkpoint_uri=s3://...: rate at which each node uploads its share of a
    checkpoint to the object store, and downloads a whole one on a resume, GB/s (1e9 bytes).
    The plan adds the upload to the save time (in the background: the loop stalls for the
    local write only) and the download to every restart."""
    kubernetes_api: KubernetesApi = KubernetesApi.trainjob
    """launcher=kubernetes: which API launcher.submit renders (see KubernetesApi)."""
    namespace: str = "default"
    """launcher=kubernetes: namespace of the job, its PVCs and Secrets."""
    gpu_resource: str = "nvidia.com/gpu"
    """launcher=kubernetes: extended resource name of the accelerators; each pod asks for
    gpus_per_node of it (nothing on CPU clusters)."""
    pod_memory: str = ""
    """launcher=kubernetes: memory request and limit of each pod, a Kubernetes quantity
    (e.g. 1600Gi); empty = none set. The CPU request is cpus_per_task x gpus_per_node."""
    shm_size: str = "64Gi"
    """launcher=kubernetes: size of the in-memory /dev/shm of each pod (Kubernetes' default
    64 MB breaks NCCL and DataLoader workers), a Kubernetes quantity."""
    working_dir: str = ""
    """launcher=kubernetes: working directory of the container, absolute; a relative
    run.output_root (and data path) resolves against it. Empty = the image's own."""
    volumes: List[VolumeConfig] = field(default_factory=list)
    """launcher=kubernetes: PersistentVolumeClaims mounted into every pod. The run directory
    must lie on a writable one: the container's own disk is lost with the pod."""
    node_selector: Dict[str, str] = field(default_factory=dict)
    """launcher=kubernetes: node labels the pods must match; empty = any node."""
    tolerations: List[TolerationConfig] = field(default_factory=list)
    """launcher=kubernetes: taints the pods tolerate (e.g. nvidia.com/gpu:NoSchedule)."""
    priority_class: str = ""
    """launcher=kubernetes: PriorityClass of the pods; empty = the cluster's default."""
    queue: str = ""
    """launcher=kubernetes: Kueue LocalQueue; set = the job is labelled for it and created
    suspended, for Kueue to admit. Empty = no Kueue."""
    service_account: str = ""
    """launcher=kubernetes: ServiceAccount of the pods; empty = the namespace's default."""
    image_pull_secrets: List[str] = field(default_factory=list)
    """launcher=kubernetes: Secrets holding registry credentials for container_image."""
    env: Dict[str, str] = field(default_factory=dict)
    """launcher=kubernetes: plain environment variables of the containers (NCCL settings,
    cache paths). Never secrets: a name that looks like one is refused (use secret_env)."""
    secret_env: List[SecretEnvConfig] = field(default_factory=list)
    """launcher=kubernetes: variables read from Secrets (secretKeyRef), e.g. WANDB_API_KEY."""
    env_from_secrets: List[str] = field(default_factory=list)
    """launcher=kubernetes: Secrets whose every key becomes a variable (envFrom)."""
    termination_grace_s: int = 0
    """launcher=kubernetes: seconds between the SIGTERM of a preemption or drain and the
    SIGKILL (terminationGracePeriodSeconds): the stop must finish its step and save in it.
    0 = twice the plan's step plus its save, and 60 s more."""


@dataclass
class ResilienceConfig:
    """Hang detection and in-job restarts (docs/training.md, "When things go wrong")."""

    hang_timeout_s: float = 0.0
    """Seconds without progress (no rank entering a new phase of a step, save or evaluation)
    after which the job is declared hung: stacks are written, the ranks are killed and the
    job is restarted. 0 = automatic (auto_timeout_factor x the longest phase seen so far on
    any rank, saves and evaluations included, never below auto_timeout_floor_s). In both
    modes start-up and a phase not seen yet (the first step, the first save) get
    first_phase_timeout_s. A negative value turns hang detection off."""
    auto_timeout_factor: float = 5.0
    """hang_timeout_s=0: the timeout is this multiple of the longest phase seen so far."""
    auto_timeout_floor_s: float = 60.0
    """hang_timeout_s=0: the automatic timeout never goes below this (seconds)."""
    first_phase_timeout_s: float = 0.0
    """Seconds allowed for start-up (import, build, checkpoint load) and for each kind of phase
    the first time an attempt runs it (a slow first step, the first save), whether
    hang_timeout_s is fixed or automatic. 0 means derived from the plan (the longest of 300 s,
    10 x the planned start-up and load, 20 x the planned step and 3 x the planned save or
    validation pass; launcher/plan/resilience.py): a run stuck in start-up is found in minutes,
    not the 30 of torch's collective timeout."""
    restarts_in_job: int = 3
    """Times the launcher restarts every rank inside the same allocation (from the latest
    complete checkpoint) after a rank dies, hangs or exits with an error; 0 = never. Config
    errors (exit 2), non-finite losses (3) and stops for requeue (75) are never restarted, nor
    a job that failed again without completing a step since its last restart."""
    stack_dumps: bool = True
    """On a hang, write every rank's Python stack to <run_dir>/hangs/attempt_<n>/rank_<r>.txt
    (read from outside the process with py-spy when it is installed, so a stopped or
    deadlocked rank is read too); false = name the ranks and phases only."""
    collective_timeout_s: float = 0.0
    """Timeout of every collective of the process group (seconds); 0 = automatic: the longer
    of 30 minutes and twice the hang timeout, so hang detection (which names the ranks and
    writes stacks) always fires first."""


@dataclass
class EngineConfig:
    name: EngineName = EngineName.deepspeed
    """Which library owns data parallelism and the optimizer (see EngineName)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and all-reduce gradients in fp32 (else in the compute dtype)."""
    overlap_grad_reduce: bool = True
    """Overlap the gradient reduce with the backward pass."""
    overlap_param_gather: bool = False
    """Megatron distributed optimizer: overlap the parameter all-gather with the forward pass."""
    reduce_bucket_size: int = 50_000_000
    """Elements per gradient-reduce bucket."""
    optimizer_checkpoint: OptimizerCheckpoint = OptimizerCheckpoint.dp_reshardable
    """engine=megatron with the distributed optimizer (zero_stage=1): how its state is saved
    (see OptimizerCheckpoint); ignored otherwise."""


@dataclass
class LoggerConfig:
    name: str = "none"
    """none or wandb."""
    tensorboard: bool = False
    """Also write TensorBoard event files (the keys wandb gets) under <run_dir>/tensorboard/;
    a restart appends to the same directory, purging the steps it recomputes. logger=tensorboard
    selects it alone, logger=[wandb,tensorboard] both."""
    project: str = "trainwright"
    """wandb project."""
    entity: str = ""
    """wandb entity (team); empty = the API key's default."""
    group: str = ""
    """wandb group; empty = the sweep name for multiruns, else none."""
    tags: List[str] = field(default_factory=list)
    """wandb tags."""
    mode: str = "online"
    """wandb mode: online, offline or disabled (WANDB_MODE overrides it)."""


@dataclass
class RunConfig:
    name: str = ""
    """Run directory name under output_root; empty = <model>_<cluster>."""
    output_root: str = "outputs"
    """Folder holding every run directory."""
    verbose: bool = False
    """false: the console shows step lines, events and errors, and each training process's
    library output (warnings, banners, memory reports) goes to <run_dir>/logs/rank_<r>.log;
    true: everything on the console too."""
    report: bool = True
    """Write <run_dir>/report.html (python -m launcher.report --format html) when the run ends,
    however it ends, and print its path; false: leave it to a later launcher.report."""


@dataclass
class PlanConfig:
    format: PlanFormat = PlanFormat.table
    """table (readable), json (one JSON object on stdout) or html (a page with charts)."""
    output: str = ""
    """plan.format=html (and search.format=html): the file written; empty = plan.html
    (search.html) in the current directory."""
    mfu: float = 0.0
    """0 = step time from the step-time model (launcher/plan/step_time.py: compute, TP/CP/EP/DP
    communication, pipeline bubble, optimizer, per layout). A value in (0, 1] = the old flat
    assumption instead: model FLOPs utilisation while computing, the pipeline bubble on top."""
    profile_dir: str = ""
    """Directory of stored machine profiles (launcher/plan/profile.py); empty =
    $TRAINWRIGHT_PROFILE_DIR, else ~/.cache/trainwright/profiles."""
    calibrate: bool = False
    """Before planning a job on this machine: when no stored profile measured its model and
    layout, run ``python -m launcher.probe`` with the same overrides first (well under a minute
    on 2 CPU ranks), so that the plan's step time is measured, not the catalogue's."""


@dataclass
class SearchConfig:
    """``python -m launcher.search``: which layouts to try and how to report them."""

    headroom: float = 0.10
    """Fraction of each GPU's memory a candidate must leave free (0-1); 0.10 = use at most 90%."""
    top_k: int = 10
    """Candidates printed, best predicted step time first."""
    format: PlanFormat = PlanFormat.table
    """table (readable), json (one JSON object on stdout) or html (every candidate plotted,
    written to plan.output)."""
    engines: List[str] = field(default_factory=list)
    """Engines to try (megatron, deepspeed); empty = every registered engine."""
    max_micro_batch_size: int = 8
    """Largest trainer.micro_batch_size tried (sequences); the search tries the divisors of the
    per-replica batch up to it."""
    max_tensor_parallel_nodes: int = 1
    """Nodes a tensor-parallel group may span (1 = TP within a node); more lets the search
    show what TP across nodes costs."""
    measure: int = 0
    """Run the best K candidates for measure_steps steps each through launcher.train on this
    machine and re-rank them by measured step time; 0 = predict only."""
    measure_steps: int = 4
    """Optimizer steps of each measured run (search.measure); the first is not timed."""


@dataclass
class GenerateConfig:
    prompt: str = ""
    """Text to continue (encoded with the checkpoint's tokenizer); empty = use prompt_ids."""
    prompt_ids: List[int] = field(default_factory=list)
    """Token ids to continue (instead of prompt)."""
    max_new_tokens: int = 32
    """Tokens to generate after the prompt."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches this;
    1.0 = the whole vocabulary."""
    seed: int = 0
    """Seed of the sampling generator (the same on every rank)."""
    format: GenerateFormat = GenerateFormat.text
    """text (the continuation) or json (one object: prompt_ids, output_ids, text)."""
    tokenizer: str = ""
    """A tokenizer.json or an HF directory holding one; empty = the checkpoint's own (the HF
    directory's, or the tokenizer the run's data was prepared with)."""
    logits_file: str = ""
    """Write the prompt's logits (fp32, [prompt tokens, vocab], .npy) here; empty = none."""
    chat: bool = False
    """Render generate.prompt as one user turn with the chat template (and its generation
    prompt), and stop at the template's end-of-turn token."""
    chat_template: str = ""
    """generate.chat's template: empty = the checkpoint's (a Hugging Face directory's
    tokenizer_config.json, or the one a data.format=chat run was prepared with); a shipped name
    (llama3, chatml, plain) or a .jinja file."""


@dataclass
class LaunchConfig:
    mode: LaunchMode = LaunchMode.torchrun
    """How a Slurm job starts its training processes (see LaunchMode)."""
    rdzv_port: int = 29500
    """torchrun mode: TCP port of the c10d rendezvous on the job's first node."""


@dataclass
class SubmitConfig:
    dry_run: bool = False
    """launcher.submit: print the sbatch script instead of writing and submitting it."""


class Objective(StrEnum):
    auto = "auto"
    """The final validation loss, else (no evaluation ran) the final training loss."""
    val_loss = "val_loss"
    """The final validation loss; a point without one fails."""
    train_loss = "train_loss"
    """The final training loss."""


@dataclass
class SweepConfig:
    objective: Objective = Objective.auto
    """What each point of ``launcher.train -m`` returns to Hydra's sweeper (nats/token; Optuna,
    Nevergrad and Ax minimise it). A point that diverged (non-finite loss, exit 3) returns NaN,
    which Optuna records as a failed trial; one that failed otherwise raises."""


@dataclass
class EvalConfig:
    """Downstream tasks scored during training (lm-evaluation-harness's task format; docs/eval.md)."""

    tasks: List[str] = field(default_factory=list)
    """Task names, found in the shipped tasks (launcher/core/shipped_tasks: tw_facts, tw_paragraphs)
    and in include_path; empty = no downstream evaluation."""
    include_path: List[str] = field(default_factory=list)
    """Folders of task YAML files (as lm-evaluation-harness's --include_path), data files on disk
    (data_files relative to their YAML); empty = the shipped tasks only."""
    interval: int = 0
    """Steps between in-loop evaluations of eval.tasks; 0 = only after the last step."""
    limit: int = 0
    """Examples per task; 0 = all."""
    pack_length: int = 0
    """Tokens of one sequence that scored rows are packed into, several to it, each attending
    to itself only (launcher/evals/rows.py); at most model.seq_length. 0 = chosen for the
    attention: model.seq_length under Transformer Engine (THD sequences), and on the local
    attention (an explicit mask, quadratic in the pack) the length where attending over the
    pack adds at most 5% to a token's FLOPs (0.3 x hidden_size). A length below every row's
    (e.g. 1) packs nothing: one row per sequence."""
    at_end: bool = True
    """Also score the tasks after the last step (when eval.tasks is set)."""
    tokenizer: str = ""
    """tokenizer.json the tasks' text is encoded with; empty = the run's (data.tokenizer_path,
    or the tokenizer of the shards' manifest)."""
    format: EvalFormat = EvalFormat.text
    """python -m launcher.evaluate's output: text (a line per task) or json (one object)."""
    contamination: bool = False
    """Check eval.tasks against the run's own shards once before launch (python -m
    data_prep.contamination, cached beside the shards by their manifest): each score is then
    reported beside its score on the examples not found there (eval/<task>/<metric>_clean)."""
    ngram: int = 8
    """Tokens per n-gram of the contamination check (8: Llama 3's)."""
    threshold: float = 0.5
    """Share of an example's n-grams found in the shards from which it counts as contaminated."""
    contaminated: Dict[str, List[int]] = field(default_factory=dict)
    """{task: contaminated examples' indices in its evaluation split}: set by the launcher with
    eval.contamination (empty = none found, or not checked)."""
    asynchronous: bool = False
    """Score every saved checkpoint in its own job instead of in the loop (also written
    eval.async=true): the run's launch path starts it (a local process, a Slurm job, a Kubernetes
    Job; training never waits on it); scores land in <run>/evals/ keyed by step and tokens and
    are merged once into metrics.jsonl, wandb, TensorBoard and the report."""
    job_overrides: List[str] = field(default_factory=list)
    """Overrides of each checkpoint's eval job (python -m launcher.evaluate: its layout and
    cluster, e.g. [cluster.gpus_per_node=2,parallelism.tensor_parallel_size=2]); empty = one
    process at the default layout on the training's cluster."""
    output: str = ""
    """JSON file python -m launcher.evaluate also writes its scores to (atomically); empty =
    printed only."""
    samples: str = ""
    """JSON Lines file python -m launcher.evaluate writes every example's scored requests to
    (atomically; one line per example: task, doc_id, target and resps, the scores of its
    requests as lm-evaluation-harness's --log_samples records them); empty = not written."""
    rows: int = 0
    """Scored rows of one evaluation of eval.tasks (a request; a rolling text counts its
    windows); 0 means the launcher counts them from the tasks before it plans (python -m
    launcher.plan alone does not count them and leaves them unpriced)."""
    tokens: int = 0
    """Tokens the forward passes of one evaluation compute (the rows packed into sequences and
    padded as their micro-batches pad them: launcher/evals/rows.py), what the plan prices;
    counted with eval.rows (0 with rows set: priced as rows of model.seq_length tokens)."""


@dataclass
class TrainwrightConfig:
    model: ModelConfig = MISSING
    """Architecture (group model)."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """How the model and data are split over GPUs (group parallelism)."""
    data: DataConfig = MISSING
    """Training data (group data)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule (group optimizer)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Batch, budget, precision and loop settings (group trainer)."""
    cluster: ClusterConfig = MISSING
    """Machines and accelerators (group cluster)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """DeepSpeed or Megatron-Core data parallelism and optimizer (group engine)."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Experiment tracking (group logger)."""
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    """Hang detection and in-job restarts (group resilience)."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run directory naming."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """Plan output and estimates."""
    search: SearchConfig = field(default_factory=SearchConfig)
    """Layout search options (python -m launcher.search)."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """How a Slurm job starts the training processes (launcher.submit)."""
    submit: SubmitConfig = field(default_factory=SubmitConfig)
    """launcher.submit options."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """launcher.train -m options (what a point returns to an optimising sweeper)."""
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    """launcher.generate options."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Downstream evaluation: tasks, interval, limit (group eval)."""


def register_configs() -> None:
    """Register the root schema; conf/config.yaml lists it first in its defaults."""
    ConfigStore.instance().store(name="trainwright_schema", node=TrainwrightConfig)


register_configs()
