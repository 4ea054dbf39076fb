"""Checks of DeepSeek-V3's layer features (launcher.plan.validate runs them with the model's
shapes): multi-latent attention, and the MoE router and MLP layout (sigmoid scores, expert bias,
expert groups, scaling, a shared expert, dense first layers). Each returns every problem it
finds, each naming its keys and values and a fix.
"""

from __future__ import annotations

import math

from launcher.config import Arch, ModelConfig, NormPlacement, RopeScaling, RouterScore
from launcher.core.problems import Problem, divisors, fmt_values

LATENT_KEYS = ("model.q_lora_rank", "model.qk_rope_head_dim", "model.v_head_dim")
"""MLA's widths besides kv_lora_rank, which turns it on."""

MOE_LAYOUT_KEYS = ("model.moe_router_score", "model.moe_router_expert_bias",
                   "model.moe_router_groups", "model.moe_router_group_topk",
                   "model.moe_router_scaling", "model.moe_shared_expert_ffn_hidden_size",
                   "model.moe_dense_layers")
"""Router and MLP-layout settings that mean something only with experts."""

NON_NEGATIVE = ("model.kv_lora_rank",) + LATENT_KEYS + (
    "model.moe_router_groups", "model.moe_router_group_topk",
    "model.moe_shared_expert_ffn_hidden_size", "model.moe_dense_layers")
"""Widths and counts where 0 means none."""

GROUP_PICK = 2
"""Scores per group that rank the groups: DeepSeek-V3 (and Hugging Face's DeepseekV3) sum each
group's best 2; Megatron-Core sums its best moe_router_topk // moe_router_group_topk."""


def check_layer_features(m: ModelConfig, tp: int) -> list[Problem]:
    """Every problem of the MLA and router/MLP-layout settings at tensor-parallel size ``tp``."""
    return (_check_non_negative(m) + check_latent_attention(m) + check_yarn(m)
            + check_router(m) + check_moe_layout(m, tp))


def check_yarn(m: ModelConfig) -> list[Problem]:
    """YaRN (model.rope_scaling=yarn) as built here: Megatron-Core's multi-latent attention's,
    checked against transformers' DeepSeek-V3; its original context and ramp given."""
    if m.rope_scaling != RopeScaling.yarn:
        return []
    out = []
    if m.kv_lora_rank <= 0:
        out.append(Problem(("model.rope_scaling", "model.kv_lora_rank"), (
            "model.rope_scaling=yarn is built here with multi-latent attention only "
            "(model.kv_lora_rank > 0, DeepSeek-V3); set model.rope_scaling=none, llama3 or "
            "linear")))
    if m.rope_original_max_positions <= 0:
        out.append(Problem(("model.rope_original_max_positions", "model.rope_scaling"), (
            f"model.rope_scaling=yarn needs model.rope_original_max_positions > 0 (got "
            f"{m.rope_original_max_positions}), the context before scaling; set it (DeepSeek-V3: "
            "4096)")))
    if not m.rope_scaling_factor >= 1.0:
        out.append(Problem(("model.rope_scaling_factor", "model.rope_scaling"), (
            f"model.rope_scaling_factor={m.rope_scaling_factor} with rope_scaling=yarn must be "
            ">= 1 (how much longer the context becomes; DeepSeek-V3: 40)")))
    if not m.yarn_beta_fast > m.yarn_beta_slow > 0:
        out.append(Problem(("model.yarn_beta_fast", "model.yarn_beta_slow"), (
            f"model.yarn_beta_fast={m.yarn_beta_fast} must exceed model.yarn_beta_slow="
            f"{m.yarn_beta_slow} > 0 (the ramp between kept and interpolated frequencies; "
            "YaRN's own: 32 and 1)")))
    return out


def _check_non_negative(m: ModelConfig) -> list[Problem]:
    out = [Problem((key,), f"{key}={_value(m, key)} must be >= 0 (0 means none)")
           for key in NON_NEGATIVE if _value(m, key) < 0]
    if not math.isfinite(m.moe_router_scaling) or m.moe_router_scaling <= 0:
        out.append(Problem(("model.moe_router_scaling",), (
            f"model.moe_router_scaling={m.moe_router_scaling} must be a finite number > 0 (the "
            "factor on the chosen experts' weights; 1 = as the router gives them, DeepSeek-V3: "
            "2.5)")))
    return out


def _value(m: ModelConfig, key: str):
    return getattr(m, key.split(".", 1)[1])


