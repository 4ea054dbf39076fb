"""Hugging Face ``config.json`` -> trainwright ``model`` group (torch-free).

:func:`model_fields` reads an HF config of a supported family (:data:`FAMILIES`) into ModelConfig
fields and raises :class:`UnsupportedModel` naming every feature Megatron-Core cannot reproduce.
The other way (a ModelConfig's config.json, and which family holds a model) is
:mod:`.hf_export`. Field names and defaults follow transformers 4.45-5.x, including both
spellings of the RoPE settings (``rope_theta`` + ``rope_scaling`` before 5.0,
``rope_parameters`` since).
"""

from __future__ import annotations

from typing import Any, Mapping

FAMILIES = ("llama", "mixtral", "gpt2", "qwen2", "qwen3", "qwen3_moe", "mistral", "phi3",
            "olmo2", "gemma3_text", "gemma3", "deepseek_v3")
"""HF ``model_type`` values that convert (``gemma3``: the language model of the multimodal
checkpoints; its vision encoder is neither read nor written)."""

MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
"""Megatron-Core 0.16's Llama 3.1 RoPE scaling (RotaryEmbedding._apply_scaling): only the factor
is configurable, these three are fixed (they are Llama 3.1's and 3.2's published values)."""

GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
"""HF GPT-2 ``activation_function`` -> ``model.activation``."""


class UnsupportedModel(ValueError):
    """An HF config with features that cannot be converted; ``problems`` names each one."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"{source}: cannot convert this model: " + "; ".join(problems))


def _rope(config: Mapping) -> tuple[float, dict]:
    """(rope theta, scaling dict or {}) from either spelling."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    return float(theta), ({} if kind == "default" else {**merged, "rope_type": kind})


def _rope_fields(config: Mapping, problems: list) -> dict:
    theta, scaling = _rope(config)
    fields: dict[str, Any] = {"rotary_base": int(theta) if float(theta).is_integer() else theta}
    if not scaling:
        return fields
    if scaling["rope_type"] != "llama3":
        problems.append(f"rope type {scaling['rope_type']!r} (Megatron-Core implements the "
                        "default RoPE and Llama 3.1's 'llama3' scaling only)")
        return fields
    for key, value in MEGATRON_LLAMA3_ROPE.items():
        if float(scaling.get(key, value)) != value:
            problems.append(f"rope_scaling.{key}={scaling.get(key)} (Megatron-Core's llama3 "
                            f"scaling fixes it at {value:g})")
    fields.update(rope_scaling="llama3", rope_scaling_factor=float(scaling.get("factor", 8.0)))
    return fields


def _llama_fields(config: Mapping, problems: list) -> dict:
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config.get('hidden_act')!r} (a Llama MLP is SwiGLU: silu)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        problems.append("attention_bias/mlp_bias (Llama-family biases are not mapped)")
    if config.get("sliding_window"):
        problems.append(f"sliding_window={config['sliding_window']} (full causal attention only)")
    head_dim = config.get("head_dim") or hidden // heads
    fields = dict(arch="llama", num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
                  ffn_hidden_size=int(config["intermediate_size"]), num_attention_heads=heads,
                  num_query_groups=int(config.get("num_key_value_heads") or heads),
                  kv_channels=int(head_dim), vocab_size=int(config["vocab_size"]),
                  norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
                  untie_embeddings_and_output_weights=not config.get("tie_word_embeddings",
                                                                     False),
                  max_position_embeddings=int(config.get("max_position_embeddings", 0) or 0))
    fields.update(_rope_fields(config, problems))
    fields["seq_length"] = _training_length(fields, config)
    return fields


def _training_length(fields: Mapping, config: Mapping) -> int:
    """A sensible ``model.seq_length``: the pre-scaling context under llama3 RoPE scaling (the
    length the model was pretrained at), else the position limit, at most 8,192."""
    _, scaling = _rope(config)
    if scaling.get("original_max_position_embeddings"):
        return int(scaling["original_max_position_embeddings"])
    return min(int(fields.get("max_position_embeddings") or 4096), 8192)


def _mixtral_fields(config: Mapping, problems: list) -> dict:
    fields = _llama_fields({**config, "attention_bias": False, "mlp_bias": False}, problems)
    fields.update(num_experts=int(config["num_local_experts"]),
                  moe_router_topk=int(config["num_experts_per_tok"]),
                  moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.01)))
    return fields


