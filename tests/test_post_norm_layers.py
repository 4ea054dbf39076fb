"""The layers trainwright builds from rewritten specs (launcher/engines/layer_spec.py), trained at
TP=2 with sequence parallelism by both engines: OLMo 2's (norms after attention and MLP, query
and key norms over all heads) and Gemma 3's (zero-centred norms on both sides, per-head QK norms,
scaled embeddings, GeGLU, windowed layers with their own RoPE base between full ones). The norms
over all heads sum their squares over the TP group and split their weights with the heads; the
post-norms see a slice of the sequence under SP; the per-head norms' gradients are summed over
TP. Any of these wrong and TP=2 trains another model than TP=1: the losses and gradient norms of
3 steps are compared (fp32, same initial weights and data). DeepSeek-V3's multi-latent attention
(its latent norms see a slice of the sequence under SP, its down-projections are split over TP and
gathered) with dense first layers, a shared expert and a grouped sigmoid router is trained the
same way (its expert bias, moved after each step, on engine=megatron only)."""

from __future__ import annotations

import pytest

OLMO2 = ["model.qk_layernorm=true", "model.qk_layernorm_all_heads=true",
         "model.norm_placement=post"]
GEMMA3 = ["model.qk_layernorm=true", "model.norm_placement=pre_post",
          "model.norm_zero_centered=true", "model.scale_embeddings=true",
          "model.activation=gelu_tanh", "model.kv_channels=32", "model.softmax_scale_dim=24",
          "model.window_size=8", "model.full_attention_every=2", "model.rotary_base_local=10000",
          "model.rope_scaling=linear", "model.rope_scaling_factor=8"]
MLA = ["model.num_query_groups=0", "model.kv_channels=16", "model.kv_lora_rank=32",
       "model.q_lora_rank=48", "model.qk_rope_head_dim=8", "model.v_head_dim=24"]
DEEPSEEK_V3 = MLA + ["model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=64",
               "model.moe_router_score=sigmoid", "model.moe_router_groups=2",
               "model.moe_router_group_topk=1", "model.moe_router_scaling=2.5",
               "model.moe_shared_expert_ffn_hidden_size=64", "model.moe_dense_layers=1"]
MODELS = {"olmo2": OLMO2, "gemma3": GEMMA3, "deepseek_v3": DEEPSEEK_V3}
MEGATRON_ONLY = {"deepseek_v3": ["model.moe_router_expert_bias=true"]}
"""Settings engine=deepspeed refuses, tested on engine=megatron only (the expert bias is
updated in Megatron-Core's finalize_model_grads)."""
TP2_SP = ["parallelism.tensor_parallel_size=2", "parallelism.sequence_parallel=true"]


def engines_worker(args: dict) -> dict:
    """TP=1 (both ranks the same replica) and TP=2 + SP, for each engine, 3 steps each."""
    from tests.helpers.engines import build, run_layout, train

    out, model = {}, MODELS[args["model"]]
    # one micro-batch a step: TP=1's two replicas see the same batch, as TP=2's one does
    extra = MEGATRON_ONLY.get(args["model"], [])
    layouts = [("tp1", model, 4), ("tp2", model + TP2_SP, 2)]
    if args["model"] == "deepseek_v3":  # the rotated key's gradient summed without SP too
        # (dense: Megatron-Core trains experts at TP > 1 with sequence parallelism only)
        layouts += [("tp1_dense", MLA, 4), ("tp2_dense_no_sp", MLA + TP2_SP[:1], 2)]
    for name, layout, batch in layouts:
        more = extra if layout[:len(model)] == model else []
        cfg, _, eng = build(layout + more + [f"trainer.global_batch_size={batch}"])
        out[f"megatron_{name}"] = train(eng, cfg, 3, data_seed=7)
        out[f"deepspeed_{name}"] = run_layout(layout + ["parallelism.zero_stage=1"], 3,
                                              data_seed=7)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
def test_rewritten_layers_train_the_same_model_at_tp2_with_sequence_parallelism(model):
    from tests.helpers.dist import run_distributed

    ranks = run_distributed("tests.test_post_norm_layers:engines_worker", 2, {"model": model})
    for rank in ranks:
        pairs = [("tp1", "tp2"), ("tp1_dense", "tp2_dense_no_sp")]
        for engine, (one, two) in [(e, p) for e in ("megatron", "deepspeed") for p in pairs
                                   if f"{e}_{p[0]}" in rank]:
            tp1, tp2 = rank[f"{engine}_{one}"], rank[f"{engine}_{two}"]
            assert tp1["loss"][-1] < tp1["loss"][0], (engine, tp1["loss"])
            for a, b in zip(tp1["loss"], tp2["loss"]):
                assert abs(a - b) < 1e-4, (engine, tp1["loss"], tp2["loss"])
            for a, b in zip(tp1["grad_norm"], tp2["grad_norm"]):
                assert abs(a - b) < 1e-4 * max(1.0, a), (engine, tp1["grad_norm"],
                                                          tp2["grad_norm"])