def check_latent_attention(m: ModelConfig) -> list[Problem]:
    """Multi-latent attention (model.kv_lora_rank > 0) as built here: a Llama layer of
    pre-norms without biases, plain RoPE over each head's rotated part, the latent norms always
    on; without it, its widths mean nothing."""
    if m.kv_lora_rank <= 0:
        return [Problem((key, "model.kv_lora_rank"), (
            f"{key}={_value(m, key)} is a width of multi-latent attention, which "
            f"model.kv_lora_rank={m.kv_lora_rank} leaves off; set model.kv_lora_rank > 0 "
            f"(DeepSeek-V3: 512) or {key}=0")) for key in LATENT_KEYS if _value(m, key) > 0]
    out = _rope_part_problems(m) + _latent_unbuilt(m)
    groups = m.num_query_groups
    if groups not in (0, m.num_attention_heads):
        out.append(Problem(("model.num_query_groups", "model.kv_lora_rank"), (
            f"model.num_query_groups={groups} with multi-latent attention (model.kv_lora_rank="
            f"{m.kv_lora_rank}): every head gets its own key and value from the latent, "
            f"num_attention_heads={m.num_attention_heads} of them; set "
            "model.num_query_groups=0")))
    return out


def _rope_part_problems(m: ModelConfig) -> list[Problem]:
    rope = m.qk_rope_head_dim
    if rope > 0 and rope % 2 == 0:
        return []
    return [Problem(("model.qk_rope_head_dim", "model.kv_lora_rank"), (
        f"model.qk_rope_head_dim={rope} with multi-latent attention (model.kv_lora_rank="
        f"{m.kv_lora_rank}) must be a positive even number (RoPE rotates pairs of elements of "
        "each head's rotated part); set it, e.g. model.qk_rope_head_dim=64 (DeepSeek-V3)"))]


def _latent_unbuilt(m: ModelConfig) -> list[Problem]:
    """Settings multi-latent attention is not built with here, each with the value it needs."""
    mla = f"multi-latent attention (model.kv_lora_rank={m.kv_lora_rank})"
    checks = (
        ("model.arch", m.arch != Arch.llama, f"arch={m.arch}", "model.arch=llama"),
        ("model.qk_layernorm", m.qk_layernorm, "qk_layernorm=true (its latent norms are "
         "always on; per-head QK norms have no place in it)", "model.qk_layernorm=false"),
        ("model.window_size", m.window_size > 0, f"window_size={m.window_size}",
         "model.window_size=0"),
        ("model.norm_placement", m.norm_placement != NormPlacement.pre,
         f"norm_placement={m.norm_placement}", "model.norm_placement=pre"),
        ("model.norm_zero_centered", m.norm_zero_centered, "norm_zero_centered=true",
         "model.norm_zero_centered=false"),
        ("model.add_bias_linear", m.add_bias_linear, "add_bias_linear=true",
         "model.add_bias_linear=false"),
        ("model.add_qkv_bias", m.add_qkv_bias, "add_qkv_bias=true", "model.add_qkv_bias=false"),
        ("model.softmax_scale_dim", m.softmax_scale_dim > 0,
         f"softmax_scale_dim={m.softmax_scale_dim} (the scale follows the key width, "
         "kv_channels + qk_rope_head_dim)", "model.softmax_scale_dim=0"),
        ("model.rotary_base_local", m.rotary_base_local > 0,
         f"rotary_base_local={m.rotary_base_local}", "model.rotary_base_local=0"),
        ("model.rope_scaling", m.rope_scaling not in (RopeScaling.none, RopeScaling.yarn),
         f"rope_scaling={m.rope_scaling}", "model.rope_scaling=none or yarn"),
    )
    return [Problem((key, "model.kv_lora_rank"), (
        f"{mla} is not built here with model.{why}; set {fix}, or model.kv_lora_rank=0"))
        for key, bad, why, fix in checks if bad]


def check_router(m: ModelConfig) -> list[Problem]:
    """Sigmoid scores, the expert bias and expert groups, as Megatron-Core routes them."""
    if not m.num_experts:
        return []
    out = []
    sigmoid = m.moe_router_score == RouterScore.sigmoid
    if m.moe_router_expert_bias and not sigmoid:
        out.append(Problem(("model.moe_router_expert_bias", "model.moe_router_score"), (
            f"model.moe_router_expert_bias=true needs model.moe_router_score=sigmoid (got "
            f"{m.moe_router_score}): the bias balances the loads of sigmoid scores "
            "(DeepSeek-V3); set model.moe_router_score=sigmoid or "
            "model.moe_router_expert_bias=false")))
    if sigmoid and m.moe_router_pre_softmax:
        out.append(Problem(("model.moe_router_pre_softmax", "model.moe_router_score"), (
            "model.moe_router_pre_softmax=true weighs the chosen experts by a softmax over all "
            "experts, which model.moe_router_score=sigmoid replaces; set "
            "model.moe_router_pre_softmax=false or model.moe_router_score=softmax")))
    return out + _group_problems(m)


