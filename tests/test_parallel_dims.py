"""ParallelDims: the layout built once from (parallelism, world), its problems, and the plan's
use of it; cluster.ranks_per_gpu: world size, shared-GPU memory refusal, Slurm refusal."""

import json

import pytest

from launcher.compose import compose_config, to_object
from launcher.config import ClusterConfig, ParallelismConfig
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.plan import PlanError, compute_plan
from launcher.plan.__main__ import main
from launcher.shape.dims import ParallelDims, cluster_world_size, describe_world

GIB = 2 ** 30
LLAMA3_1B_PARAMS = 1_235_814_400  # tied embeddings, vocabulary 128,256 needs no padding


def plan_of(*overrides, world_size=None):
    return compute_plan(to_object(compose_config(list(overrides))), world_size)


def par(tp=1, pp=1, vpp=1, cp=1, ep=1, sp=False) -> ParallelismConfig:
    return ParallelismConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                             virtual_pipeline_parallel_size=vpp, context_parallel_size=cp,
                             expert_parallel_size=ep, sequence_parallel=sp)


def cluster(nodes=1, gpus=1, ranks=1, launcher="local") -> ClusterConfig:
    return ClusterConfig(name="test", gpu="H100", nodes=nodes, gpus_per_node=gpus,
                         ranks_per_gpu=ranks, launcher=launcher)


@pytest.mark.parametrize("layout,world,expected", [
    # (tp, pp, cp, ep), world -> (dp, edp, model_parallel, expert_model_parallel, tp_groups,
    #                             dense_shards)
    ((1, 1, 1, 1), 1, (1, 1, 1, 1, 1, 1)),
    ((2, 2, 2, 1), 16, (2, 4, 8, 4, 8, 4)),
    ((8, 4, 1, 1), 16384, (512, 512, 32, 32, 2048, 512)),  # llama3_70b_16k_h100
    ((2, 2, 1, 8), 64, (16, 2, 4, 32, 32, 16)),  # MoE: experts over EP=8, 2 expert replicas
    ((1, 1, 2, 4), 8, (4, 2, 2, 4, 8, 8)),  # CP splits the dense replicas, not the experts'
])
def test_dims_of_layouts(layout, world, expected):
    tp, pp, cp, ep = layout
    d = ParallelDims.build(par(tp=tp, pp=pp, cp=cp, ep=ep), world)
    assert (d.tp, d.pp, d.cp, d.ep, d.world) == (tp, pp, cp, ep, world)
    assert (d.dp, d.edp, d.model_parallel, d.expert_model_parallel, d.tp_groups,
            d.dense_shards) == expected
    assert d.dp * d.model_parallel == world and d.edp * d.expert_model_parallel == world
    assert d.problems(cluster(gpus=world), moe=ep > 1) == []


def test_dims_derived_numbers():
    d = ParallelDims.build(par(tp=8, pp=4, vpp=2, sp=True), 16384)
    assert d.vpp == 2 and d.sequence_parallel and d.sequence_shards == 8
    assert d.layers_per_stage(80) == 20
    assert d.bubble_fraction(4) == pytest.approx(3 / (2 * 4))
    assert ParallelDims.build(par(), 4).bubble_fraction(4) == 0.0
    assert ParallelDims.build(par(tp=2), 4).sequence_shards == 1


def test_dims_are_frozen_and_json_plain():
    d = ParallelDims.build(par(tp=2, pp=2, cp=2), 16)
    with pytest.raises(AttributeError):
        d.tp = 4
    from dataclasses import asdict
    assert json.loads(json.dumps(asdict(d))) == {
        "tp": 2, "pp": 2, "vpp": 1, "cp": 2, "ep": 1, "dp": 2, "edp": 4, "world": 16,
        "sequence_parallel": False,
        # the stage split (issue 13: uneven first/last pipeline stages); even here
        "split": {"first": 0, "last": 0, "embedding": False, "loss": False}}


def test_build_refuses_non_positive_sizes():
    with pytest.raises(ValueError, match="tp=0"):
        ParallelDims.build(par(tp=0), 8)


