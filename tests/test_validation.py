"""Each validation rule: triggered, message names keys, values and a fix, exit code 2."""

import os
import subprocess
import sys

import pytest

from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.plan.__main__ import main

CASES = {
    "world_not_multiple_of_model_parallel": (
        ["cluster.gpus_per_node=6", "parallelism.tensor_parallel_size=4"],
        ["world size 6", "TP x PP x CP = 4", "tensor_parallel_size=4", "multiple of 4"]),
    "world_not_multiple_with_experts": (
        ["model.num_experts=8", "parallelism.expert_parallel_size=4",
         "cluster.gpus_per_node=6", "parallelism.tensor_parallel_size=1"],
        ["TP x EP x PP = 4", "expert_parallel_size=4"]),
    "heads_not_divisible_by_tp": (
        ["model.num_attention_heads=12", "model.num_query_groups=12",
         "model.hidden_size=384", "parallelism.tensor_parallel_size=8",
         "cluster.gpus_per_node=8"],
        ["model.num_attention_heads=12 is not divisible by parallelism.tensor_parallel_size=8",
         "1, 2, 3, 4, 6, 12"]),
    "query_groups_not_divisible_by_tp": (
        ["model.num_query_groups=2", "parallelism.tensor_parallel_size=4",
         "cluster.gpus_per_node=4"],
        ["model.num_query_groups=2 is not divisible by parallelism.tensor_parallel_size=4",
         "from 1, 2"]),
    "layers_not_divisible_by_pp_vpp": (
        ["parallelism.pipeline_parallel_size=2", "parallelism.virtual_pipeline_parallel_size=4",
         "engine=megatron"],
        ["model.num_layers=4", "2 x 4 = 8", "1, 2, 4"]),
    "global_batch_not_divisible": (
        ["trainer.global_batch_size=10", "trainer.micro_batch_size=4"],
        ["trainer.global_batch_size=10", "4 x 2 = 8", "multiple of 8", "micro_batch_size from 1, 5"]),
    "window_with_context_parallelism": (
        ["model.window_size=64", "parallelism.context_parallel_size=2", "engine=megatron"],
        ["model.window_size=64 with context_parallel_size=2", "set context_parallel_size=1"]),
    "window_size_negative": (["model.window_size=-1"], ["model.window_size must be >= 0"]),
    "post_norm_with_experts": (
        ["model.norm_placement=post", "model.num_experts=4"],
        ["model.norm_placement=post is built for a dense Llama layer without biases, not with "
         "model.num_experts=4", "set model.norm_placement=pre or change model.num_experts"]),
    "post_norm_gpt2": (
        ["model.norm_placement=post", "model=gpt2_124m"],
        ["not with model.arch=gpt2", "change model.arch"]),
    "windowed_layer_settings_without_a_window": (
        ["model.full_attention_every=6", "model.rotary_base_local=10000"],
        ["model.full_attention_every=6 sets the sliding-window layers apart, but "
         "model.window_size=0 makes none", "model.rotary_base_local=10000 sets"]),
    "zero_centered_layernorm": (
        ["model=gpt2_124m", "model.norm_zero_centered=true"],
        ["model.norm_zero_centered=true is an RMSNorm (arch=llama), not arch=gpt2"]),
    "flash_attention_for_local_layers": (
        ["model.norm_placement=post", "trainer.attention_backend=flash"],
        ["trainer.attention_backend=flash: this model's layers (model.norm_placement=post",
         "set trainer.attention_backend=auto"]),
    "hf_family_without_its_features": (
        ["model.hf_family=qwen2"],
        ["model.hf_family=qwen2 needs model.add_qkv_bias; set model.hf_family=auto"]),
    "hf_family_with_a_feature_it_lacks": (
        ["model.hf_family=llama", "model.window_size=16"],
        ["model.window_size has no place in llama", "set model.hf_family=auto"]),
    "llama_with_exact_gelu": (
        ["model.activation=gelu"],
        ["model.activation=gelu with model.arch=llama", "activation=gelu_tanh"]),
    "all_heads_qk_norm_without_qk_norm": (
        ["model.qk_layernorm_all_heads=true"],
        ["model.qk_layernorm=false has none", "set model.qk_layernorm=true"]),
    "seq_not_divisible_by_2cp": (
        ["model.seq_length=250", "parallelism.context_parallel_size=2", "engine=megatron"],
        ["model.seq_length=250", "2 x context_parallel_size = 4"]),
    "experts_not_divisible_by_ep": (
        ["model.num_experts=6", "parallelism.expert_parallel_size=4",
         "cluster.gpus_per_node=4"],
        ["model.num_experts=6 is not divisible by parallelism.expert_parallel_size=4",
         "1, 2, 3, 6"]),
    "ep_without_experts": (
        ["parallelism.expert_parallel_size=2"],
        ["expert_parallel_size=2 needs a mixture-of-experts model"]),
    "zero23_with_pipeline_on_deepspeed": (
        ["parallelism.pipeline_parallel_size=2", "parallelism.zero_stage=3"],
        ["zero_stage=3 with pipeline_parallel_size=2", "engine=megatron"]),
    "megatron_zero_above_1": (
        ["engine=megatron", "parallelism.zero_stage=2"],
        ["engine=megatron supports parallelism.zero_stage 0", "got 2", "zero_stage=1"]),
    "offload_on_megatron": (
        ["engine=megatron", "parallelism.offload_optimizer=true"],
        ["CPU offload", "engine=deepspeed"]),
    "offload_params_without_zero3": (
        ["parallelism.offload_params=true", "parallelism.zero_stage=2"],
        ["offload_params=true needs zero_stage=3"]),
    "pipeline_on_deepspeed": (
        ["parallelism=pp2"],
        ["parallelism.pipeline_parallel_size=2 is not supported by engine=deepspeed",
         "use engine=megatron"]),
    "async_save_on_deepspeed": (
        ["trainer.async_save=true"],
        ["trainer.async_save=true needs engine=megatron (Megatron-Core dist-checkpointing); "
         "DeepSpeed saves synchronously: set trainer.async_save=false or engine=megatron"]),
    "moe_bias_with_tp": (
        ["model.num_experts=4", "model.add_bias_linear=true",
         "parallelism.tensor_parallel_size=2", "engine=megatron"],
        ["model.add_bias_linear=true", "model.num_experts=4",
         "needs parallelism.tensor_parallel_size=1, got 2", "model.add_bias_linear=false"]),
    "zero_stage_out_of_range": (
        ["parallelism.zero_stage=5"], ["parallelism.zero_stage=5 must be 0, 1, 2 or 3"]),
    "sequence_parallel_without_tp": (
        ["parallelism.sequence_parallel=true"],
        ["sequence_parallel=true needs tensor_parallel_size > 1"]),
    "vpp_without_pp": (
        ["parallelism.virtual_pipeline_parallel_size=2", "engine=megatron"],
        ["virtual_pipeline_parallel_size=2 needs pipeline_parallel_size > 1"]),
    "tokens_and_steps_both_set": (
        ["trainer.train_tokens=1000000", "trainer.train_steps=10"],
        ["set exactly one of trainer.train_tokens=1000000 and trainer.train_steps=10"]),
    "unknown_gpu": (
        ["cluster.gpu=V100X"], ["cluster.gpu='V100X' is not a known device", "H100"]),
    "non_positive_size": (
        ["trainer.micro_batch_size=0"], ["trainer.micro_batch_size=0 must be a positive"]),
    "memory_over_capacity": (
        ["model=llama3_70b", "cluster=slurm_h100", "trainer.micro_batch_size=1"],
        ["exceeds the H100's 79.6 GiB", "memory per GPU", "zero_stage"]),
    "ranks_sharing_a_gpu_over_capacity": (
        ["model=llama3_1b", "cluster=local_gpu", "trainer.micro_batch_size=2",
         "cluster.ranks_per_gpu=2", "trainer.cross_entropy_fusion=off"],
        ["cluster.ranks_per_gpu=2 ranks share each H100", "2 x 44.3 GiB per rank",
         "= 88.5 GiB exceeds its 79.6 GiB", "fewer cluster.ranks_per_gpu (now 2)"]),
    "ranks_per_gpu_on_slurm": (
        ["cluster=slurm_h100", "cluster.ranks_per_gpu=2"],
        ["cluster.ranks_per_gpu=2 with cluster.launcher=slurm", "local launcher",
         "set cluster.ranks_per_gpu=1"]),
    "non_positive_ranks_per_gpu": (
        ["cluster.ranks_per_gpu=0"], ["cluster.ranks_per_gpu=0 must be a positive integer"]),
    "world_with_ranks_per_gpu_not_multiple": (
        ["cluster.gpus_per_node=1", "cluster.ranks_per_gpu=3",
         "parallelism.tensor_parallel_size=2"],
        ["world size 3 (cluster.nodes=1 x cluster.gpus_per_node=1 x cluster.ranks_per_gpu=3)",
         "TP x PP x CP = 2", "TP x PP x CP from 1, 3"]),
    "mfu_out_of_range": (["plan.mfu=1.5"], ["plan.mfu=1.5 must be in (0, 1]"]),
    "negative_lr": (["optimizer.lr=-1"], ["optimizer.lr=-1.0 must be a finite number > 0"]),
    "nan_lr": (["optimizer.lr=nan"], ["optimizer.lr=nan must be a finite number > 0"]),
    "log_interval_zero": (["trainer.log_interval=0"], ["trainer.log_interval=0 must be >= 1"]),
    "uncatchable_stop_signal": (
        ["trainer.stop_signal=SIGKILL"],
        ["trainer.stop_signal=SIGKILL cannot be caught", "use SIGUSR1"]),
    "unknown_stop_signal": (
        ["trainer.stop_signal=SIGFOO"], ["trainer.stop_signal='SIGFOO' is not a signal name"]),
    "run_name_escapes_output_root": (
        ["run.name=../../x"], ["run.name='../../x' must name a directory inside run.output_root"]),
    "run_name_is_output_root": (
        ["run.name=."], ["run.name='.' must name a directory inside run.output_root"]),
    "unknown_nan_policy": (
        ["trainer.nan_policy=ignore"], ["trainer.nan_policy='ignore' is not one of abort, skip"]),
}

