"""trainwright ``model`` group -> Hugging Face ``config.json`` (torch-free).

:func:`hf_config` writes the config transformers (and vLLM) load for a ModelConfig, in the
model's family (``model.hf_family``, or the one its features imply); :func:`export_problems`
says why a family cannot hold a model (each family declares the features it must and may have,
:data:`FAMILY_FEATURES`), before anything is written. The reading side is :mod:`.hf_config`.
"""

from __future__ import annotations

from typing import Any, Mapping

from launcher.engines.weights.hf_config import MEGATRON_LLAMA3_ROPE, UnsupportedModel

def _llama_config(m: Mapping, dtype: str, family: str) -> dict:
    heads = int(m["num_attention_heads"])
    rope: dict[str, Any] = {"rope_theta": float(m["rotary_base"]), "rope_type": "default"}
    if m.get("rope_scaling", "none") == "llama3":
        rope.update(rope_type="llama3", factor=float(m["rope_scaling_factor"]),
                    **MEGATRON_LLAMA3_ROPE)
    config = {
        "hidden_size": int(m["hidden_size"]), "intermediate_size": int(m["ffn_hidden_size"]),
        "num_hidden_layers": int(m["num_layers"]), "num_attention_heads": heads,
        "num_key_value_heads": int(m["num_query_groups"] or heads),
        "head_dim": int(m["kv_channels"] or int(m["hidden_size"]) // heads),
        "hidden_act": "silu", "rms_norm_eps": float(m["norm_epsilon"]),
        "max_position_embeddings": int(m.get("max_position_embeddings") or m["seq_length"]),
        "vocab_size": int(m["vocab_size"]), "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": not m["untie_embeddings_and_output_weights"],
        "rope_theta": rope["rope_theta"], "rope_parameters": rope,
        "rope_scaling": None if rope["rope_type"] == "default" else
        {k: v for k, v in rope.items() if k != "rope_theta"},
        "initializer_range": float(m.get("init_method_std", 0.02)), "torch_dtype": dtype,
        "dtype": dtype, "use_cache": True, "attention_dropout": 0.0,
    }
    config.update(model_type=family, architectures=[ARCHITECTURES[family]])
    _family_settings(config, m, family)
    return config


def _gpt2_config(m: Mapping, dtype: str) -> dict:
    act = m.get("activation", "auto")
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "n_embd": int(m["hidden_size"]), "n_layer": int(m["num_layers"]),
        "n_head": int(m["num_attention_heads"]), "n_inner": int(m["ffn_hidden_size"]),
        "n_positions": int(m.get("max_position_embeddings") or m["seq_length"]),
        "vocab_size": int(m["vocab_size"]), "layer_norm_epsilon": float(m["norm_epsilon"]),
        "activation_function": "gelu_new" if act == "gelu_tanh" else "gelu",
        "tie_word_embeddings": True, "scale_attn_weights": True,
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "torch_dtype": dtype,
        "dtype": dtype, "use_cache": True,
    }


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "gpt2": "GPT2LMHeadModel"}
"""The transformers class of each family."""

_OLMO2 = {"model.qk_layernorm", "model.qk_layernorm_all_heads", "model.norm_placement=post"}
_GEMMA3 = {"model.qk_layernorm", "model.norm_placement=pre_post", "model.norm_zero_centered",
           "model.scale_embeddings", "model.activation=gelu_tanh"}

_DEEPSEEK_V3 = {"model.kv_lora_rank", "model.num_experts", "model.moe_router_score=sigmoid",
                "model.moe_router_expert_bias", "model.moe_shared_expert_ffn_hidden_size"}
"""What every DeepSeek-V3 has (it may also have groups, scaling, dense layers and YaRN)."""

FAMILY_FEATURES = {
    "llama": (set(), set()), "mistral": (set(), {"model.window_size"}),
    "phi3": (set(), {"model.window_size"}),
    "mixtral": ({"model.num_experts"}, {"model.num_experts"}),
    "qwen2": ({"model.add_qkv_bias"}, {"model.add_qkv_bias"}),
    "qwen3": ({"model.qk_layernorm"}, {"model.qk_layernorm"}),
    "qwen3_moe": ({"model.qk_layernorm", "model.num_experts"},
                  {"model.qk_layernorm", "model.num_experts", "model.moe_router_pre_softmax"}),
    "olmo2": (_OLMO2, _OLMO2),
    "gemma3_text": (_GEMMA3, _GEMMA3 | {"model.window_size", "model.full_attention_every",
                                        "model.rotary_base_local", "model.softmax_scale_dim",
                                        "model.rope_scaling=linear"}),
    "gpt2": ({"model.arch=gpt2"}, {"model.arch=gpt2"}),
    "deepseek_v3": (_DEEPSEEK_V3, _DEEPSEEK_V3 | {"model.moe_router_groups",
                                                  "model.moe_router_scaling",
                                                  "model.moe_dense_layers",
                                                  "model.rope_scaling=yarn"}),
}
"""Each family's (features it must have, features it may have) of :func:`_features`."""


