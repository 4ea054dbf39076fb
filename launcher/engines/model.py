"""Translate trainwright's config into Megatron-Core objects: the one place that does so.

:func:`transformer_config` maps ModelConfig / ParallelismConfig / TrainerConfig onto a
``TransformerConfig``; :func:`build_gpt_model` builds the ``GPTModel`` of one pipeline stage;
:func:`init_parallel_state` sets up Megatron's process groups and RNG streams.

Transformer Engine layer specs are used when TE is importable and CUDA is available, the local
(pure PyTorch) specs otherwise. Under bf16/fp16 the model's parameters are created in that dtype;
wrapping it for mixed precision (Float16Module, fp32 master weights) is the engine's job.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from launcher.config import (Activation, AmaxAlgo, Arch, AttentionBackend, CrossEntropyFusion,
                             Fp8Format, Fp8Recipe, ModelConfig, ParallelismConfig, Precision,
                             Recompute, RopeScaling, TrainerConfig, compute_precision, is_fp8,
                             loss_kernel)
from launcher.engines.layer_spec import block_spec
from launcher.shape import ResolvedModel

__all__ = [
    "KernelUnavailable",
    "cross_entropy_fields",
    "build_gpt_model",
    "fp8_fields",
    "init_parallel_state",
    "reset_parallel_state",
    "runnable_attention",
    "transformer_config",
    "use_transformer_engine",
]

_DTYPES = {
    Precision.bf16: torch.bfloat16,
    Precision.fp16: torch.float16,
    Precision.fp32: torch.float32,
}


def use_transformer_engine() -> bool:
    """True when Transformer Engine is importable (and not hidden by TRAINWRIGHT_DISABLE_TE) and a
    CUDA device is present."""
    from launcher.engines.compat import transformer_engine_available

    return torch.cuda.is_available() and transformer_engine_available()


class KernelUnavailable(Exception):
    """The config asks for an attention kernel this machine cannot run (a config error)."""


def runnable_attention(trainer: TrainerConfig, *, planned_flash: bool, gpu: Optional[bool] = None,
                       te: Optional[bool] = None) -> tuple[TrainerConfig, Optional[str]]:
    """``trainer`` with the attention backend this process will really run, and a note.

    On a GPU the plan counts flash attention (no stored scores) for ``auto``; Megatron-Core
    runs it only through Transformer Engine. Without TE the model falls back to Megatron-Core's
    unfused attention, which keeps about 6 bytes per score: the returned config says
    ``unfused`` so that the plan is recomputed (and refused if it no longer fits) before
    anything is built. ``flash`` asked for explicitly without TE raises KernelUnavailable.
    """
    gpu = torch.cuda.is_available() if gpu is None else gpu
    te = use_transformer_engine() if te is None else te
    fp8_problems = fp8_unavailable(trainer, gpu=gpu, te=te)
    if fp8_problems:
        raise KernelUnavailable("; and ".join(fp8_problems))
    cross_entropy_fields(trainer, gpu=gpu, te=te)  # te asked for without TE: refused here
    runs = _loss_kernel(trainer, gpu=gpu, te=te)
    if runs != _loss_kernel(trainer, gpu=gpu, te=True):  # auto planned TE's loss (no fp32 logits)
        trainer = dataclasses.replace(trainer, cross_entropy_fusion=CrossEntropyFusion(runs))
    if not (planned_flash and gpu and not te):
        return trainer, None
    if trainer.attention_backend == AttentionBackend.flash:
        raise KernelUnavailable(
            "trainer.attention_backend=flash needs Transformer Engine, which is not importable "
            "here; install transformer-engine[pytorch] or set trainer.attention_backend=unfused")
    note = ("Transformer Engine is not installed: attention runs unfused (scores stored), so the "
            "plan was recomputed with trainer.attention_backend=unfused; install "
            "transformer-engine[pytorch] for flash attention")
    return dataclasses.replace(trainer, attention_backend=AttentionBackend.unfused), note


def context_parallel_unavailable(parallelism: ParallelismConfig,
                                 te: Optional[bool] = None) -> Optional[str]:
    """Why this process cannot run ``parallelism.context_parallel_size`` > 1 (None when it can):
    Megatron-Core 0.16 splits attention over context-parallel ranks only in Transformer Engine's
    attention (``TEDotProductAttention``; its own asserts so when the layer is built)."""
    te = use_transformer_engine() if te is None else te
    if parallelism.context_parallel_size == 1 or te:
        return None
    return (f"parallelism.context_parallel_size={parallelism.context_parallel_size} runs "
            "attention through Transformer Engine (Megatron-Core's only context-parallel "
            "attention), which is not usable here (it needs a CUDA GPU and transformer-engine"
            "[pytorch]); set parallelism.context_parallel_size=1")


FP8_CAPABILITY = (8, 9)
"""CUDA compute capability of the first FP8 tensor cores (Ada; Hopper is 9.0)."""
MXFP8_CAPABILITY = (10, 0)
"""Blackwell: hardware-scaled MXFP8 blocks."""


def fp8_unavailable(trainer: TrainerConfig, *, gpu: bool, te: bool,
                    capability: Optional[tuple] = None) -> list:
    """Why this process cannot run ``trainer.precision=fp8`` (empty when it can, or when the
    precision is not fp8): no GPU, no Transformer Engine, a GPU older than the recipe needs
    (``capability``: the GPU's (major, minor), read from CUDA when None)."""
    if not is_fp8(trainer.precision):
        return []
    if not gpu:
        return ["trainer.precision=fp8 needs a CUDA GPU with FP8 tensor cores and none is "
                "visible here; set trainer.precision=bf16"]
    out = []
    if not te:
        out.append("trainer.precision=fp8 runs its GEMMs through Transformer Engine, which is "
                   "not importable here; install transformer-engine[pytorch] or set "
                   "trainer.precision=bf16")
    capability = capability or torch.cuda.get_device_capability()
    recipe = Fp8Recipe(trainer.fp8.recipe)
    need = MXFP8_CAPABILITY if recipe == Fp8Recipe.mxfp8 else FP8_CAPABILITY
    if tuple(capability) < need:
        cc = ".".join(map(str, capability))
        out.append(f"trainer.fp8.recipe={recipe.value} needs compute capability "
                   f"{'.'.join(map(str, need))}+ and this GPU has {cc} (does cluster.gpu name "
                   "the GPU the job runs on?); use trainer.precision=bf16"
                   + (" or recipe=tensorwise" if recipe == Fp8Recipe.mxfp8 else ""))
    return out


def cross_entropy_fields(trainer: TrainerConfig, *, gpu: Optional[bool] = None,
                         te: Optional[bool] = None) -> dict:
    """TransformerConfig's loss-fusion fields for ``trainer.cross_entropy_fusion`` on this
    process (``auto``: TE's on a GPU in bf16 when TE imports, else Megatron-Core's; off on CPU
    and for fp32/fp16, because the fused kernels return bf16 gradients). ``te`` asked for
    without Transformer Engine raises KernelUnavailable."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    te = use_transformer_engine() if te is None else te
    choice = _loss_kernel(trainer, gpu=gpu, te=te)
    if choice == "te" and not te:
        raise KernelUnavailable(
            "trainer.cross_entropy_fusion=te needs Transformer Engine, which is not importable "
            "here; install transformer-engine[pytorch] or set trainer.cross_entropy_fusion=native")
    if choice == "off":
        return {"cross_entropy_loss_fusion": False}
    return {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": str(choice)}


def _loss_kernel(trainer: TrainerConfig, *, gpu: bool, te: bool) -> str:
    return loss_kernel(trainer.cross_entropy_fusion, precision=trainer.precision, gpu=gpu, te=te)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GeLU with the tanh approximation (GPT-2's own; Hugging Face's "gelu_new")."""
    return F.gelu(x, approximate="tanh")


def activation_function(model: ModelConfig, *, fused: bool = False):
    """The MLP activation of ``model``: SiLU (gated: SwiGLU) or tanh GeLU (GeGLU) for llama,
    exact or tanh GeLU for gpt2; ValueError for llama with exact GeLU.

    With ``fused`` (bias-activation fusion) tanh GeLU is spelled ``F.gelu``: Megatron-Core
    0.16 recognises the activation by identity and its fused bias-GeLU kernel is the tanh
    approximation (megatron/core/fusions/fused_bias_gelu.py)."""
    activation = Activation(model.activation)
    if model.arch == Arch.llama:
        if activation == Activation.gelu:
            raise ValueError("model.activation=gelu with model.arch=llama: a llama MLP is SwiGLU "
                             "(auto) or GeGLU with tanh GeLU (gelu_tanh); set one of them")
        if activation == Activation.auto:
            return F.silu
    if activation == Activation.gelu_tanh:
        return F.gelu if fused else _gelu_tanh
    return F.gelu


def _arch_fields(model: ModelConfig, resolved: ResolvedModel) -> dict:
    """Norm, MLP activation and bias settings that follow from the architecture."""
    fusions = _fusion_fields(model, gpu=torch.cuda.is_available(), te=use_transformer_engine())
    return dict(
        normalization=resolved.normalization,
        gated_linear_unit=resolved.gated,
        activation_func=activation_function(model, fused=fusions["bias_activation_fusion"]),
        add_bias_linear=resolved.bias,
        add_qkv_bias=resolved.qkv_bias,
        # Megatron-Core's QK norms are per head; OLMo 2's over all heads are in our layer spec
        qk_layernorm=resolved.qk_norm and not resolved.qk_all_heads,
        # Megatron-Core's (left, right) window: the window_size - 1 tokens before, none after
        window_size=(resolved.window - 1, 0) if resolved.window else None,
        window_attn_skip_freq=resolved.full_every or None,  # layers N, 2N, ... attend fully
        softmax_scale=None if resolved.softmax_dim == resolved.head_dim
        else resolved.softmax_dim ** -0.5,
        masked_softmax_fusion=False,  # needs Megatron-LM's compiled softmax kernels
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,  # needs main_grad, which DeepSpeed does not have
        **fusions,
    )


def _fusion_fields(model: ModelConfig, *, gpu: bool, te: bool) -> dict:
    """Fused kernels, on a GPU only (on a CPU they would be compiled for no gain).

    The fused bias-SwiGLU/GeLU keeps only its input for backward (the plan counts 3 x ffn
    values per token for a gated MLP; unfused SwiGLU keeps 4). Megatron-Core's fused bias-GeLU
    needs a bias and computes the tanh approximation, so it serves only
    ``model.activation=gelu_tanh``; exact GeLU stays unfused. The fused RoPE comes from
    Transformer Engine.
    """
    gated = model.arch == Arch.llama
    tanh = Activation(model.activation) == Activation.gelu_tanh
    return dict(
        bias_activation_fusion=gpu and (gated or (model.add_bias_linear and tanh)),
        bias_dropout_fusion=gpu,
        apply_rope_fusion=gpu and te and model.arch == Arch.llama,
    )


def _moe_fields(model: ModelConfig, resolved: ResolvedModel, parallelism: ParallelismConfig,
                fp8: bool) -> dict:
    """Mixture-of-experts settings; empty for a dense model. ``fp8``: each expert's tokens are
    padded to TE's FP8 alignment, which only the alltoall dispatcher does."""
    if resolved.experts <= 0:
        return {}
    alltoall = torch.cuda.is_available() and (parallelism.expert_parallel_size > 1 or fp8)
    return dict(
        num_moe_experts=resolved.experts,
        moe_router_topk=resolved.topk,
        moe_ffn_hidden_size=resolved.expert_ffn,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_router_load_balancing_type="aux_loss",
        moe_expert_capacity_factor=model.moe_capacity_factor or None,
        # The alltoall dispatcher creates a torch.cuda.Stream (token_dispatcher.py); without
        # CUDA the allgather dispatcher does expert parallelism instead.
        moe_token_dispatcher_type="alltoall" if alltoall else "allgather",
        moe_grouped_gemm=False,
        **_router_fields(resolved),
    )


def _router_fields(r: ResolvedModel) -> dict:
    """DeepSeek-V3's router and MLP layout, in Megatron-Core's names: sigmoid scores with a
    load-balancing bias, expert groups, a factor on the chosen weights, a shared expert and
    dense first layers (``moe_layer_freq``: 0 = dense, 1 = experts, per layer)."""
    fields: dict = dict(moe_router_score_function=r.score.value,
                        moe_router_enable_expert_bias=r.expert_bias,
                        moe_router_topk_scaling_factor=r.router_scaling
                        if r.router_scaling != 1.0 else None)
    if r.router_groups:
        fields.update(moe_router_num_groups=r.router_groups, moe_router_group_topk=r.group_topk)
    if r.shared_ffn:
        fields["moe_shared_expert_intermediate_size"] = r.shared_ffn
    if r.dense_layers:
        fields["moe_layer_freq"] = [int(r.moe_layer(i)) for i in range(r.layers)]
    if r.score.value == "sigmoid":
        fields["moe_router_dtype"] = "fp32"  # as Hugging Face's DeepSeek-V3 router computes
    return fields


def _latent_attention_fields(r: ResolvedModel) -> dict:
    """Multi-latent attention (MLATransformerConfig's fields; empty without it): plain RoPE or
    YaRN over the rotated part of each head, whose query/key pairs Megatron-Core takes interleaved (as
    DeepSeek-V3's ``rope_interleave``); the latent norms are on (``qk_layernorm``)."""
    if not r.mla:
        return {}
    fields = dict(q_lora_rank=r.q_lora or None, kv_lora_rank=r.kv_lora, qk_head_dim=r.head_dim,
                  qk_pos_emb_head_dim=r.rope_dim, v_head_dim=r.v_dim, rope_type="rope",
                  rotary_base=r.rotary_base, qk_layernorm=True, apply_rope_fusion=False,
                  mscale_all_dim=0.0)
    if r.yarn:  # MLATransformerConfig's YaRN: the attention scale takes mscale_all_dim
        original, fast, slow, mscale, all_dim = r.yarn
        fields.update(rope_type="yarn", rotary_scaling_factor=r.rope_scaling_factor,
                      original_max_position_embeddings=original, beta_fast=fast,
                      beta_slow=slow, mscale=mscale, mscale_all_dim=all_dim)
    return fields


def fp8_fields(trainer: TrainerConfig, model: ModelConfig) -> dict:
    """TransformerConfig's FP8 fields for ``trainer.precision=fp8`` (empty otherwise): TE's
    format and recipe, the delayed recipe's amax history, FP8 weights (``param_gather``) and
    the bf16 end layers; a MoE pads each expert's tokens to TE's alignment. Megatron-Core's
    transformer block then enters TE's FP8 autocast itself (per layer, or around the block for
    the delayed recipe; megatron-core 0.16 ``fp8_utils.get_fp8_context``)."""
    if not is_fp8(trainer.precision):
        return {}
    f = trainer.fp8
    fields = dict(
        fp8=Fp8Format(f.format).value, fp8_recipe=Fp8Recipe(f.recipe).value,
        fp8_amax_history_len=f.amax_history_len,
        fp8_amax_compute_algo=AmaxAlgo(f.amax_compute_algo).value, fp8_param=f.param_gather,
        first_last_layers_bf16=f.bf16_first_layers + f.bf16_last_layers > 0,
        num_layers_at_start_in_bf16=f.bf16_first_layers,
        num_layers_at_end_in_bf16=f.bf16_last_layers)
    if model.num_experts > 0:
        fields["moe_router_padding_for_quantization"] = True
    return fields


def _parallel_fields(parallelism: ParallelismConfig, dtype: torch.dtype) -> dict:
    """Parallel sizes; TP and PP must be given or every pipeline stage builds all layers."""
    vpp = parallelism.virtual_pipeline_parallel_size
    return dict(
        tensor_model_parallel_size=parallelism.tensor_parallel_size,
        pipeline_model_parallel_size=parallelism.pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=parallelism.context_parallel_size,
        expert_model_parallel_size=parallelism.expert_parallel_size,
        sequence_parallel=parallelism.sequence_parallel and parallelism.tensor_parallel_size > 1,
        pipeline_dtype=dtype,
        **_stage_split_fields(parallelism),
    )


def _stage_split_fields(parallelism: ParallelismConfig) -> dict:
    """Uneven pipeline stages (launcher.shape.stages): 0 = an even share is Megatron-Core's None."""
    return dict(
        num_layers_in_first_pipeline_stage=parallelism.layers_in_first_stage or None,
        num_layers_in_last_pipeline_stage=parallelism.layers_in_last_stage or None,
        account_for_embedding_in_pipeline_split=parallelism.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=parallelism.account_for_loss_in_pipeline_split,
    )


def _recompute_fields(recompute: Recompute) -> dict:
    """Activation recompute: selective = core attention; full = each whole layer (uniform, 1)."""
    if recompute == Recompute.selective:
        return dict(recompute_granularity="selective")
    if recompute == Recompute.full:
        return dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    return {}


def transformer_config(model: ModelConfig, parallelism: ParallelismConfig, trainer: TrainerConfig):
    """The ``TransformerConfig`` of ``model`` trained with ``parallelism`` at ``trainer.precision``
    (the model's sentinels resolved by :class:`~launcher.shape.ResolvedModel`;
    moe_capacity_factor 0 = no token dropping)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    precision = Precision(compute_precision(trainer.precision))  # fp8: bf16 outside FP8 GEMMs
    dtype = _DTYPES[precision]
    r = ResolvedModel.of(model, parallelism.tensor_parallel_size)
    fields = {**_arch_fields(model, r), **_latent_attention_fields(r)}
    return (MLATransformerConfig if r.mla else TransformerConfig)(
        num_layers=r.layers,
        hidden_size=r.hidden,
        ffn_hidden_size=r.ffn,
        num_attention_heads=r.heads,
        num_query_groups=r.groups,
        kv_channels=r.head_dim,
        layernorm_epsilon=r.norm_epsilon,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        bf16=precision == Precision.bf16,
        fp16=precision == Precision.fp16,
        use_cpu_initialization=not torch.cuda.is_available(),
        attention_backend=AttnBackend[AttentionBackend(trainer.attention_backend).value]
        if use_transformer_engine()
        else AttnBackend.local,
        **fields,
        **_moe_fields(model, r, parallelism, fp8=is_fp8(trainer.precision)),
        **fp8_fields(trainer, model),
        **_parallel_fields(parallelism, dtype),
        **_recompute_fields(Recompute(trainer.activation_recompute)),
        **cross_entropy_fields(trainer),
        calculate_per_token_loss=bool(trainer.per_token_loss),
    )


def _scale_by_sqrt_hidden(hidden: int):
    """A forward hook that multiplies the embedding's output by sqrt(hidden) rounded to the
    word embeddings' dtype (Gemma's scaled embeddings, as Hugging Face rounds them)."""
    def hook(module, _inputs, output):
        return output * torch.tensor(hidden ** 0.5, dtype=module.word_embeddings.weight.dtype)
    return hook


def build_gpt_model(
    model: ModelConfig,
    parallelism: ParallelismConfig,
    trainer: TrainerConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
):
    """Build the Megatron-Core ``GPTModel`` (this rank's pipeline stage / TP shard) of ``model``.

    Needs an initialised parallel state (:func:`init_parallel_state`). The vocabulary is padded to a
    multiple of make_vocab_size_divisible_by x TP.
    """
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(model, parallelism, trainer)
    r = ResolvedModel.of(model, parallelism.tensor_parallel_size)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, vp_stage, use_te=use_transformer_engine(), r=r),
        vocab_size=r.padded_vocab,
        max_sequence_length=r.max_positions,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=r.tied,
        position_embedding_type="rope" if r.llama else "learned_absolute",
        rotary_base=r.rotary_base,
        rope_scaling=r.llama and r.rope_scaling == RopeScaling.llama3,
        rope_scaling_factor=r.rope_scaling_factor,
        seq_len_interpolation_factor=r.rope_scaling_factor
        if r.llama and r.rope_scaling == RopeScaling.linear else None,
        vp_stage=vp_stage,
    )
    if r.scale_embeddings and pre_process:
        gpt.embedding.register_forward_hook(_scale_by_sqrt_hidden(r.hidden))
    if torch.cuda.is_available():
        # Megatron-Core allocates its parallel layers on the current GPU, but without Transformer
        # Engine the norms are plain torch modules, made on the host (as Megatron-LM's get_model
        # does, move the whole model). Only Megatron-Core DDP's distributed optimizer moved them
        # (its parameter buffer); DDP alone handed host bf16 weights to the optimizer.
        gpt.cuda(torch.cuda.current_device())
    return gpt


def reset_parallel_state(parallelism: ParallelismConfig, seed: int = 1234) -> None:
    """Megatron's groups rebuilt for another layout on the same processes (the probe measures
    at TP = 1, then at the job's layout)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    init_parallel_state(parallelism, seed)


def init_parallel_state(parallelism: ParallelismConfig, seed: int = 1234) -> None:
    """Create Megatron's TP/PP/CP/EP/DP groups on the initialised default process group and seed
    the model-parallel RNG streams (distinct dropout per TP rank, same weights init everywhere)."""
    from megatron.core import parallel_state, tensor_parallel

    vpp = parallelism.virtual_pipeline_parallel_size
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallelism.tensor_parallel_size,
        pipeline_model_parallel_size=parallelism.pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=parallelism.context_parallel_size,
        expert_model_parallel_size=parallelism.expert_parallel_size,
    )
    # On CPU torch.cuda.manual_seed (inside the call below) is a queued no-op: seed the CPU
    # generator that weight init and data-parallel dropout draw from.
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