MLA = ["model.kv_lora_rank=64", "model.qk_rope_head_dim=16", "model.num_query_groups=0"]
MOE = ["model.num_experts=8", "model.moe_router_topk=2"]
BUILT_WITHOUT = "multi-latent attention (model.kv_lora_rank=64) is not built here with "
CASES.update({
    "mla_on_gpt2": (
        ["model=gpt2_124m", "model.kv_lora_rank=64", "model.qk_rope_head_dim=16"],
        [BUILT_WITHOUT + "model.arch=gpt2", "set model.arch=llama, or model.kv_lora_rank=0"]),
    "mla_without_rotated_part": (
        ["model.kv_lora_rank=64", "model.num_query_groups=0"],
        ["model.qk_rope_head_dim=0 with multi-latent attention (model.kv_lora_rank=64) must be "
         "a positive even number", "e.g. model.qk_rope_head_dim=64"]),
    "mla_odd_rotated_part": (
        MLA + ["model.qk_rope_head_dim=15"],
        ["model.qk_rope_head_dim=15 with multi-latent attention", "positive even number",
         "e.g. model.qk_rope_head_dim=64"]),
    "mla_with_qk_layernorm": (
        MLA + ["model.qk_layernorm=true"],
        [BUILT_WITHOUT + "model.qk_layernorm=true (its latent norms are always on",
         "set model.qk_layernorm=false"]),
    "mla_with_query_groups": (
        ["model.kv_lora_rank=64", "model.qk_rope_head_dim=16", "model.num_query_groups=4"],
        ["model.num_query_groups=4 with multi-latent attention (model.kv_lora_rank=64)",
         "num_attention_heads=8 of them", "set model.num_query_groups=0"]),
    "mla_with_window": (
        MLA + ["model.window_size=16"],
        [BUILT_WITHOUT + "model.window_size=16", "set model.window_size=0"]),
    "mla_with_post_norms": (
        MLA + ["model.norm_placement=post"],
        [BUILT_WITHOUT + "model.norm_placement=post", "set model.norm_placement=pre"]),
    "mla_with_zero_centered_norms": (
        MLA + ["model.norm_zero_centered=true"],
        [BUILT_WITHOUT + "model.norm_zero_centered=true", "set model.norm_zero_centered=false"]),
    "mla_with_linear_biases": (
        MLA + ["model.add_bias_linear=true"],
        [BUILT_WITHOUT + "model.add_bias_linear=true", "set model.add_bias_linear=false"]),
    "mla_with_qkv_bias": (
        MLA + ["model.add_qkv_bias=true"],
        [BUILT_WITHOUT + "model.add_qkv_bias=true", "set model.add_qkv_bias=false"]),
    "mla_with_softmax_scale_dim": (
        MLA + ["model.softmax_scale_dim=48"],
        [BUILT_WITHOUT + "model.softmax_scale_dim=48", "set model.softmax_scale_dim=0"]),
    "mla_with_local_rotary_base": (
        MLA + ["model.rotary_base_local=10000"],
        [BUILT_WITHOUT + "model.rotary_base_local=10000", "set model.rotary_base_local=0"]),
    "mla_with_rope_scaling": (
        MLA + ["model.rope_scaling=llama3"],
        [BUILT_WITHOUT + "model.rope_scaling=llama3", "set model.rope_scaling=none or yarn"]),
    "yarn_without_mla": (
        ["model.rope_scaling=yarn", "model.rope_original_max_positions=4096"],
        ["model.rope_scaling=yarn is built here with multi-latent attention only",
         "set model.rope_scaling=none, llama3 or linear"]),
    "yarn_without_original_context": (
        MLA + ["model.rope_scaling=yarn"],
        ["model.rope_scaling=yarn needs model.rope_original_max_positions > 0 (got 0)",
         "DeepSeek-V3: 4096"]),
    "yarn_factor_below_one": (
        MLA + ["model.rope_scaling=yarn", "model.rope_original_max_positions=64",
               "model.rope_scaling_factor=0.5"],
        ["model.rope_scaling_factor=0.5 with rope_scaling=yarn must be >= 1"]),
    "yarn_betas_reversed": (
        MLA + ["model.rope_scaling=yarn", "model.rope_original_max_positions=64",
               "model.yarn_beta_fast=1", "model.yarn_beta_slow=32"],
        ["model.yarn_beta_fast=1.0 must exceed model.yarn_beta_slow=32.0 > 0"]),
    "mla_negative_latent": (
        ["model.kv_lora_rank=-1"], ["model.kv_lora_rank=-1 must be >= 0"]),
    **{f"{key}_without_kv_lora_rank": (
        [f"model.{key}=32"],
        [f"model.{key}=32 is a width of multi-latent attention, which model.kv_lora_rank=0 "
         f"leaves off", f"set model.kv_lora_rank > 0 (DeepSeek-V3: 512) or model.{key}=0"])
       for key in ("q_lora_rank", "qk_rope_head_dim", "v_head_dim")},
    "expert_bias_with_softmax_scores": (
        MOE + ["model.moe_router_expert_bias=true"],
        ["model.moe_router_expert_bias=true needs model.moe_router_score=sigmoid (got softmax)",
         "set model.moe_router_score=sigmoid or model.moe_router_expert_bias=false"]),
    "sigmoid_scores_with_pre_softmax": (
        MOE + ["model.moe_router_score=sigmoid", "model.moe_router_pre_softmax=true"],
        ["model.moe_router_pre_softmax=true weighs the chosen experts by a softmax",
         "set model.moe_router_pre_softmax=false or model.moe_router_score=softmax"]),
    "router_groups_not_dividing_experts": (
        MOE + ["model.moe_router_groups=3", "model.moe_router_group_topk=1"],
        ["model.moe_router_groups=3 does not divide model.num_experts=8",
         "use moe_router_groups from 1, 2, 4, 8"]),
    "router_group_topk_out_of_range": (
        MOE + ["model.moe_router_groups=4", "model.moe_router_group_topk=5"],
        ["model.moe_router_group_topk=5 must be in 1..4", "e.g. 2"]),
    "router_group_topk_without_groups": (
        MOE + ["model.moe_router_group_topk=2"],
        ["model.moe_router_group_topk=2 picks among expert groups, but "
         "model.moe_router_groups=0 makes none", "set model.moe_router_groups"]),
    "router_group_pick_not_two": (
        MOE + ["model.moe_router_groups=4", "model.moe_router_group_topk=2"],
        ["model.moe_router_topk // model.moe_router_group_topk = 2 // 2 = 1 must be 2",
         "Megatron-Core ranks the groups by the sum of each group's best",
         "DeepSeek-V3 (and Hugging Face) by its best 2",
         "set model.moe_router_group_topk=1 (or moe_router_topk=4)"]),
    "router_groups_too_small_for_topk": (
        ["model.num_experts=8", "model.moe_router_topk=5", "model.moe_router_groups=4",
         "model.moe_router_group_topk=2"],
        ["model.moe_router_topk=5 experts cannot be found in moe_router_group_topk=2 groups of "
         "num_experts / moe_router_groups = 8 / 4 = 2 experts"]),
    "router_scaling_not_positive": (
        MOE + ["model.moe_router_scaling=0"],
        ["model.moe_router_scaling=0.0 must be a finite number > 0"]),
    "every_layer_dense": (
        MOE + ["model.moe_dense_layers=4"],
        ["model.moe_dense_layers=4 leaves none of model.num_layers=4 with experts",
         "use moe_dense_layers from 0 to 3"]),
    "shared_expert_not_divisible_by_tp": (
        MOE + ["model.moe_shared_expert_ffn_hidden_size=101", "cluster.gpus_per_node=2",
               "parallelism.tensor_parallel_size=2"],
        ["model.moe_shared_expert_ffn_hidden_size=101 is not divisible by "
         "parallelism.tensor_parallel_size=2", "use parallelism.tensor_parallel_size from 1, 101"]),
    **{f"{key}_on_a_dense_model": (
        [f"model.{key}={value}"],
        [f"model.{key}={value} sets a mixture-of-experts layer apart, but model.num_experts=0 "
         f"makes a dense model", f"set model.num_experts or model.{key}={default}"])
       for key, value, default in (
           ("moe_router_score", "sigmoid", "softmax"), ("moe_router_expert_bias", "true", "false"),
           ("moe_router_groups", "2", "0"), ("moe_router_group_topk", "1", "0"),
           ("moe_router_scaling", "2.5", "1.0"), ("moe_shared_expert_ffn_hidden_size", "64", "0"),
           ("moe_dense_layers", "1", "0"))},
})


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_reports_keys_values_fix_and_exit_2(name, capsys):
    overrides, fragments = CASES[name]
    assert main(overrides) == CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_all_problems_reported_at_once(capsys):
    assert main(["parallelism.tensor_parallel_size=3", "parallelism.pipeline_parallel_size=3",
                 "parallelism.sequence_parallel=false", "model.num_layers=5"]) == 2
    err = capsys.readouterr().err
    assert "6 problem(s)" in err
    for fragment in ("world size 2", "num_attention_heads=8", "num_query_groups=4",
                     "ffn_hidden_size=704", "num_layers=5",
                     "pipeline_parallel_size=3 is not supported by engine=deepspeed"):
        assert fragment in err