def test_every_layout_problem_is_reported_together():
    """World 6 = 1 node x 3 GPUs x 2 ranks: CP=4 does not divide it, nor TP x EP x PP = 4;
    sequence parallel without TP; virtual stages without pipeline stages."""
    d = ParallelDims.build(par(cp=4, ep=4, vpp=2, sp=True), 6)
    problems = d.problems(cluster(gpus=3, ranks=2), moe=True)
    world = ("world size 6 (cluster.nodes=1 x cluster.gpus_per_node=3 x "
             "cluster.ranks_per_gpu=2)")
    assert [str(p) for p in problems] == [
        f"{world} is not a multiple of TP x PP x CP = 4 (tensor_parallel_size=1, "
        "pipeline_parallel_size=1, context_parallel_size=4); use a world size that is a multiple "
        "of 4, or TP x PP x CP from 1, 2, 3, 6",
        f"{world} is not a multiple of TP x EP x PP = 4 (tensor_parallel_size=1, "
        "expert_parallel_size=4, pipeline_parallel_size=1); choose EP so that TP x EP x PP "
        "divides 6",
        "parallelism.sequence_parallel=true needs tensor_parallel_size > 1 (it shards along the "
        "TP group); set parallelism.sequence_parallel=false or raise tensor_parallel_size",
        "parallelism.virtual_pipeline_parallel_size=2 needs pipeline_parallel_size > 1; set "
        "virtual_pipeline_parallel_size=1"]
    assert problems[0].keys[:3] == ("cluster.nodes", "cluster.gpus_per_node",
                                    "cluster.ranks_per_gpu")
    # a dense model only needs TP x PP x CP to divide the world
    assert len(d.problems(cluster(gpus=3, ranks=2), moe=False)) == 3


def test_world_is_nodes_x_gpus_x_ranks_per_gpu():
    assert cluster_world_size(cluster(nodes=2, gpus=4, ranks=2)) == 16
    assert describe_world(cluster(nodes=2, gpus=4), 8) == \
        "world size 8 (cluster.nodes=2 x cluster.gpus_per_node=4)"
    p = plan_of("cluster=local_gpu", "cluster.ranks_per_gpu=2")
    assert (p.dims.world, p.machines.ranks_per_gpu, p.dims.dp, p.machines.gpus_per_node) == (2, 2, 2, 1)
    assert p.dims == ParallelDims.build(par(), 2)
    p = plan_of("cluster=local_gpu", "cluster.nodes=2", "cluster.gpus_per_node=4",
                "cluster.ranks_per_gpu=2", "parallelism.tensor_parallel_size=2")
    assert (p.dims.world, p.dims.dp, p.dims.tp_groups) == (16, 8, 8)


def test_world_message_names_ranks_per_gpu(capsys):
    assert main(["cluster.gpus_per_node=3", "cluster.ranks_per_gpu=2",
                 "parallelism.tensor_parallel_size=4"]) == CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    assert ("world size 6 (cluster.nodes=1 x cluster.gpus_per_node=3 x cluster.ranks_per_gpu=2)"
            " is not a multiple of TP x PP x CP = 4") in err
    assert "TP x PP x CP from 1, 2, 3, 6" in err


def test_plan_json_layout_keys_come_from_dims():
    p = plan_of("experiment=llama3_70b_16k_h100")
    d = p.dims
    assert d == ParallelDims.build(par(tp=8, pp=4, sp=True), 16384)
    j = p.to_dict()
    assert (j["world_size"], j["tensor_parallel_size"], j["pipeline_parallel_size"],
            j["virtual_pipeline_parallel_size"], j["context_parallel_size"],
            j["expert_parallel_size"], j["sequence_parallel"]) == \
        (d.world, d.tp, d.pp, d.vpp, d.cp, d.ep, d.sequence_parallel)
    assert (j["data_parallel_size"], j["expert_data_parallel_size"], j["model_parallel_size"],
            j["tensor_parallel_groups"], j["layers_per_stage"]) == (512, 512, 32, 2048, 20)
    assert j["pipeline_bubble_fraction"] == d.bubble_fraction(p.batch.grad_accum_steps) == 0.75
    assert "pipeline_stages" not in j and "effective_mfu" not in j  # copies of other keys