def _group_problems(m: ModelConfig) -> list[Problem]:
    groups, pick, experts = m.moe_router_groups, m.moe_router_group_topk, m.num_experts
    if groups <= 0:
        return [Problem(("model.moe_router_group_topk", "model.moe_router_groups"), (
            f"model.moe_router_group_topk={pick} picks among expert groups, but "
            "model.moe_router_groups=0 makes none; set model.moe_router_groups (DeepSeek-V3: "
            "8) or model.moe_router_group_topk=0"))] if pick > 0 else []
    if experts % groups:
        return [Problem(("model.moe_router_groups", "model.num_experts"), (
            f"model.moe_router_groups={groups} does not divide model.num_experts={experts} "
            f"into equal groups; use moe_router_groups from {fmt_values(divisors(experts))}"))]
    if not 1 <= pick <= groups:
        return [Problem(("model.moe_router_group_topk", "model.moe_router_groups"), (
            f"model.moe_router_group_topk={pick} must be in 1..{groups} (the groups a token "
            f"picks of model.moe_router_groups={groups}); e.g. {max(1, groups // 2)}"))]
    return _group_pick_problems(m)


def _group_pick_problems(m: ModelConfig) -> list[Problem]:
    topk, groups, pick = m.moe_router_topk, m.moe_router_groups, m.moe_router_group_topk
    per_group = m.num_experts // groups
    keys = ("model.moe_router_topk", "model.moe_router_group_topk")
    if topk // pick != GROUP_PICK:
        return [Problem(keys, (
            f"model.moe_router_topk // model.moe_router_group_topk = {topk} // {pick} = "
            f"{topk // pick} must be {GROUP_PICK}: Megatron-Core ranks the groups by the sum of "
            "each group's best moe_router_topk // moe_router_group_topk scores, DeepSeek-V3 "
            f"(and Hugging Face) by its best {GROUP_PICK}, so any other ratio routes differently "
            "from the published model; set model.moe_router_group_topk="
            f"{max(1, topk // GROUP_PICK)} (or moe_router_topk={GROUP_PICK * pick})"))]
    if topk > pick * per_group:
        return [Problem(keys + ("model.moe_router_groups",), (
            f"model.moe_router_topk={topk} experts cannot be found in "
            f"moe_router_group_topk={pick} groups of num_experts / moe_router_groups = "
            f"{m.num_experts} / {groups} = {per_group} experts; pick more groups or fewer "
            "experts"))]
    return []


def check_moe_layout(m: ModelConfig, tp: int) -> list[Problem]:
    """Dense first layers and the shared expert: fewer dense layers than layers, widths TP
    splits; without experts, none of the MoE-only settings."""
    if not m.num_experts:
        return _moe_only_problems(m)
    out = []
    if m.moe_dense_layers >= m.num_layers:
        out.append(Problem(("model.moe_dense_layers", "model.num_layers"), (
            f"model.moe_dense_layers={m.moe_dense_layers} leaves none of model.num_layers="
            f"{m.num_layers} with experts; use moe_dense_layers from 0 to {m.num_layers - 1}, "
            "or model.num_experts=0 for a dense model")))
    tp_key = "parallelism.tensor_parallel_size"
    for key, width, used in (
            ("model.moe_shared_expert_ffn_hidden_size", m.moe_shared_expert_ffn_hidden_size,
             m.moe_shared_expert_ffn_hidden_size > 0),
            ("model.ffn_hidden_size", m.ffn_hidden_size, m.moe_dense_layers > 0)):
        if used and width % tp:
            out.append(Problem((key, tp_key), (
                f"{key}={width} is not divisible by {tp_key}={tp}; use {tp_key} from "
                f"{fmt_values(divisors(width))}")))
    return out


def _moe_only_problems(m: ModelConfig) -> list[Problem]:
    """MoE-only settings given to a dense model (model.num_experts=0)."""
    defaults = {"model.moe_router_score": RouterScore.softmax,
                "model.moe_router_expert_bias": False, "model.moe_router_groups": 0,
                "model.moe_router_group_topk": 0, "model.moe_router_scaling": 1.0,
                "model.moe_shared_expert_ffn_hidden_size": 0, "model.moe_dense_layers": 0}
    return [Problem((key, "model.num_experts"), (
        f"{key}={_shown(_value(m, key))} sets a mixture-of-experts layer apart, but "
        f"model.num_experts=0 makes a dense model; set model.num_experts or "
        f"{key}={_shown(default)}"))
        for key, default in defaults.items() if _value(m, key) != default]


def _shown(value) -> str:
    """A value as an override spells it (true/false, enum values)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)  # numbers, and the StrEnums' values