@pytest.mark.parametrize("argv,fragment", [
    (["model.hidden_sizee=3"], "hidden_sizee"),
    (["trainer.precision=fp4"], "precision"),
    (["experiment=nope"], "nope"),
])
def test_compose_errors_exit_2_from_the_real_cli(argv, fragment):
    proc = subprocess.run([sys.executable, "-m", "launcher.plan", *argv], capture_output=True,
                          text=True)
    assert proc.returncode == CONFIG_ERROR_EXIT
    assert fragment in proc.stderr and "Traceback" not in proc.stderr


def test_valid_config_exits_0():
    proc = subprocess.run([sys.executable, "-m", "launcher.plan"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_typo_in_key_suggests_the_field(capsys):
    with pytest.raises(SystemExit) as info:
        main(["parallelism.tensor_paralel_size=2"])
    assert info.value.code == CONFIG_ERROR_EXIT
    assert "did you mean parallelism.tensor_parallel_size" in capsys.readouterr().err


def test_bad_enum_value_lists_choices(capsys):
    with pytest.raises(SystemExit):
        main(["trainer.activation_recompute=partial"])
    assert "expected one of [none, selective, full]" in capsys.readouterr().err


def test_independent_problems_are_reported_together(capsys):
    """A model-shape problem does not hide a batch problem: the data-parallel size is known."""
    assert main(["experiment=llama3_70b_16k_h100", "model.num_attention_heads=60",
                 "trainer.global_batch_size=1000", "optimizer.lr=-1"]) == CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    for fragment in ("model.num_attention_heads=60 is not divisible by "
                     "parallelism.tensor_parallel_size=8",
                     "trainer.global_batch_size=1000 is not divisible by micro_batch_size x "
                     "data-parallel size = 4 x 512 = 2048", "optimizer.lr=-1.0"):
        assert fragment in err, (fragment, err)


def test_warmup_not_below_steps_is_a_warning_not_a_refusal(capsys):
    assert main(["trainer.train_steps=20", "trainer.train_tokens=0"]) == 0
    err = capsys.readouterr().err
    assert "plan: warning: optimizer.warmup_steps=100 is not below the 20 optimizer steps" in err
    assert "optimizer.warmup_steps=2 for a full schedule" in err


def test_gpu_names_are_case_insensitive(capsys):
    assert main(["cluster=slurm_h100", "cluster.gpu=h200", "plan.format=json"]) == 0
    assert '"gpu": "H200"' in capsys.readouterr().out


@pytest.mark.parametrize("layout, fragment", [
    (["parallelism.pipeline_parallel_size=2", "parallelism.virtual_pipeline_parallel_size=2",
      "model.num_layers=4"], "to be a multiple of pipeline_parallel_size=2"),
    (["parallelism.context_parallel_size=2"], "context_parallel_size=2 runs attention through "
                                              "Transformer Engine"),
])
def test_a_layout_no_step_survives_here_is_refused_before_any_rank_starts(layout, fragment,
                                                                          tmp_path):
    """Both used to start two ranks and fail in Megatron-Core (its interleaved schedule at the
    first step; its attention's assert for context parallelism without Transformer Engine)."""
    from tests.helpers.training import REPO, TINY

    proc = subprocess.run([sys.executable, "-m", "launcher.train", *TINY, "engine=megatron",
                           f"run.output_root={tmp_path}", "run.name=r", *layout],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert fragment in proc.stderr
    assert not (tmp_path / "r" / "logs").exists()  # no rank was started


def test_deepseek_v3_passes_its_checks():
    """The preset's MLA, router and layout settings raise none of the refusals above; a run of
    it on 1,024 H100s plans."""
    from launcher.compose import compose_config, to_object
    from launcher.plan.validate_layers import check_layer_features

    assert check_layer_features(to_object(compose_config(["model=deepseek_v3_671b"])).model,
                                8) == []
    assert main(["model=deepseek_v3_671b", "cluster=slurm_h100", "cluster.nodes=128",
                 "engine=megatron", "parallelism.pipeline_parallel_size=8",
                 "parallelism.layers_in_first_stage=5", "parallelism.layers_in_last_stage=8",
                 "parallelism.expert_parallel_size=64", "parallelism.tensor_parallel_size=2",
                 "parallelism.sequence_parallel=true", "trainer.micro_batch_size=1",
                 "trainer.activation_recompute=full", "trainer.global_batch_size=1024"]) == 0