def _features(m: Mapping) -> set:
    """The features of ``m`` that only some families have."""
    gpt2, experts = m.get("arch") == "gpt2", int(m.get("num_experts") or 0) > 0
    return {name for name, on in (
        ("model.arch=gpt2", gpt2), ("model.add_bias_linear", m.get("add_bias_linear") and not gpt2),
        ("model.add_qkv_bias", m.get("add_qkv_bias") and not gpt2),
        ("model.qk_layernorm", m.get("qk_layernorm")),
        ("model.qk_layernorm_all_heads", m.get("qk_layernorm") and m.get("qk_layernorm_all_heads")),
        ("model.norm_placement=post", str(m.get("norm_placement", "pre")) == "post"),
        ("model.norm_placement=pre_post", str(m.get("norm_placement", "pre")) == "pre_post"),
        ("model.norm_zero_centered", m.get("norm_zero_centered")),
        ("model.scale_embeddings", m.get("scale_embeddings")),
        ("model.activation=gelu_tanh", str(m.get("activation", "auto")) == "gelu_tanh"
         and not gpt2),
        ("model.full_attention_every", int(m.get("full_attention_every") or 0) > 0),
        ("model.rotary_base_local", int(m.get("rotary_base_local") or 0) > 0),
        ("model.softmax_scale_dim", int(m.get("softmax_scale_dim") or 0) > 0),
        ("model.rope_scaling=linear", str(m.get("rope_scaling", "none")) == "linear"),
        ("model.rope_scaling=yarn", str(m.get("rope_scaling", "none")) == "yarn"),
        ("model.window_size", int(m.get("window_size") or 0) > 0),
        ("model.num_experts", experts),
        ("model.moe_router_pre_softmax", experts and m.get("moe_router_pre_softmax")),
        ("model.kv_lora_rank", int(m.get("kv_lora_rank") or 0) > 0),
        ("model.moe_router_score=sigmoid", experts and str(m.get("moe_router_score",
                                                                 "softmax")) == "sigmoid"),
        ("model.moe_router_expert_bias", experts and m.get("moe_router_expert_bias")),
        ("model.moe_router_groups", experts and int(m.get("moe_router_groups") or 0) > 0),
        ("model.moe_router_scaling", experts and float(m.get("moe_router_scaling", 1.0)) != 1.0),
        ("model.moe_shared_expert_ffn_hidden_size",
         experts and int(m.get("moe_shared_expert_ffn_hidden_size") or 0) > 0),
        ("model.moe_dense_layers", experts and int(m.get("moe_dense_layers") or 0) > 0)) if on}


def _family_of(m: Mapping) -> str:
    from launcher.shape.model import hf_family_of, model_config

    return hf_family_of(model_config(m)).value


def export_problems(model: Mapping) -> list[str]:
    """Why the model's Hugging Face family (model.hf_family, or the one its features imply)
    does not hold it exactly ([] when it does)."""
    m = dict(model)
    family = _family_of(m)
    required, allowed = FAMILY_FEATURES[family]
    features = _features(m)
    out = [f"model.hf_family={family} needs {f}" for f in sorted(required - features)]
    out += [f"{f} has no place in {family} (Hugging Face's {ARCHITECTURES[family]} has none)"
            for f in sorted(features - allowed)]
    if family == "deepseek_v3" and "model.moe_shared_expert_ffn_hidden_size" in features:
        expert = int(m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"])
        shared = int(m["moe_shared_expert_ffn_hidden_size"])
        if shared % expert:
            out.append(f"model.moe_shared_expert_ffn_hidden_size={shared} is not a multiple of "
                       f"model.moe_ffn_hidden_size={expert} (DeepSeek-V3 counts shared experts)")
    return out


def _family_settings(config: dict, m: Mapping, family: str) -> None:
    """The family's own config.json entries (and the Llama ones it does not have)."""
    window = int(m.get("window_size") or 0) or None
    if family != "llama":
        del config["attention_bias"], config["mlp_bias"]
    if family == "llama":
        config["pretraining_tp"] = 1
    elif family in ("mistral", "phi3"):
        config["sliding_window"] = window
        if family == "phi3":  # Phi3Config's defaults name token 32000, beyond small vocabularies
            config.update(pad_token_id=None, partial_rotary_factor=1.0, resid_pdrop=0.0,
                          embd_pdrop=0.0,
                          original_max_position_embeddings=config["max_position_embeddings"])
    elif family in ("qwen2", "qwen3"):
        if family == "qwen3":
            config["attention_bias"] = False
        config.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=int(m["num_layers"]),
                      layer_types=["full_attention"] * int(m["num_layers"]))
    elif family == "olmo2":
        config["attention_bias"] = False
    elif family == "gemma3_text":
        _gemma3_settings(config, m)
    elif family == "qwen3_moe":
        config.update(attention_bias=False, num_experts=int(m["num_experts"]),
                      num_experts_per_tok=int(m["moe_router_topk"]),
                      moe_intermediate_size=int(m.get("moe_ffn_hidden_size") or
                                                m["ffn_hidden_size"]),
                      norm_topk_prob=not m.get("moe_router_pre_softmax"),
                      router_aux_loss_coef=float(m.get("moe_aux_loss_coeff", 0.001)),
                      decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                      use_sliding_window=False, sliding_window=None,
                      max_window_layers=int(m["num_layers"]))
    elif family == "deepseek_v3":
        _deepseek_v3_settings(config, m)
    elif family == "mixtral":
        config.update(num_local_experts=int(m["num_experts"]),
                      num_experts_per_tok=int(m["moe_router_topk"]),
                      router_aux_loss_coef=float(m.get("moe_aux_loss_coeff", 0.01)),
                      sliding_window=None, output_router_logits=False, router_jitter_noise=0.0)


