"""The step-time model of the plan (issue 13, part 1): calibrated on the H100 measurement of
docs/gpu.md, its breakdown adds up, and it tells layouts apart the way a flat MFU cannot: TP
across nodes, a deep pipeline with little accumulation, no gradient-reduce overlap."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.compose import compose_config, to_object
from launcher.plan import PlanError, compute_plan
from launcher.plan.hardware import DEVICES
from launcher.plan.step_time import PARTS

ONE_B = ["model=llama3_1b", "cluster=local_gpu", "engine=megatron", "model.seq_length=4096",
         "trainer.micro_batch_size=2", "trainer.global_batch_size=8", "parallelism.zero_stage=1"]


def plan_of(*overrides):
    try:
        return compute_plan(to_object(compose_config(list(overrides))))
    except PlanError as exc:  # the time model does not depend on the memory check
        assert exc.plan is not None, exc
        return exc.plan


def test_llama_1b_h100_matches_the_measurement():
    """docs/gpu.md: Llama 3.2 1B, bf16, one H100, engine=megatron, TE with fused SwiGLU,
    8 x 4096 tokens per step: 0.659 s, 45.3% MFU (the issue quotes ~0.651 s, 45.9%). The model
    predicts within 5% of the step time and 2.5 MFU points."""
    p = plan_of(*ONE_B)
    assert p.compute.step_time_s == pytest.approx(0.659, rel=0.05)
    assert p.compute.mfu == pytest.approx(0.453, abs=0.025)
    assert p.compute.dominant_cost == "compute"
    assert p.compute.parts["optimizer"] == pytest.approx(0.026, rel=0.1)  # measured 26 ms


def test_breakdown_adds_up_and_is_in_the_json():
    p = plan_of("experiment=llama3_70b_16k_h100")
    assert set(p.compute.parts) == set(PARTS)
    assert sum(p.compute.parts.values()) == pytest.approx(p.compute.step_time_s)
    assert p.compute.tokens_per_s == pytest.approx(p.batch.global_batch_tokens / p.compute.step_time_s)
    assert all(v >= 0 for v in p.compute.parts.values())
    assert p.to_dict()["dominant_cost"] == p.compute.dominant_cost


def test_tensor_parallel_across_nodes_is_slow():
    """TP=16 over two nodes of 8 puts every layer's all-gathers on InfiniBand (40 vs 360 GB/s)."""
    common = ["model=llama3_70b", "cluster=slurm_h100", "cluster.nodes=2", "engine=megatron",
              "parallelism.sequence_parallel=true", "trainer.micro_batch_size=1",
              "trainer.global_batch_size=32", "trainer.activation_recompute=full"]
    in_node = plan_of(*common, "parallelism.tensor_parallel_size=8",
                      "parallelism.pipeline_parallel_size=2")
    across = plan_of(*common, "model.num_query_groups=16", "model.num_attention_heads=64",
                     "parallelism.tensor_parallel_size=16")
    assert across.compute.parts["tensor_parallel"] > 5 * in_node.compute.parts[
        "tensor_parallel"]
    assert across.compute.dominant_cost == "tensor_parallel"
    assert across.compute.mfu < in_node.compute.mfu


def test_deep_pipeline_with_little_accumulation_is_bubble_bound():
    common = ["model=llama3_70b", "cluster=slurm_h100", "cluster.nodes=4", "engine=megatron",
              "parallelism.tensor_parallel_size=4", "parallelism.sequence_parallel=true",
              "trainer.micro_batch_size=1", "trainer.activation_recompute=full"]
    deep = plan_of(*common, "parallelism.pipeline_parallel_size=8", "trainer.global_batch_size=8")
    fed = plan_of(*common, "parallelism.pipeline_parallel_size=8", "trainer.global_batch_size=64")
    assert deep.compute.dominant_cost == "pipeline_bubble"
    assert deep.compute.parts["pipeline_bubble"] == pytest.approx(
        7 / 8 * deep.compute.step_time_s / (1 + 7 / 8) , rel=0.1)
    assert fed.compute.mfu > 1.5 * deep.compute.mfu


def test_gradient_reduce_overlap_hides_data_parallel_traffic():
    common = ["model=llama3_8b", "cluster=slurm_h100", "cluster.nodes=4", "engine=megatron",
              "trainer.micro_batch_size=1", "trainer.global_batch_size=64",
              "trainer.activation_recompute=full"]
    hidden = plan_of(*common)
    exposed = plan_of(*common, "engine.overlap_grad_reduce=false",
                      "engine.overlap_param_gather=false")
    assert exposed.compute.parts["data_parallel"] > 3 * hidden.compute.parts["data_parallel"]
    assert exposed.compute.step_time_s > hidden.compute.step_time_s


def test_flat_mfu_is_still_available():
    p = plan_of(*ONE_B, "plan.mfu=0.4")
    assert p.compute.step_time_s == pytest.approx(p.compute.flops_per_step / (989.4e12 * 0.4))


@pytest.mark.parametrize("name", ["H100", "H200", "A100", "B200"])
def test_every_gpu_has_links_and_rates(name):
    d = DEVICES[name]
    assert d.intra_node_bytes_per_s > d.inter_node_bytes_per_s > 0
    assert d.hbm_bytes_per_s > d.intra_node_bytes_per_s
    assert 0 < d.gemm_efficiency < 1 and 0 < d.attention_efficiency < 1


def test_plan_and_search_stay_torch_free():
    code = ("import sys, launcher.plan, launcher.search, launcher.search.__main__; "
            "from launcher.compose import compose_config, to_object; "
            "from launcher.plan import compute_plan; "
            "compute_plan(to_object(compose_config(['experiment=llama3_70b_16k_h100']))); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