def _qwen2_fields(config: Mapping, problems: list) -> dict:
    """Qwen2 and Qwen2.5: a Llama with biases on the query, key and value projections (not on
    the output projection). ``sliding_window`` is a size the model ignores unless
    ``use_sliding_window`` (or a ``sliding_attention`` entry of ``layer_types``) turns it on."""
    sliding = [i for i, kind in enumerate(config.get("layer_types") or [])
               if kind != "full_attention"]
    if config.get("use_sliding_window") or sliding:
        problems.append(f"use_sliding_window=true (layers {sliding or 'from max_window_layers'} "
                        f"attend within sliding_window={config.get('sliding_window')}; full "
                        "causal attention only)")
    fields = _llama_fields({**config, "attention_bias": False, "mlp_bias": False,
                            "sliding_window": None}, problems)
    fields["add_qkv_bias"] = True
    return fields


def _qwen3_fields(config: Mapping, problems: list) -> dict:
    """Qwen3 (dense): a Llama with an RMSNorm over each query and key head (``q_norm``,
    ``k_norm``); ``attention_bias`` would also put a bias on the output projection, which
    Megatron-Core's QKV-only bias does not have."""
    if config.get("attention_bias"):
        problems.append("attention_bias=true (Qwen3's biases include the output projection; "
                        "Megatron-Core biases the QKV projection only)")
    fields = _qwen2_fields({**config, "attention_bias": False}, problems)
    fields.update(add_qkv_bias=False, qk_layernorm=True)
    return fields


def _mistral_fields(config: Mapping, problems: list) -> dict:
    """Mistral: a Llama whose every layer attends within ``sliding_window`` tokens, itself
    included (null: full causal attention, as from v0.2 on)."""
    if config.get("attention_bias") or config.get("mlp_bias"):
        problems.append("attention_bias/mlp_bias (Mistral has no biases)")
    fields = _llama_fields({**config, "attention_bias": False, "mlp_bias": False,
                            "sliding_window": None}, problems)
    if config.get("sliding_window"):
        fields["window_size"] = int(config["sliding_window"])
    return fields


def _qwen3_moe_fields(config: Mapping, problems: list) -> dict:
    """Qwen3-MoE: Qwen3 (QK-norm) whose every MLP is a mixture of ``num_experts`` experts of
    width ``moe_intermediate_size``, top ``num_experts_per_tok``; ``norm_topk_prob`` renormalises
    the chosen experts' probabilities (Megatron-Core's default router), else they stay as the
    softmax over all experts gave them (``moe_router_pre_softmax``). Dense layers among them
    (``mlp_only_layers``, ``decoder_sparse_step`` > 1) are not built here."""
    dense = list(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1) or 1)
    if dense or step != 1:
        problems.append(f"mlp_only_layers={dense}, decoder_sparse_step={step} (every layer a "
                        "mixture of experts only)")
    if int(config.get("shared_expert_intermediate_size") or 0):
        problems.append("shared_expert_intermediate_size (Qwen3-MoE has no shared expert)")
    fields = _qwen3_fields(config, problems)
    experts = config.get("num_experts", config.get("num_local_experts"))  # both spellings
    fields.update(num_experts=int(experts), moe_router_topk=int(config["num_experts_per_tok"]),
                  moe_ffn_hidden_size=int(config["moe_intermediate_size"]),
                  moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.001)),
                  moe_router_pre_softmax=not config.get("norm_topk_prob", False))
    return fields


def _olmo2_fields(config: Mapping, problems: list) -> dict:
    """OLMo 2: a Llama whose norms sit on the outputs of attention and MLP
    (``post_attention_layernorm``, ``post_feedforward_layernorm``) and whose ``q_norm``/``k_norm``
    run over all heads of a token at once."""
    fields = _llama_fields(config, problems)
    fields.update(qk_layernorm=True, qk_layernorm_all_heads=True, norm_placement="post")
    return fields


def _gemma3_rope(config: Mapping, problems: list) -> dict:
    """Gemma 3's two RoPEs: the full-attention layers' (``rope_theta``, with linear scaling
    in the 4B-27B models) and the sliding-window layers' (``rope_local_base_freq``), from
    either spelling (transformers 5 nests them in ``rope_parameters``)."""
    params = dict(config.get("rope_parameters") or {})
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    for key, value in (config.get("rope_scaling") or {}).items():
        full.setdefault(key, value)
    local.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    fields: dict[str, Any] = {"rotary_base": int(full["rope_theta"]),
                              "rotary_base_local": int(local["rope_theta"])}
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        fields.update(rope_scaling="linear", rope_scaling_factor=float(full["factor"]))
    elif kind != "default":
        problems.append(f"rope type {kind!r} of the full-attention layers (default or linear)")
    if local.get("rope_type", "default") != "default":
        problems.append(f"rope type {local['rope_type']!r} of the sliding-window layers (default)")
    return fields