def _deepseek_v3_settings(config: dict, m: Mapping) -> None:
    """DeepSeek-V3's config.json entries: the latent widths (``head_dim`` is the rotated part,
    as transformers sets it), the router, the shared expert as a count of expert widths, no
    multi-token prediction; YaRN where the model has it."""
    expert = int(m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"])
    rope, nope = int(m["qk_rope_head_dim"]), int(config["head_dim"])
    groups = int(m.get("moe_router_groups") or 0)
    config.update(
        attention_bias=False, num_key_value_heads=config["num_attention_heads"],
        q_lora_rank=int(m.get("q_lora_rank") or 0) or None, kv_lora_rank=int(m["kv_lora_rank"]),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, qk_head_dim=nope + rope, head_dim=rope,
        v_head_dim=int(m.get("v_head_dim") or nope), rope_interleave=True,
        n_routed_experts=int(m["num_experts"]), num_experts_per_tok=int(m["moe_router_topk"]),
        moe_intermediate_size=expert,
        n_shared_experts=int(m["moe_shared_expert_ffn_hidden_size"]) // expert,
        first_k_dense_replace=int(m.get("moe_dense_layers") or 0),
        n_group=groups or 1, topk_group=int(m.get("moe_router_group_topk") or 0) or 1,
        routed_scaling_factor=float(m.get("moe_router_scaling", 1.0)), norm_topk_prob=True,
        num_nextn_predict_layers=0, pretraining_tp=1)
    if str(m.get("rope_scaling", "none")) == "yarn":
        yarn = {"rope_type": "yarn", "factor": float(m["rope_scaling_factor"]),
                "original_max_position_embeddings": int(m["rope_original_max_positions"]),
                "beta_fast": float(m["yarn_beta_fast"]), "beta_slow": float(m["yarn_beta_slow"]),
                "mscale": float(m["yarn_mscale"]),
                "mscale_all_dim": float(m["yarn_mscale_all_dim"])}
        config.update(rope_scaling=yarn, rope_parameters={**yarn,
                                                          "rope_theta": config["rope_theta"]})


def _gemma3_settings(config: dict, m: Mapping) -> None:
    """Gemma 3's config.json entries: GeGLU, the two RoPEs (both spellings), the layer types,
    the attention scale, no soft-capping."""
    from launcher.shape import ResolvedModel

    resolved = ResolvedModel.of_fields(m)
    layers, window = resolved.layers, resolved.window
    full_rope = {"rope_type": "default", "rope_theta": float(m["rotary_base"])}
    if str(m.get("rope_scaling", "none")) == "linear":
        full_rope.update(rope_type="linear", factor=float(m["rope_scaling_factor"]))
    local_base = float(m.get("rotary_base_local") or m["rotary_base"])
    head_dim = config["head_dim"]
    for key in ("hidden_act", "pretraining_tp"):
        config.pop(key, None)
    config.update(
        hidden_activation="gelu_pytorch_tanh", attention_bias=False,
        query_pre_attn_scalar=int(m.get("softmax_scale_dim") or head_dim),
        sliding_window=window or None, final_logit_softcapping=None,
        attn_logit_softcapping=None, use_bidirectional_attention=False,
        layer_types=["sliding_attention" if resolved.windowed(i + 1) else "full_attention"
                     for i in range(layers)],
        rope_parameters={"full_attention": full_rope,
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": local_base}},
        rope_theta=full_rope["rope_theta"], rope_local_base_freq=local_base,
        rope_scaling=None if full_rope["rope_type"] == "default" else
        {"rope_type": "linear", "factor": full_rope["factor"]})


def hf_config(model: Mapping, *, dtype: str, eos_id: int = -1, bos_id: int = -1) -> dict:
    """The HF ``config.json`` of a ModelConfig (given as a mapping of its fields);
    UnsupportedModel when no family holds it (:func:`export_problems`)."""
    m = dict(model)
    problems = export_problems(m)
    if problems:
        raise UnsupportedModel(f"model {m.get('name', '')!r}", problems)
    family = _family_of(m)
    config = _gpt2_config(m, dtype) if family == "gpt2" else _llama_config(m, dtype, family)
    config["bos_token_id"] = bos_id if bos_id >= 0 else None
    config["eos_token_id"] = eos_id if eos_id >= 0 else None
    return config
