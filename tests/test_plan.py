"""The plan's derived numbers: layout, batch, parameters, memory and FLOPs."""

import json
import subprocess
import sys

import pytest

from launcher.compose import compose_config, to_object
from launcher.config import EngineName, Precision, Recompute
from launcher.plan import PlanError, compute_plan
from launcher.plan.__main__ import main
from launcher.plan.memory import ActivationSettings, layer_activation_bytes, state_bytes_per_param
from launcher.plan.params import count_parameters
from launcher.shape.model import ResolvedModel

EXP_70B = "experiment=llama3_70b_16k_h100"


def plan_of(*overrides, world_size=None):
    return compute_plan(to_object(compose_config(list(overrides))), world_size)


def test_70b_16k_layout_and_batch():
    p = plan_of(EXP_70B)
    assert (p.dims.world, p.machines.nodes, p.machines.gpus_per_node) == (16384, 2048, 8)
    assert (p.dims.tp, p.dims.pp) == (8, 4)
    assert p.dims.model_parallel == 32 and p.dims.dp == 512
    assert p.dims.tp_groups == 2048 and p.dims.pp == 4
    assert p.batch.micro_batch_tokens == 32_768 and p.batch.grad_accum_steps == 4
    assert p.batch.global_batch_size == 8192 and p.batch.global_batch_tokens == 67_108_864
    assert p.batch.train_tokens == 15_000_000_000_000
    assert p.batch.train_steps == -(-15_000_000_000_000 // 67_108_864)  # ceil: 223,518


def test_70b_global_batch_512_sequences():
    p = plan_of(EXP_70B, "trainer.global_batch_size=512", "trainer.micro_batch_size=1")
    assert p.batch.global_batch_tokens == 4_194_304 and p.batch.grad_accum_steps == 1
    assert p.batch.train_steps == 3_576_279  # about 3.58 million
    assert round(p.batch.train_steps / 1e6, 2) == 3.58


def test_70b_fits_with_full_recompute_not_with_selective():
    full = plan_of(EXP_70B)
    assert full.memory.per_gpu.total < full.machines.gpu_memory_bytes
    with pytest.raises(PlanError) as info:
        plan_of(EXP_70B, "trainer.activation_recompute=selective")
    selective = info.value.plan
    assert selective.memory.per_gpu.total > selective.machines.gpu_memory_bytes
    assert selective.memory.per_gpu.activations > 10 * full.memory.per_gpu.activations
    assert "trainer.activation_recompute=full" in str(info.value)
    # state does not depend on recompute
    assert selective.memory.per_gpu.weights == full.memory.per_gpu.weights


@pytest.mark.parametrize("preset,published", [
    ("llama3_1b", 1_235_814_400), ("llama3_8b", 8_030_261_248), ("llama3_70b", 70_553_706_496),
    ("llama3_405b", 405_853_388_800), ("mixtral_8x7b", 46_702_792_704),
    ("gpt2_124m", 124_439_808), ("qwen2_5_7b", 7_615_616_512),
    ("qwen3_8b", 8_190_735_360), ("mistral_7b", 7_241_732_096),
    ("phi3_mini", 3_821_079_552), ("qwen3_30b_a3b", 30_532_122_624),
    ("olmo2_7b", 7_298_617_344), ("gemma3_12b", 11_766_034_176),
])
def test_preset_parameter_totals_match_published(preset, published):
    model = to_object(compose_config([f"model={preset}"])).model
    counts = count_parameters(model)
    assert counts.total_unpadded == published
    parts = (counts.embedding + counts.attention + counts.mlp + counts.norms
             + counts.output_layer)
    assert parts == counts.total


def test_vocab_padding_reported_separately():
    p = plan_of("model=gpt2_124m")
    assert p.model.padded_vocab == 50_304  # 50,257 rounded up to 128
    assert p.params.vocab_padding == (50_304 - 50_257) * 768  # tied: one table
    assert p.params.total - p.params.total_unpadded == p.params.vocab_padding
    p8 = plan_of(EXP_70B)
    assert p8.model.padded_vocab == 129_024  # 128,256 rounded up to 128 x TP 8


def test_mixtral_active_parameters():
    model = to_object(compose_config(["model=mixtral_8x7b"])).model
    assert count_parameters(model).active_per_token == 12_879_925_248


def test_params_per_gpu_split_by_tp_and_pp():
    base = plan_of("cluster.gpus_per_node=1", "model=llama3_8b", "cluster.gpu=cpu",
                   "trainer.micro_batch_size=1", "trainer.activation_recompute=full")
    tp2 = plan_of("cluster.gpus_per_node=2", "model=llama3_8b", "cluster.gpu=cpu",
                  "parallelism.tensor_parallel_size=2", "trainer.micro_batch_size=1",
                  "trainer.activation_recompute=full")
    norms = (2 * 32 + 1) * 4096  # replicated on every TP rank
    assert tp2.params.per_gpu == (base.params.total - norms) // 2 + norms


def _dims(**over):
    model = to_object(compose_config(["model=gpt2_124m"] + [f"model.{k}={v}"
                                                            for k, v in over.items()])).model
    return ResolvedModel.of(model)


@pytest.mark.parametrize("tp,sp", [(1, False), (4, False), (4, True)])
def test_activations_match_korthikanti_formula(tp, sp):
    """GPT block, MHA, ffn=4h, dropout: sbh(10 + 24/t + 9as/(ht)) without SP, /t with SP.

    Korthikanti et al. count 5 bytes per attention score (half-precision softmax output 2,
    dropout mask 1, dropped-out probabilities 2); Megatron-Core's unfused attention keeps the
    softmax output in fp32 (4) and its half-precision cast (2) as well: 9 bytes.
    """
    d = _dims()
    s, b, h, a = 1024, 2, 768, 12
    settings = ActivationSettings(b, s, tp, sp, Recompute.none, False, 2, True, True)
    expected = s * b * h * ((34 / tp) if sp else (10 + 24 / tp)) + 9 * a * s * s * b / tp
    assert layer_activation_bytes(d, settings) == pytest.approx(expected)
    selective = ActivationSettings(b, s, tp, sp, Recompute.selective, False, 2, True, True)
    assert layer_activation_bytes(d, selective) == pytest.approx(expected - 9 * a * s * s * b / tp)
    no_dropout = ActivationSettings(b, s, tp, sp, Recompute.none, False, 2, True, False)
    assert layer_activation_bytes(d, settings) - layer_activation_bytes(d, no_dropout) == \
        pytest.approx(3 * a * s * s * b / tp)
    fp32 = ActivationSettings(b, s, tp, sp, Recompute.none, False, 4, True, False)
    scores = layer_activation_bytes(d, fp32) - layer_activation_bytes(
        d, ActivationSettings(b, s, tp, sp, Recompute.selective, False, 4, True, False))
    assert scores == pytest.approx(4 * a * s * s * b / tp)  # fp32: the softmax output only
    full = ActivationSettings(b, s, tp, sp, Recompute.full, False, 2, True, True)
    assert layer_activation_bytes(d, full) == pytest.approx(2 * s * b * h / (tp if sp else 1))


def test_norms_on_both_sides_and_qk_norms_keep_their_inputs():
    """Gemma's norms after attention and MLP keep the two outputs they normalise; QK norms keep
    the queries and keys they normalise (hidden 64, 4 heads of 16, 2 groups, bf16, TP=2, SP)."""
    def layer(*overrides):
        model = to_object(compose_config(["model=tiny", "model.num_query_groups=2",
                                          *overrides])).model
        settings = ActivationSettings(2, 256, 2, True, Recompute.selective, True, 2, True, False)
        return ResolvedModel.of(model), layer_activation_bytes(ResolvedModel.of(model), settings)

    d, base = layer()
    _, qk = layer("model.qk_layernorm=true")
    _, both = layer("model.qk_layernorm=true", "model.norm_placement=pre_post")
    tokens = 2 * 256
    assert qk - base == tokens * (d.q_dim + d.kv_dim) * 2 / 2
    assert both - qk == 2 * tokens * d.hidden * 2 / 2


def test_flops_match_megatron_formula():
    """72 B s L h^2 (1 + s/6h + V/12hL) for a GPT block (Narayanan et al. 2021)."""
    p = plan_of("model=gpt2_124m", "trainer.micro_batch_size=8")
    B, s, L, h, V = p.batch.global_batch_size, 1024, 12, 768, 50_304
    expected = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert p.compute.flops_per_step == pytest.approx(expected)


def test_causal_flops_count_half_the_attention_scores_as_megatron_lm_logs():
    """Megatron-LM's logged TFLOP/s: 72 B s L h^2 (1 + s/12h + V/12hL); mfu_causal scales the
    plan's mfu by the same ratio and the report shows both."""
    p = plan_of("model=gpt2_124m", "trainer.micro_batch_size=8")
    B, s, L, h, V = p.batch.global_batch_size, 1024, 12, 768, 50_304
    causal = 72 * B * s * L * h * h * (1 + s / (12 * h) + V / (12 * h * L))
    assert p.compute.flops_per_token_causal * B * s == pytest.approx(causal)
    assert p.compute.mfu_causal == pytest.approx(p.compute.mfu * causal / p.compute.flops_per_step)
    assert p.compute.mfu_causal < p.compute.mfu


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_state_bytes(stage):
    b = state_bytes_per_param(precision=Precision.bf16, engine=EngineName.deepspeed,
                              zero_stage=stage, grad_fp32=False, offload_optimizer=False,
                              offload_params=False, shards=8)
    expected = {0: (2, 2, 12), 1: (2, 2, 1.5), 2: (2, 0.25, 1.5), 3: (0.25, 0.25, 1.5)}[stage]
    assert (b.weights, b.grads, b.optimizer) == expected


def test_megatron_distributed_optimizer_bytes():
    """Megatron-Core docs: 6 + 12/d bytes per parameter with fp32 gradients."""
    b = state_bytes_per_param(precision=Precision.bf16, engine=EngineName.megatron, zero_stage=1,
                              grad_fp32=True, offload_optimizer=False, offload_params=False,
                              shards=4)
    assert b.weights + b.grads + b.optimizer == 6 + 12 / 4


def test_memory_breakdown_sums_and_offload_moves_state_to_cpu():
    on_gpu = plan_of("parallelism.zero_stage=3")
    m = on_gpu.memory.per_gpu
    assert m.total == pytest.approx(m.weights + m.grads + m.optimizer + m.activations, abs=4)
    off = plan_of("parallelism=zero3_offload").memory.per_gpu
    assert off.optimizer == 0 and off.cpu_offload > 0 and off.weights < m.weights


def test_zero_stages_shrink_memory_monotonically():
    totals = [plan_of(f"parallelism.zero_stage={s}", "cluster.gpus_per_node=8").memory.per_gpu
              for s in range(4)]
    state = [t.weights + t.grads + t.optimizer for t in totals]
    assert state == sorted(state, reverse=True) and len(set(state)) == 4


def test_redundant_state_shrinks_with_zero3():
    z1 = plan_of("cluster.gpus_per_node=8", "parallelism.zero_stage=1")
    z3 = plan_of("cluster.gpus_per_node=8", "parallelism.zero_stage=3")
    assert z1.memory.training_state_bytes == z3.memory.training_state_bytes
    assert z3.memory.redundant_state_bytes < z1.memory.redundant_state_bytes


def test_step_budget_gives_tokens():
    p = plan_of("trainer.train_steps=10", "trainer.train_tokens=0", "optimizer.warmup_steps=2")
    assert p.batch.train_tokens == 10 * p.batch.global_batch_tokens


def test_time_estimates_consistent():
    """The step time is the step-time model's sum of causes (issue 13: one MFU for every layout
    could not tell layouts apart); plan.mfu > 0 still selects the old flat assumption."""
    p = plan_of(EXP_70B)
    assert p.compute.step_time_s == pytest.approx(sum(p.compute.parts.values()))
    assert p.compute.mfu == pytest.approx(
        p.compute.flops_per_step / (p.dims.world * p.machines.peak_tflops_per_gpu * 1e12 * p.compute.step_time_s))
    flat = plan_of(EXP_70B, "plan.mfu=0.4")
    assert flat.compute.step_time_s == pytest.approx(
        flat.compute.flops_per_step / (flat.dims.world * flat.machines.peak_tflops_per_gpu * 1e12 * 0.4)
        * (1 + flat.compute.bubble_fraction))
    assert p.compute.time_to_train_days == pytest.approx(p.batch.train_steps * p.compute.step_time_s / 86400)
    assert p.compute.tokens_per_s == pytest.approx(p.batch.global_batch_tokens / p.compute.step_time_s)


def test_world_size_argument_overrides_cluster():
    p = plan_of("cluster.gpus_per_node=1", world_size=4)
    assert p.dims.world == 4 and p.dims.dp == 4


REQUIRED_JSON_KEYS = {
    "world_size", "nodes", "gpus_per_node", "tensor_parallel_size", "pipeline_parallel_size",
    "context_parallel_size", "expert_parallel_size", "data_parallel_size", "model_parallel_size",
    "micro_batch_size", "micro_batch_tokens", "grad_accum_steps", "global_batch_size",
    "global_batch_tokens", "train_steps", "train_tokens", "params_total", "params_per_gpu",
    "memory_per_gpu", "training_state_bytes", "flops_per_step", "step_time_s",
    "time_to_train_days",
}


def test_cli_json_is_one_object_with_required_keys():
    out = subprocess.run([sys.executable, "-m", "launcher.plan", EXP_70B, "plan.format=json"],
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert REQUIRED_JSON_KEYS <= set(data)
    assert set(data["memory_per_gpu"]) >= {"weights", "grads", "optimizer", "activations",
                                            "total"}
    assert data["global_batch_tokens"] == 67_108_864


def test_cli_table(capsys):
    assert main([EXP_70B]) == 0
    out = capsys.readouterr().out
    causal = f"{plan_of(EXP_70B).compute.mfu_causal:.1%} causal"
    for text in ("16,384", "2,048 nodes", "67,108,864", "223,518", "fits", causal):
        assert text in out


def test_unfused_swiglu_keeps_one_more_ffn_per_token():
    """On a GPU the model uses the fused bias-SwiGLU (input kept: 2 x ffn, plus the fc2 input);
    without it (CPU) the SiLU output is kept too: one more ffn-sized tensor per token."""
    from dataclasses import replace

    model = to_object(compose_config(["model=llama3_1b"])).model
    d = ResolvedModel.of(model)
    fused = ActivationSettings(2, 128, 1, False, Recompute.none, True, 2, False, False)
    unfused = replace(fused, fused_glu=False)
    extra = layer_activation_bytes(d, unfused) - layer_activation_bytes(d, fused)
    assert extra == 2 * 128 * model.ffn_hidden_size * 2
    # bf16 on both: auto would train fp32 on a CPU without bf16 instructions (AVX2 hosts)
    gpu = plan_of("model=llama3_1b", "cluster=local_gpu", "trainer.attention_backend=flash",
                  "trainer.micro_batch_size=1", "trainer.cross_entropy_fusion=off",
                  "trainer.precision=bf16")
    cpu = plan_of("model=llama3_1b", "cluster=local_gpu", "cluster.gpu=cpu",
                  "trainer.attention_backend=flash", "trainer.micro_batch_size=1",
                  "trainer.cross_entropy_fusion=off", "trainer.precision=bf16")
    per_layer = extra * model.seq_length * cpu.batch.micro_batch_size / (2 * 128)
    assert cpu.memory.per_gpu.activations - gpu.memory.per_gpu.activations == \
        pytest.approx(per_layer * model.num_layers)


def test_a_sliding_window_bounds_the_attention_flops_and_is_refused_with_chat_rows_on_te():
    """model.window_size: a query's scores cover W keys (W - W^2 / 2s under the causal mask);
    a window as long as the sequence changes nothing; packed chat rows are refused where they
    would go to Transformer Engine (unchecked), not on the local attention."""
    from launcher.plan.flops import attended_keys, forward_flops_per_token
    from launcher.plan.validate import _check_window
    from launcher.shape.model import ResolvedModel

    def resolved(*overrides):
        return ResolvedModel.of(to_object(compose_config(["model=tiny", *overrides])).model)

    full, windowed, long = resolved(), resolved("model.window_size=16"), \
        resolved("model.window_size=4096")
    assert full.seq == 256
    assert (attended_keys(full, False), attended_keys(full, True)) == (256, 128)
    assert (attended_keys(windowed, False), attended_keys(windowed, True)) == (16, 15.5)
    assert forward_flops_per_token(long, True) == forward_flops_per_token(full, True)
    saved = 2 * 2 * (128 - 15.5) * full.q_dim * full.layers
    assert forward_flops_per_token(full, True) - forward_flops_per_token(windowed, True) == saved
    # Gemma 3's layers are built from Megatron-Core's local spec: unfused attention on a GPU too
    small = ["cluster=slurm_h100", "engine=megatron", "trainer.micro_batch_size=1",
             "trainer.activation_recompute=full", "parallelism.tensor_parallel_size=8"]
    gemma, llama = plan_of("model=gemma3_12b", *small), plan_of("model=llama3_8b", *small)
    assert llama.memory.flash_attention and not gemma.memory.flash_attention
    # Gemma 3's interleaving: layers 2 and 4 of 4 attend over the sequence, 1 and 3 within 16
    mixed = resolved("model.window_size=16", "model.full_attention_every=2",
                     "model.num_layers=4")
    assert mixed.windowed_layers == 2
    assert attended_keys(mixed, True) == (15.5 + 128) / 2 and attended_keys(mixed, False) == 136
    # packed chat rows: the local attention (CPU; Gemma's rewritten layers anywhere) combines
    # the window with their mask; Transformer Engine's THD path is unchecked and refused
    chat = ["model.window_size=64", "data.format=chat"]
    assert _check_window(to_object(compose_config(chat)), 1) == []
    [problem] = _check_window(to_object(compose_config(chat + ["cluster=slurm_h100"])), 1)
    assert problem.keys == ("model.window_size", "data.format", "cluster.gpu")
    assert "model.window_size=64 with data.format=chat on cluster.gpu=" in problem.message
    gemma_chat = to_object(compose_config(["model=gemma3_12b", "data.format=chat",
                                           "cluster=slurm_h100"]))
    assert _check_window(gemma_chat, 1) == []


# DeepSeek-V3: multi-latent attention, a shared expert, dense first layers. The preset, and a
# small variant without a query latent, with two shared experts and a padded vocabulary.
DEEPSEEK_SMALL = ["model.num_layers=6", "model.hidden_size=256", "model.ffn_hidden_size=512",
                  "model.num_attention_heads=4", "model.kv_channels=32",
                  "model.qk_rope_head_dim=16", "model.v_head_dim=24", "model.q_lora_rank=0",
                  "model.kv_lora_rank=64", "model.vocab_size=1000", "model.num_experts=8",
                  "model.moe_router_topk=4", "model.moe_router_groups=4",
                  "model.moe_router_group_topk=2", "model.moe_ffn_hidden_size=64",
                  "model.moe_shared_expert_ffn_hidden_size=128", "model.moe_dense_layers=2"]
DEEPSEEK = {"deepseek_v3_671b": [], "small_no_q_lora": DEEPSEEK_SMALL}


def _deepseek_model(name):
    return to_object(compose_config(["model=deepseek_v3_671b", *DEEPSEEK[name]])).model


def _hf_deepseek(model):
    """Hugging Face's DeepseekV3ForCausalLM of the same shape, on the meta device."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size, moe_intermediate_size=model.moe_ffn_hidden_size,
        num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_attention_heads,
        n_shared_experts=model.moe_shared_expert_ffn_hidden_size // model.moe_ffn_hidden_size,
        n_routed_experts=model.num_experts, routed_scaling_factor=model.moe_router_scaling,
        kv_lora_rank=model.kv_lora_rank, q_lora_rank=model.q_lora_rank or None,
        qk_rope_head_dim=model.qk_rope_head_dim, v_head_dim=model.v_head_dim,
        qk_nope_head_dim=model.kv_channels, n_group=model.moe_router_groups,
        topk_group=model.moe_router_group_topk, num_experts_per_tok=model.moe_router_topk,
        first_k_dense_replace=model.moe_dense_layers, max_position_embeddings=model.seq_length,
        rms_norm_eps=model.norm_epsilon,
        tie_word_embeddings=not model.untie_embeddings_and_output_weights)
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(cfg)


@pytest.fixture(scope="module")
def hf_deepseek():
    """{variant: (our ModelConfig, {parameter name: numel} of the HF meta model)}."""
    out = {}
    for name in DEEPSEEK:
        model = _deepseek_model(name)
        hf = _hf_deepseek(model)
        out[name] = model, {n: p.numel() for n, p in hf.named_parameters()}
        assert sum(out[name][1].values()) == hf.num_parameters()
    return out


@pytest.mark.parametrize("name", sorted(DEEPSEEK))
def test_deepseek_v3_counts_equal_transformers(name, hf_deepseek):
    """The plan's total (vocabulary padding aside) is num_parameters() of transformers'
    DeepseekV3ForCausalLM (its e_score_correction_bias is a buffer, as Megatron-Core's
    expert_bias); the active count leaves out (experts - top-k) / experts of its experts."""
    model, hf = hf_deepseek[name]
    counts = count_parameters(model)
    assert counts.total_unpadded == sum(hf.values())
    experts = sum(n for k, n in hf.items() if ".mlp.experts." in k)
    e, k = model.num_experts, model.moe_router_topk
    assert counts.active_per_token == sum(hf.values()) - experts * (e - k) // e
    assert counts.embedding + counts.attention + counts.mlp + counts.norms \
        + counts.output_layer == counts.total


def _hf_stage(hf: dict, numbers, first: bool, last: bool, experts_only=False) -> int:
    """Parameters of the HF model's layers ``numbers`` (+ the embedding on the first stage, the
    final norm and output layer on the last)."""
    prefixes = tuple(f"model.layers.{i}." for i in numbers)
    total = 0
    for key, n in hf.items():
        if experts_only:
            total += n if key.startswith(prefixes) and ".mlp.experts." in key else 0
        elif key.startswith(prefixes) or (first and key.startswith("model.embed_tokens")) \
                or (last and (key == "model.norm.weight" or key.startswith("lm_head"))):
            total += n
    return total


@pytest.mark.parametrize("name,layout", [
    ("deepseek_v3_671b", ["parallelism.pipeline_parallel_size=8",
                          "parallelism.layers_in_first_stage=5",
                          "parallelism.layers_in_last_stage=8"]),
    ("deepseek_v3_671b", ["parallelism.pipeline_parallel_size=3",
                          "parallelism.account_for_embedding_in_pipeline_split=true",
                          "parallelism.account_for_loss_in_pipeline_split=true",
                          "parallelism.expert_parallel_size=8"]),
    ("small_no_q_lora", ["parallelism.pipeline_parallel_size=3"]),
    ("small_no_q_lora", ["parallelism.pipeline_parallel_size=2",
                         "parallelism.virtual_pipeline_parallel_size=3",
                         "parallelism.expert_parallel_size=4"]),
    ("small_no_q_lora", ["parallelism.pipeline_parallel_size=2",
                         "parallelism.layers_in_last_stage=2"]),
    ("small_no_q_lora", ["parallelism.pipeline_parallel_size=4",  # the 3rd stage holds most
                         "parallelism.layers_in_first_stage=1",
                         "parallelism.layers_in_last_stage=1"]),
])
def test_deepseek_v3_stages_hold_their_layers_parameters(name, layout, hf_deepseek):
    """Per pipeline stage (TP=1), what one GPU holds equals the HF model's parameters of the
    layers Megatron-Core places there, dense first layers included; the stages sum to the
    total; with EP the expert parameters of the stages x EP are the HF model's experts; the
    plan's per-GPU count is the most loaded stage of all."""
    from launcher.plan.params import stage_params
    from launcher.shape.dims import ParallelDims
    from launcher.shape.stages import split_problems

    model, hf = hf_deepseek[name]
    cfg = to_object(compose_config(["model=deepseek_v3_671b", *DEEPSEEK[name], "engine=megatron",
                                    "cluster=slurm_h100", "trainer.micro_batch_size=1",
                                    "trainer.global_batch_size=64", *layout]))
    world = cfg.parallelism.pipeline_parallel_size * 8
    dims = ParallelDims.build(cfg.parallelism, world)
    assert split_problems(model.num_layers, dims.pp, dims.vpp, dims.split) == []
    numbers = dims.stage_layer_numbers(model.num_layers)
    assert sorted(i for stage in numbers for i in stage) == list(range(model.num_layers))
    stages = [stage_params(model, dims, i == 0, i == dims.pp - 1, stage=i)
              for i in range(dims.pp)]
    padding = count_parameters(model).vocab_padding
    for i, (held, layers) in enumerate(zip(stages, numbers)):
        first, last = i == 0, i == dims.pp - 1
        expert = _hf_stage(hf, layers, first, last, experts_only=True)
        assert held.expert * dims.ep == expert, (i, layers)
        pad = padding // 2 * (int(first) + int(last))
        assert held.dense == _hf_stage(hf, layers, first, last) - expert + pad, (i, layers)
    assert sum(s.dense + s.expert * dims.ep for s in stages) == count_parameters(model).total
    try:
        plan = compute_plan(cfg, world_size=world)
    except PlanError as error:  # over the GPU's memory at TP=1: counted all the same
        plan = error.plan
    assert plan.params.per_gpu == max(s.total for s in stages)


def test_deepseek_v3_flops_are_its_weights_and_attention(hf_deepseek):
    """Forward FLOPs per token = 2 x the weights a token multiplies by (every linear weight of
    the HF model, the routed experts at top-k / experts, embedding and norms not) + QK^T over
    keys of qk_nope + qk_rope and scores x V over values of v_head_dim, per head and layer."""
    from launcher.plan.flops import forward_flops_per_token

    for name in DEEPSEEK:
        model, hf = hf_deepseek[name]
        e, k = model.num_experts, model.moe_router_topk
        weights = sum(n * k // e if ".mlp.experts." in key else n for key, n in hf.items()
                      if "embed_tokens" not in key and "norm" not in key)
        d = ResolvedModel.of(model)
        weights += (d.padded_vocab - d.vocab) * d.hidden  # the padded rows' logits
        heads, s = model.num_attention_heads, model.seq_length
        scores = 2 * s * heads * (model.kv_channels + model.qk_rope_head_dim) \
            + 2 * s * heads * model.v_head_dim
        expected = 2 * weights + model.num_layers * scores
        assert forward_flops_per_token(d) == pytest.approx(expected, rel=1e-12), name


DEEPSEEK_SHARD_LAYOUTS = {  # 2 ranks each; the small variant with a query latent
    "tp2_sp": ["parallelism.tensor_parallel_size=2", "parallelism.sequence_parallel=true"],
    "pp2": ["parallelism.pipeline_parallel_size=2", "model.num_layers=4"],
    "ep2": ["parallelism.expert_parallel_size=2"],
}


def _deepseek_shard_cfg(layout: str):
    from launcher.plan.precision import resolve_precision

    return resolve_precision(to_object(compose_config(
        ["model=deepseek_v3_671b", *DEEPSEEK_SMALL, "model.q_lora_rank=48", "engine=megatron",
         "cluster.gpus_per_node=2", "trainer.micro_batch_size=1", "model.seq_length=64",
         "trainer.global_batch_size=8", *DEEPSEEK_SHARD_LAYOUTS[layout]])))


def deepseek_shards_worker(args: dict) -> dict:
    """Per rank and layout: (all, expert) parameters of the model chunks engine=megatron builds."""
    from megatron.core import parallel_state as ps

    from launcher.engines.megatron.engine import build_model_chunks
    from launcher.engines.model import init_parallel_state

    out = {}
    for layout in DEEPSEEK_SHARD_LAYOUTS:
        cfg = _deepseek_shard_cfg(layout)
        init_parallel_state(cfg.parallelism)
        named = [(n, p.numel()) for chunk in build_model_chunks(cfg.model, cfg.parallelism,
                                                                  cfg.trainer)
                 for n, p in chunk.named_parameters()]
        out[layout] = (sum(n for _, n in named),
                       sum(n for name, n in named if ".mlp.experts." in name))
        ps.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_deepseek_v3_per_gpu_counts_equal_the_local_build():
    """What each of 2 CPU ranks builds (trainwright's local MLA layers: the query
    down-projection split over TP, the key/value one whole) equals the plan's stage numbers with
    te=False: TP=2 + SP, PP=2 (the dense first layers on the first stage), EP=2."""
    from launcher.plan.params import stage_params
    from launcher.shape.dims import ParallelDims
    from tests.helpers.dist import run_distributed

    ranks = run_distributed("tests.test_plan:deepseek_shards_worker", 2, {})
    for layout in DEEPSEEK_SHARD_LAYOUTS:
        cfg = _deepseek_shard_cfg(layout)
        dims = ParallelDims.build(cfg.parallelism, 2)
        for rank, result in enumerate(ranks):
            stage = rank if dims.pp == 2 else 0
            planned = stage_params(cfg.model, dims, stage == 0, stage == dims.pp - 1,
                                   stage=stage, te=False)
            assert tuple(result[layout]) == (planned.total, planned.expert), (layout, rank)