def _gemma3_window(config: Mapping, problems: list) -> dict:
    """``layer_types`` (or ``sliding_window_pattern``) as a window and the period of the
    full-attention layers among the windowed ones (layers N, 2N, ...; counted from 1)."""
    layers = int(config["num_hidden_layers"])
    kinds = config.get("layer_types") or [
        "full_attention" if (i + 1) % int(config.get("sliding_window_pattern", 6)) == 0
        else "sliding_attention" for i in range(layers)]
    full = [i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"]
    if len(full) == layers or not config.get("sliding_window"):
        return {}
    every = full[0] if full else 0
    if full != list(range(every, layers + 1, every or layers + 1)):
        problems.append(f"layer_types with full attention at layers {full} (counted from 1): only "
                        "every N-th layer, N fixed, is built here")
    return {"window_size": int(config["sliding_window"]), "full_attention_every": every}


def _gemma3_fields(config: Mapping, problems: list) -> dict:
    """Gemma 3's language model: a Llama with four zero-centred norms a layer (on both sides
    of attention and MLP), QK-norm, embeddings scaled by sqrt(hidden), GeGLU with tanh GeLU,
    attention scaled by 1/sqrt(query_pre_attn_scalar), and sliding-window layers with a RoPE
    of their own between full-attention ones."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            problems.append(f"{key}={config[key]} (no soft-capping in Megatron-Core's attention "
                            "and output layer here)")
    if config.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=true (causal attention only)")
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation={act!r} (Gemma's GeGLU: gelu_pytorch_tanh)")
    fields = _llama_fields({**config, "hidden_act": "silu", "sliding_window": None,
                            "rope_parameters": None, "rope_scaling": None,
                            "tie_word_embeddings": config.get("tie_word_embeddings", True)},
                           problems)
    fields.update(_gemma3_rope(config, problems), **_gemma3_window(config, problems))
    fields.update(activation="gelu_tanh", qk_layernorm=True, norm_placement="pre_post",
                  norm_zero_centered=True, scale_embeddings=True,
                  softmax_scale_dim=int(config.get("query_pre_attn_scalar") or
                                        fields["kv_channels"]))
    if not fields.get("window_size"):
        fields.pop("rotary_base_local")
    return fields


def _gemma3_multimodal_fields(config: Mapping, problems: list) -> dict:
    """Gemma 3 4B-27B (``Gemma3ForConditionalGeneration``): the fields of its ``text_config``,
    whose entries at their defaults the checkpoints leave out (transformers' Gemma3TextConfig
    fills them in, as when it loads the model)."""
    from transformers import Gemma3TextConfig

    text = dict(config.get("text_config") or {})
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
    return _gemma3_fields(Gemma3TextConfig(**text).to_dict(), problems)


def _phi3_fields(config: Mapping, problems: list) -> dict:
    """Phi-3: a Mistral-like model (window where ``sliding_window`` sets one) whose query, key and
    value projections are one tensor, and gate and up projections another; RoPE over part of the
    head (``partial_rotary_factor`` < 1, Phi-4-mini) is not Megatron-Core's."""
    partial = (config.get("rope_parameters") or {}).get(
        "partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        problems.append(f"partial_rotary_factor={partial} (RoPE over the whole head only)")
    return _mistral_fields(config, problems)


def _deepseek_v3_attention(config: Mapping, problems: list) -> dict:
    """Multi-latent attention's widths; RoPE rotating interleaved pairs (``rope_interleave``,
    as Megatron-Core's MLA does), every query head with its own key and value head."""
    heads = int(config["num_attention_heads"])
    if not config.get("rope_interleave", True):
        problems.append("rope_interleave=false (Megatron-Core's multi-latent attention rotates "
                        "interleaved pairs)")
    if int(config.get("num_key_value_heads") or heads) != heads:
        problems.append(f"num_key_value_heads={config['num_key_value_heads']} (multi-latent "
                        f"attention has one key/value head per query head: {heads})")
    return dict(kv_lora_rank=int(config["kv_lora_rank"]),
                q_lora_rank=int(config.get("q_lora_rank") or 0),
                kv_channels=int(config["qk_nope_head_dim"]),
                qk_rope_head_dim=int(config["qk_rope_head_dim"]),
                v_head_dim=int(config["v_head_dim"]), num_query_groups=heads)


def _deepseek_v3_router(config: Mapping, problems: list) -> dict:
    """The sigmoid router: scores renormalised over the chosen experts (Megatron-Core always
    does), groups picked by the sum of their two best scores (Megatron-Core: of their
    top-k / group-top-k best), the weights times ``routed_scaling_factor``."""
    topk, groups = int(config["num_experts_per_tok"]), int(config.get("n_group") or 1)
    group_topk = int(config.get("topk_group") or 1)
    if not config.get("norm_topk_prob", True) and topk > 1:
        problems.append("norm_topk_prob=false (Megatron-Core renormalises the chosen experts' "
                        "sigmoid scores)")
    if groups > 1 and topk // group_topk != 2:
        problems.append(f"n_group={groups} with num_experts_per_tok={topk} and topk_group="
                        f"{group_topk} (groups are ranked by their two best scores, which "
                        "Megatron-Core does when num_experts_per_tok / topk_group = 2)")
    shared = int(config.get("n_shared_experts") or 0) * int(config["moe_intermediate_size"])
    return dict(num_experts=int(config["n_routed_experts"]), moe_router_topk=topk,
                moe_ffn_hidden_size=int(config["moe_intermediate_size"]),
                moe_router_score="sigmoid", moe_router_expert_bias=True,
                moe_router_groups=groups if groups > 1 else 0,
                moe_router_group_topk=group_topk if groups > 1 else 0,
                moe_router_scaling=float(config.get("routed_scaling_factor", 1.0)),
                moe_shared_expert_ffn_hidden_size=shared, moe_aux_loss_coeff=0.0001,
                moe_dense_layers=int(config.get("first_k_dense_replace") or 0))


def _yarn_fields(scaling: Mapping, problems: list) -> dict:
    """DeepSeek-V3's YaRN as MLATransformerConfig takes it. transformers derives the cos/sin
    magnitude from mscale and mscale_all_dim only when both are set (else from the factor alone)
    and truncates the correction range unless ``truncate`` is false; Megatron-Core always uses
    both terms and always truncates: settings where the two differ are refused."""
    mscale, all_dim = scaling.get("mscale"), float(scaling.get("mscale_all_dim") or 0.0)
    ignored = (not all_dim and float(mscale or 1.0) != 1.0) or (mscale is None and all_dim)
    if ignored:
        problems.append(f"rope_scaling mscale={mscale} with mscale_all_dim={all_dim or None} "
                        "(transformers then ignores one of them, Megatron-Core does not)")
    for key, ok in (("attention_factor", scaling.get("attention_factor") is None),
                    ("truncate", scaling.get("truncate", True)),
                    ("factor", scaling.get("factor") is not None)):
        if not ok:
            problems.append(f"rope_scaling.{key}={scaling.get(key)} (YaRN with the factor given, "
                            "the attention factor derived and the correction range truncated)")
    return dict(rope_scaling="yarn", rope_scaling_factor=float(scaling.get("factor") or 1.0),
                rope_original_max_positions=int(scaling.get("original_max_position_embeddings")
                                                or 0),
                yarn_beta_fast=float(scaling.get("beta_fast") or 32.0),
                yarn_beta_slow=float(scaling.get("beta_slow") or 1.0),
                yarn_mscale=float(mscale or 1.0), yarn_mscale_all_dim=all_dim)


def _deepseek_v3_fields(config: Mapping, problems: list) -> dict:
    """DeepSeek-V3 (and Kimi K2, which shares its model_type): a Llama with multi-latent
    attention and, after ``first_k_dense_replace`` dense layers, experts with a shared expert
    and a sigmoid router, YaRN RoPE. Its multi-token-prediction layers are refused with the
    weights (:func:`extra_layer_tensors`)."""
    if config.get("attention_bias"):
        problems.append("attention_bias=true (DeepSeek-V3 has no biases)")
    theta, scaling = _rope(config)
    yarn = scaling.get("rope_type") == "yarn"
    fields = _llama_fields({**config, "attention_bias": False, "head_dim": None,
                            "num_key_value_heads": None, "rope_scaling": None,
                            "rope_parameters": {"rope_theta": theta} if yarn else
                            config.get("rope_parameters")}, problems)
    fields.update(_deepseek_v3_attention(config, problems), **_deepseek_v3_router(config,
                                                                                   problems))
    if yarn:
        fields.update(_yarn_fields(scaling, problems))
    return fields


def extra_layer_tensors(layers: int, names) -> list[str]:
    """Tensor names of layers beyond the model's ``layers`` (DeepSeek-V3's
    multi-token-prediction layers, ``model.layers.61.*``), which no family here builds."""
    import re

    pattern = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")
    return [name for name in names
            if (m := pattern.match(name)) and int(m.group(1)) >= layers]


def weight_names(directory) -> list[str]:
    """Tensor names of an HF directory's safetensors weights (the index, or the one file's
    header); [] when there are none."""
    import json
    from pathlib import Path

    index = Path(directory) / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    single = Path(directory) / "model.safetensors"
    if not single.is_file():
        return []
    from safetensors import safe_open

    with safe_open(str(single), "numpy") as handle:
        return list(handle.keys())


def check_weights(config: Mapping, directory, layers: int) -> None:
    """UnsupportedModel when the weights hold layers beyond the model's ``layers`` (DeepSeek-V3's
    multi-token prediction), naming them and the fix; before any tensor is read."""
    extra = extra_layer_tensors(layers, weight_names(directory))
    if extra:
        names = sorted({".".join(n.split(".")[:3]) for n in extra})
        raise UnsupportedModel(f"{directory}", [
            f"{len(extra)} tensors of {', '.join(names)} beyond num_hidden_layers="
            f"{layers} (multi-token-prediction layers, "
            f"num_nextn_predict_layers={config.get('num_nextn_predict_layers')}: not built "
            "here, so they would not come back out of to_hf); import a copy of the directory "
            "whose model.safetensors.index.json leaves them out to train without them"])


def _gpt2_fields(config: Mapping, problems: list) -> dict:
    hidden = int(config["n_embd"])
    act = config.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        problems.append(f"activation_function={act!r} (gelu_new, gelu_pytorch_tanh or gelu)")
    if config.get("scale_attn_by_inverse_layer_idx"):
        problems.append("scale_attn_by_inverse_layer_idx=true (not in Megatron-Core)")
    if config.get("scale_attn_weights", True) is False:
        problems.append("scale_attn_weights=false (Megatron-Core scales by 1/sqrt(head dim))")
    positions = int(config.get("n_positions", 1024))
    return dict(arch="gpt2", activation=GPT2_ACTIVATIONS.get(act, "gelu"),
                num_layers=int(config["n_layer"]), hidden_size=hidden,
                ffn_hidden_size=int(config.get("n_inner") or 4 * hidden),
                num_attention_heads=int(config["n_head"]), vocab_size=int(config["vocab_size"]),
                norm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)),
                untie_embeddings_and_output_weights=False, add_bias_linear=True,
                max_position_embeddings=positions, seq_length=positions)


