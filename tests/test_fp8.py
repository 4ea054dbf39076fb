"""trainer.precision=fp8: the TransformerConfig fields per recipe, every refusal before launch,
and the plan's FP8 step time and memory (GPU runs: bench/gpu_train.py, docs/gpu.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.compose import compose_config, to_object
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.plan import PlanError, compute_plan
from launcher.plan.fp8 import stage_fp8_layers

H100 = ["cluster=local_gpu", "engine=megatron", "parallelism.zero_stage=1"]
ONE_B = H100 + ["model=llama3_1b", "model.seq_length=4096", "trainer.micro_batch_size=2",
                "trainer.global_batch_size=8", "trainer.cross_entropy_fusion=off"]
EIGHT_B_WIDTH = H100 + ["model=llama3_8b", "model.num_layers=8", "model.seq_length=4096",
                        "trainer.micro_batch_size=1", "trainer.global_batch_size=8",
                        "trainer.cross_entropy_fusion=off"]
MEASURED_FP8_OVER_BF16 = {"1b": 771 / 728, "8b_width": 902 / 1026}
"""Megatron-LM on one H100 (issue 15): FP8 (hybrid, delayed) over bf16 step time."""


def cfg_of(*overrides):
    return to_object(compose_config(list(overrides)))


def plan_of(*overrides):
    return compute_plan(cfg_of(*overrides))


def problems_of(*overrides) -> str:
    with pytest.raises(PlanError) as info:
        plan_of(*overrides)
    return "\n".join(str(p) for p in info.value.problems)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_transformer_config_fields_per_recipe(recipe):
    from launcher.engines.model import transformer_config

    ends = [] if recipe == "delayed" else ["trainer.fp8.bf16_first_layers=1",
                                           "trainer.fp8.bf16_last_layers=2"]
    cfg = cfg_of("model=tiny", "trainer.precision=fp8", f"trainer.fp8.recipe={recipe}",
                 "trainer.fp8.format=e4m3", "trainer.fp8.amax_history_len=16",
                 "trainer.fp8.amax_compute_algo=most_recent", *ends)
    tc = transformer_config(cfg.model, cfg.parallelism, cfg.trainer)
    assert (tc.fp8, tc.fp8_recipe) == ("e4m3", recipe)
    assert (tc.fp8_amax_history_len, tc.fp8_amax_compute_algo) == (16, "most_recent")
    assert tc.first_last_layers_bf16 is (recipe != "delayed")
    if ends:
        assert (tc.num_layers_at_start_in_bf16, tc.num_layers_at_end_in_bf16) == (1, 2)
    assert tc.fp8_param is False
    import torch
    assert tc.bf16 and not tc.fp16 and tc.params_dtype == torch.bfloat16  # bf16 outside FP8


def test_bf16_run_sets_no_fp8_field_and_moe_pads_expert_tokens():
    from launcher.engines.model import fp8_fields, transformer_config

    cfg = cfg_of("model=tiny", "trainer.precision=bf16")
    assert transformer_config(cfg.model, cfg.parallelism, cfg.trainer).fp8 is None
    assert fp8_fields(cfg.trainer, cfg.model) == {}
    moe = cfg_of("model=tiny", "model.num_experts=4", "trainer.precision=fp8",
                 "trainer.fp8.param_gather=true")
    fields = fp8_fields(moe.trainer, moe.model)
    assert fields["moe_router_padding_for_quantization"] is True
    assert fields["fp8_param"] is True and fields["fp8"] == "hybrid"


def test_plan_fp8_slower_at_1b_width_faster_at_8b_width_as_measured():
    ratios = {}
    for name, shape in (("1b", ONE_B), ("8b_width", EIGHT_B_WIDTH)):
        bf16 = plan_of(*shape).compute.step_time_s
        ratios[name] = plan_of(*shape, "trainer.precision=fp8").compute.step_time_s / bf16
    assert ratios["1b"] > 1.0 > ratios["8b_width"]
    for name, measured in MEASURED_FP8_OVER_BF16.items():
        assert abs(ratios[name] / measured - 1) < 0.10, (name, ratios[name], measured)


def test_fp8_only_speeds_the_layer_gemms():
    bf16 = plan_of(*EIGHT_B_WIDTH)
    fp8 = plan_of(*EIGHT_B_WIDTH, "trainer.precision=fp8")
    assert fp8.compute.parts["optimizer"] == bf16.compute.parts["optimizer"]
    assert fp8.compute.flops_per_step == bf16.compute.flops_per_step and fp8.compute.mfu > bf16.compute.mfu
    ends = plan_of(*EIGHT_B_WIDTH, "trainer.precision=fp8", "trainer.fp8.recipe=tensorwise",
                   "trainer.fp8.bf16_first_layers=1", "trainer.fp8.bf16_last_layers=1")
    assert fp8.compute.step_time_s < ends.compute.step_time_s < bf16.compute.step_time_s
    assert "layers 2-7 of 8" in ends.compute.fp8_layers and bf16.compute.fp8_layers == ""


def test_fp8_memory_counts_te_weight_copies_unless_weights_are_fp8():
    from launcher.plan.params import layer_params
    from launcher.shape.model import ResolvedModel

    base = EIGHT_B_WIDTH + ["trainer.fp8.recipe=tensorwise"]
    bf16 = plan_of(*base).memory.per_gpu
    fp8 = plan_of(*base, "trainer.precision=fp8").memory.per_gpu
    layer = layer_params(ResolvedModel.of(cfg_of(*base).model))
    copies = 8 * 2 * (layer.attention + layer.mlp)
    scaling = 8 * 4 * 5 * 1 * 4  # layers x GEMMs x scaling values x history x fp32
    assert fp8.weights - bf16.weights == copies + scaling
    assert (fp8.grads, fp8.optimizer, fp8.activations) == (bf16.grads, bf16.optimizer,
                                                           bf16.activations)
    gathered = plan_of(*base, "trainer.precision=fp8", "trainer.fp8.param_gather=true",
                       "trainer.layout_invariant_init=false").memory.per_gpu
    assert gathered.weights - bf16.weights == scaling


def test_fp8_keeps_the_fused_loss_of_bf16():
    bf16 = plan_of(*H100, "model=llama3_1b", "model.seq_length=8192")
    fp8 = plan_of(*H100, "model=llama3_1b", "model.seq_length=8192", "trainer.precision=fp8")
    assert fp8.memory.per_gpu.activations == bf16.memory.per_gpu.activations


def test_every_refusal_is_reported_together():
    text = problems_of("model=tiny", "cluster=local_gpu", "cluster.gpu=A100", "engine=deepspeed",
                       "trainer.precision=fp8", "model.ffn_hidden_size=700",
                       "trainer.fp8.bf16_first_layers=1", "trainer.fp8.amax_history_len=0",
                       "trainer.fp8.param_gather=true")
    for fragment in ("needs engine=megatron", "cluster.gpu=A100 has none",
                     "(H100, H200, B200)", "ffn_hidden_size / TP = 700 / 1 = 700 is not",
                     "nearest multiples: 688, 704", "do not work with trainer.fp8.recipe=delayed",
                     "amax_history_len=0 must be >= 1", "layout_invariant_init=false"):
        assert fragment in text, (fragment, text)


def test_mxfp8_needs_blackwell_and_32_alignment():
    assert "needs Blackwell tensor cores (B200)" in problems_of(
        *H100, "model=tiny", "trainer.precision=fp8", "trainer.fp8.recipe=mxfp8")
    b200 = H100 + ["cluster.gpu=B200", "model=tiny", "trainer.precision=fp8",
                   "trainer.fp8.recipe=mxfp8"]
    assert plan_of(*b200).compute.fp8_layers.startswith("layers 1-4 of 4 (mxfp8")
    short = ["model.seq_length=272", "trainer.micro_batch_size=1"]  # 272 = 17 x 16
    text = problems_of(*b200, *short)
    assert "micro_batch_size x seq_length / context_parallel_size" in text and "by 32" in text
    plan_of(*H100, "model=tiny", "trainer.precision=fp8", *short)  # 16 is enough on Hopper


def test_tensor_parallel_shards_are_checked():
    tp8 = [*H100, "model=tiny", "trainer.precision=fp8", "cluster.ranks_per_gpu=8",
           "parallelism.tensor_parallel_size=8", "model.num_attention_heads=8",
           "model.num_query_groups=8"]
    plan_of(*tp8, "model.ffn_hidden_size=768")  # 768 / 8 = 96 = 6 x 16; query 256 / 8 = 32
    text = problems_of(*tp8, "model.ffn_hidden_size=704")
    assert "ffn_hidden_size / TP = 704 / 8 = 88 is not" in text and "query" not in text


def test_bf16_end_layers_bounds_and_stage_counts():
    base = [*H100, "model=tiny", "trainer.precision=fp8", "trainer.fp8.recipe=tensorwise"]
    assert "must each be in 0..2" in problems_of(
        *base, "cluster.ranks_per_gpu=2", "parallelism.pipeline_parallel_size=2",
        "trainer.fp8.bf16_first_layers=3")
    assert "leaves none of the 4 layers in FP8" in problems_of(
        *base, "trainer.fp8.bf16_first_layers=2", "trainer.fp8.bf16_last_layers=2")
    cfg = cfg_of(*base, "trainer.fp8.bf16_first_layers=1", "trainer.fp8.bf16_last_layers=2")
    assert stage_fp8_layers(cfg, (2, 2)) == [1, 0] and stage_fp8_layers(cfg, (4,)) == [1]


def test_megatron_fp8_plan_says_deepspeed_would_not_run_it():
    notes = plan_of(*EIGHT_B_WIDTH, "trainer.precision=fp8").engine_notes
    assert "engine=deepspeed would not work: trainer.precision=fp8" in " ".join(notes)


def test_param_gather_needs_the_distributed_optimizer():
    text = problems_of("model=tiny", "cluster=local_gpu", "engine=megatron",
                       "parallelism.zero_stage=0", "trainer.precision=fp8",
                       "trainer.fp8.param_gather=true", "trainer.layout_invariant_init=false")
    assert "needs parallelism.zero_stage=1 (got 0)" in text


def test_machine_without_te_or_fp8_gpu_is_refused():
    from launcher.engines.model import KernelUnavailable, fp8_unavailable, runnable_attention

    trainer = cfg_of("trainer.precision=fp8", "trainer.fp8.recipe=mxfp8").trainer
    problems = fp8_unavailable(trainer, gpu=True, te=False, capability=(9, 0))
    assert len(problems) == 2
    assert "Transformer Engine" in problems[0] and "capability 10.0+" in problems[1]
    hopper = cfg_of("trainer.precision=fp8").trainer
    assert fp8_unavailable(hopper, gpu=True, te=True, capability=(9, 0)) == []
    assert "has 8.0" in fp8_unavailable(hopper, gpu=True, te=True, capability=(8, 0))[0]
    assert fp8_unavailable(cfg_of().trainer, gpu=False, te=False) == []
    with pytest.raises(KernelUnavailable, match="no.*visible|none is visible"):
        runnable_attention(hopper, planned_flash=True, gpu=False, te=False)


def test_train_refuses_fp8_on_cpu_before_spawning():
    proc = subprocess.run([sys.executable, "-m", "launcher.train", "model=tiny",
                           "trainer.precision=fp8", "trainer.train_steps=1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == CONFIG_ERROR_EXIT, proc.stderr[-2000:]
    assert "cluster.gpu=cpu has none" in proc.stderr and "Traceback" not in proc.stderr


def test_plan_report_names_the_fp8_layers():
    proc = subprocess.run([sys.executable, "-m", "launcher.plan", *EIGHT_B_WIDTH,
                           "trainer.precision=fp8"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "FP8" in out and "layers 1-8 of 8 (delayed, hybrid)" in out


def test_fp8_weights_are_gathered_in_fp8_by_the_distributed_optimizer_only():
    from launcher.engines.megatron.engine import ddp_config, optimizer_config

    cfg = cfg_of("engine=megatron", "parallelism.zero_stage=1", "trainer.precision=fp8",
                 "trainer.fp8.param_gather=true")
    assert ddp_config(cfg.parallelism, cfg.engine, fp8_param_gather=True).fp8_param_gather
    plain = cfg_of("engine=megatron", "parallelism.zero_stage=0").parallelism
    assert not ddp_config(plain, cfg.engine, fp8_param_gather=True).fp8_param_gather
    opt = optimizer_config(cfg.optimizer, cfg.trainer, distributed=True)
    assert opt.bf16 and not opt.fp16  # fp8 keeps bf16 weights and fp32 masters
