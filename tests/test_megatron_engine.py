"""engine=megatron: Megatron-Core DDP/optimizer under Megatron-Core's schedules, on 2 gloo ranks.

One launch trains every layout in turn (fp32, 4 layers, hidden 64, seq 32, vocab 512):
plain DDP vs the distributed optimizer at DP=2; PP=1 vs PP=2 1F1B with 4 micro-batches (same
weights, same data, embeddings tied across the first and last stage); interleaved PP=2 x VPP=2; a 4-expert top-2 MoE at EP=2.
"""

from __future__ import annotations

import math

import pytest

from tests.helpers.engines import MOE, build, global_params, train


def layouts_worker(args: dict) -> dict:
    """Every layout in one launch (see module docstring)."""
    out = {}
    for name, overrides in (("ddp", ["parallelism.zero_stage=0"]),
                            ("distopt", ["parallelism.zero_stage=1"])):
        cfg, _, eng = build(overrides + ["trainer.global_batch_size=8"])
        out[name] = train(eng, cfg, 3)
    tied = ["model.untie_embeddings_and_output_weights=false"]  # shared by first and last stage
    cfg, _, eng = build(tied + ["trainer.global_batch_size=16"])  # DP=2, 4 micro-batches each
    reference = {k: v.detach().clone() for k, v in global_params(eng).items()}
    out["pp1"] = train(eng, cfg, args["steps"])
    cfg, plan, eng = build(tied + ["parallelism=pp2", "trainer.global_batch_size=8"])
    out["pp2_micro_batches"] = plan.batch.grad_accum_steps
    out["pp2"] = train(eng, cfg, args["steps"], reference=reference)
    cfg, _, eng = build(tied + ["parallelism=pp2", "parallelism.virtual_pipeline_parallel_size=2",
                         "trainer.global_batch_size=8"])
    out["vpp"] = train(eng, cfg, args["steps"], reference=reference)
    cfg, _, eng = build(MOE + ["model.num_layers=2", "trainer.global_batch_size=8"])
    out["moe"] = train(eng, cfg, args["steps"])
    return out


@pytest.fixture(scope="module")
def layouts():
    from tests.helpers.dist import run_distributed

    return run_distributed("tests.test_megatron_engine:layouts_worker", 2, {"steps": 6})


@pytest.mark.xdist_group("engine_layouts")  # its module fixture, built once
@pytest.mark.slow
def test_distributed_optimizer_equals_plain_ddp_at_dp2(layouts):
    for rank in layouts:
        ddp, dist = rank["ddp"], rank["distopt"]
        for a, b in zip(ddp["loss"] + ddp["grad_norm"], dist["loss"] + dist["grad_norm"]):
            assert abs(a - b) < 1e-6, (ddp, dist)
        # torch's multi-tensor Adam on the CPU, not its per-tensor default there
        # (launcher.engines.common.multi_tensor_on_cpu)
        assert ddp["adam_paths"] == dist["adam_paths"] == ["_multi_tensor_adam"]
    assert layouts[0]["ddp"]["loss"] == layouts[1]["ddp"]["loss"]


@pytest.mark.xdist_group("engine_layouts")  # its module fixture, built once
@pytest.mark.slow
def test_pp2_1f1b_equals_pp1_and_loss_falls(layouts):
    r0, r1 = layouts
    assert r0["pp2_micro_batches"] == 4
    pp1, pp2 = r0["pp1"], r0["pp2"]
    assert abs(pp1["loss"][0] - pp2["loss"][0]) < 1e-6, (pp1["loss"], pp2["loss"])
    assert abs(pp1["grad_norm"][0] - pp2["grad_norm"][0]) < 1e-6
    assert r1["pp2"]["loss"] == pp2["loss"]  # both stages report the last stage's loss
    assert pp2["loss"][-1] < pp2["loss"][0] - 0.3, pp2["loss"]
    times = pp2["times"]
    assert times["forward"] > 0 and times["backward"] > 0 and times["optimizer"] > 0
    assert "backward+grad_sync" not in times and times["grad_sync"] > 0


@pytest.mark.xdist_group("engine_layouts")  # its module fixture, built once
@pytest.mark.slow
def test_interleaved_pipeline_runs_and_matches_pp1(layouts):
    vpp, pp1 = layouts[0]["vpp"], layouts[0]["pp1"]
    assert abs(vpp["loss"][0] - pp1["loss"][0]) < 1e-6, (vpp["loss"], pp1["loss"])
    assert vpp["loss"][-1] < vpp["loss"][0] - 0.3


@pytest.mark.xdist_group("engine_layouts")  # its module fixture, built once
@pytest.mark.slow
def test_moe_ep2_trains_and_reports_load_balancing_loss(layouts):
    moe = layouts[0]["moe"]
    assert moe["loss"][-1] < moe["loss"][0] - 0.3, moe["loss"]
    balance = [extra["moe/load_balancing_loss"] for extra in moe["extra"]]
    # Switch-style aux loss: 1.0 when routing is perfectly balanced, up to num_experts / top-k.
    assert all(math.isfinite(b) and 0.9 < b < 2.0 for b in balance), balance
    assert layouts[1]["moe"]["extra"] == moe["extra"]