def model_fields(config: Mapping, source: str = "config.json") -> dict:
    """ModelConfig fields (a plain dict, ``name`` included) of an HF config; UnsupportedModel
    when it cannot be converted."""
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise UnsupportedModel(source, [f"model_type={kind!r} (supported: "
                                        f"{', '.join(FAMILIES)})"])
    problems: list[str] = []
    fields = {"llama": _llama_fields, "mixtral": _mixtral_fields, "gpt2": _gpt2_fields,
              "qwen2": _qwen2_fields, "qwen3": _qwen3_fields, "mistral": _mistral_fields,
              "phi3": _phi3_fields, "qwen3_moe": _qwen3_moe_fields,
              "olmo2": _olmo2_fields, "gemma3_text": _gemma3_fields,
              "gemma3": _gemma3_multimodal_fields,
              "deepseek_v3": _deepseek_v3_fields}[kind](config, problems)
    quantized = (config.get("quantization_config") or {}).get("quant_method")
    if quantized:
        problems.append(f"quantization_config.quant_method={quantized!r} (quantized weights, "
                        "e.g. DeepSeek-V3's published FP8 blocks: dequantize them to bf16 "
                        "first, then import)")
    if config.get("tie_word_embeddings") is False and kind == "gpt2":
        problems.append("tie_word_embeddings=false (GPT-2 always ties its output layer)")
    if problems:
        raise UnsupportedModel(source, problems)
    name = str(config.get("_name_or_path") or "").rstrip("/").rsplit("/", 1)[-1]
    fields["name"] = name or f"hf_{kind}"
    fields["hf_family"] = "gemma3_text" if kind == "gemma3" else kind
    return fields


def architecture_differences(hf: Mapping, composed: Mapping) -> list[tuple[str, Any, Any]]:
    """``(field, HF value, composed value)`` for every architecture field of the composed
    ``model`` that differs from the HF config's (both ModelConfig field mappings)."""
    from launcher.shape import ResolvedModel

    a, b = (ResolvedModel.of_fields(m).architecture() for m in (hf, composed))
    return [(key, a[key], b.get(key)) for key in a if a[key] != b.get(key)]