def test_plan_json_carries_dims_and_ranks_per_gpu(capsys):
    assert main(["cluster=local_gpu", "cluster.ranks_per_gpu=2", "model.num_experts=4",
                 "parallelism.expert_parallel_size=2", "engine=megatron",
                 "plan.format=json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranks_per_gpu"] == 2 and data["world_size"] == 2
    assert data["dims"] == {"tp": 1, "pp": 1, "vpp": 1, "cp": 1, "ep": 2, "dp": 2, "edp": 1,
                            "world": 2, "sequence_parallel": False,
                            "split": {"first": 0, "last": 0, "embedding": False, "loss": False}}
    assert main(["plan.format=json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks_per_gpu"] == 1


def test_two_ranks_share_the_gpu_memory():
    """Llama 3.2 1B on one H100 (79.6 GiB), micro-batch 2, ZeRO-1: one rank needs 51.2 GiB and
    fits; two ranks on the GPU each hold 2 + 4 bytes per parameter of weights and fp32 grads and
    half of the 12-byte optimizer state (DP=2) plus the same activations: 44.3 GiB, 88.5 GiB on
    the GPU, which does not fit (with the unfused loss's fp32 logits)."""
    common = ["model=llama3_1b", "cluster=local_gpu", "trainer.micro_batch_size=2",
              "trainer.cross_entropy_fusion=off"]
    one = plan_of(*common).memory.per_gpu
    with pytest.raises(PlanError) as info:
        plan_of(*common, "cluster.ranks_per_gpu=2")
    refused = info.value.plan
    two, cap = refused.memory.per_gpu, refused.machines.gpu_memory_bytes
    assert (one.weights, one.grads, one.optimizer) == \
        (2 * LLAMA3_1B_PARAMS, 4 * LLAMA3_1B_PARAMS, 12 * LLAMA3_1B_PARAMS)
    assert (two.weights, two.grads, two.optimizer) == \
        (2 * LLAMA3_1B_PARAMS, 4 * LLAMA3_1B_PARAMS, 6 * LLAMA3_1B_PARAMS)
    assert two.activations == one.activations
    assert one.total - two.total == 6 * LLAMA3_1B_PARAMS
    assert one.total < cap < 2 * two.total and two.total < cap  # each rank alone would fit
    assert round(one.total / GIB, 1) == 51.2 and round(two.total / GIB, 1) == 44.3
    [problem] = info.value.problems
    assert problem.keys[0] == "cluster.ranks_per_gpu"
    message = str(problem)
    for fragment in ("cluster.ranks_per_gpu=2 ranks share each H100",
                     "2 x 44.3 GiB per rank (weights 2.3, grads 4.6, optimizer 6.9, activations "
                     "30.5) = 88.5 GiB exceeds its 79.6 GiB",
                     "fewer cluster.ranks_per_gpu (now 2)", "trainer.activation_recompute=full",
                     "a smaller trainer.micro_batch_size (now 2)", "a smaller model"):
        assert fragment in message, (fragment, message)


def test_shared_gpu_refusal_exits_2_and_table_shows_ranks(capsys):
    argv = ["model=llama3_1b", "cluster=local_gpu", "trainer.micro_batch_size=2",
            "cluster.ranks_per_gpu=2", "trainer.cross_entropy_fusion=off"]
    assert main(argv) == CONFIG_ERROR_EXIT
    captured = capsys.readouterr()
    assert "cluster.ranks_per_gpu=2 ranks share each H100" in captured.err
    for text in ("ranks per GPU", "total per rank", "total per GPU (2 ranks)", "88.54 GiB",
                 "DOES NOT"):  # the table may wrap before FIT
        assert text in captured.out, text
    assert main(["model=llama3_1b", "cluster=local_gpu", "trainer.micro_batch_size=1",
                 "cluster.ranks_per_gpu=2"]) == 0
    out = capsys.readouterr().out
    assert "ranks per GPU" in out and "fits" in out
    assert main(["cluster=local_gpu"]) == 0
    out = capsys.readouterr().out
    assert "ranks per GPU" not in out and "total per GPU" in out


def test_ranks_sharing_a_gpu_share_its_flops():
    """The same global batch on one GPU takes as long with one rank as with two sharing it."""
    common = ["cluster=local_gpu", "trainer.global_batch_size=8", "trainer.micro_batch_size=1"]
    one, two = plan_of(*common), plan_of(*common, "cluster.ranks_per_gpu=2")
    assert (one.batch.grad_accum_steps, two.batch.grad_accum_steps) == (8, 4)
    assert two.compute.step_time_s == pytest.approx(one.compute.step_time_s)
    assert two.compute.tokens_per_s == pytest.approx(one.compute.tokens_per_s)


def test_ranks_per_gpu_is_refused_on_slurm_and_must_be_positive(capsys):
    assert main(["cluster=slurm_h100", "cluster.ranks_per_gpu=2"]) == CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    assert ("cluster.ranks_per_gpu=2 with cluster.launcher=slurm: several training processes "
            "per GPU is a development feature of the local launcher") in err
    assert "set cluster.ranks_per_gpu=1 for a Slurm job" in err
    assert main(["cluster=local_gpu", "cluster.ranks_per_gpu=0"]) == CONFIG_ERROR_EXIT
    assert "cluster.ranks_per_gpu=0 must be a positive integer" in capsys.readouterr().err
