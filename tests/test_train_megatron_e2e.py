"""``python -m launcher.train engine=megatron`` end to end on 2 CPU processes (gloo), tiny model
and mock data: PP=2 (1F1B) trains, logs every phase (each the maximum over the stages, so
``time/loss`` is the last stage's), checkpoints and resumes with its step count unbroken; a
4-expert top-2 MoE at EP=2 logs ``moe/load_balancing_loss``. Both use the distributed optimizer
(``parallelism.zero_stage=1``, the layouts' default).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launcher.core.phases import PHASES
from tests.helpers.training import train

# its module-scoped runs are made once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("train_megatron_e2e")

MEGATRON = ["engine=megatron", "trainer.global_batch_size=8"]
PP2 = MEGATRON + ["parallelism=pp2", "trainer.save_interval=3", "trainer.eval_interval=3"]
MOE_EP2 = MEGATRON + ["model.num_experts=4", "model.moe_router_topk=2",
                      "parallelism.expert_parallel_size=2", "trainer.save_interval=0",
                      "trainer.eval_interval=0"]


def step_rows(run_dir: Path) -> list:
    """metrics.jsonl training lines in file order (a repeated step shows up twice)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


def checkpoints_of(run_dir: Path) -> dict:
    ckpts = run_dir / "checkpoints"
    return {"latest": (ckpts / "latest").read_text().strip(),
            "complete": sorted(p.parent.name for p in ckpts.glob("step_*/complete")),
            "megatron_files": sorted(p.name for p in ckpts.glob("step_000006/megatron/*")),
            "meta": json.loads((ckpts / "step_000006" / "trainwright.json").read_text())}


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    """6 steps at PP=2 (4 micro-batches per step, checkpoints at 3 and 6), then the same run
    resumed up to step 10. Returns (run dir, rows and checkpoints after the first run)."""
    tmp = tmp_path_factory.mktemp("megatron_pp2")
    train(tmp, "pp2", *PP2, "trainer.train_steps=6")
    run_dir = tmp / "pp2"
    first = {"rows": step_rows(run_dir), "ckpts": checkpoints_of(run_dir)}
    train(tmp, "pp2", *PP2, "trainer.train_steps=10")
    return run_dir, first


@pytest.mark.slow
def test_pp2_run_trains_logs_every_phase_and_checkpoints(pp2_run):
    run_dir, first = pp2_run
    rows = first["rows"]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [row["loss"] for row in rows]
    for row in rows:
        assert {f"time/{phase}" for phase in PHASES} <= set(row), row
        # Phase times are the maximum over the stages: rank 0 (first stage) logs them, but
        # only the last stage computes the loss.
        for phase in ("data", "forward", "loss", "backward", "grad_sync", "optimizer"):
            assert row[f"time/{phase}"] > 0, (phase, row)
        assert (row["time/checkpoint"] > 0) == (row["step"] % 3 == 0), row
        assert row["consumed_samples"] == 8 * row["step"]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert (plan["engine"], plan["pipeline_parallel_size"], plan["grad_accum_steps"],
            plan["zero_stage"]) == ("megatron", 2, 4, 1)
    ckpts = first["ckpts"]
    assert ckpts["latest"] == "step_000006"
    assert ckpts["complete"] == ["step_000003", "step_000006"]
    assert any(name.endswith(".distcp") for name in ckpts["megatron_files"]), ckpts
    assert ckpts["meta"]["consumed_samples"] == 48


@pytest.mark.slow
def test_pp2_resume_continues_the_step_count(pp2_run):
    run_dir, first = pp2_run
    rows = step_rows(run_dir)
    assert [row["step"] for row in rows] == list(range(1, 11))  # none repeated, none skipped
    assert rows[:6] == first["rows"]
    assert [row["consumed_samples"] for row in rows[6:]] == [56, 64, 72, 80]
    # The resumed model starts from the step-6 weights, not from a fresh initialisation.
    assert rows[6]["loss"] < rows[0]["loss"] - 0.5, [row["loss"] for row in rows]
    events = (run_dir / "events.jsonl").read_text()
    assert "step_000006 at step 6" in events
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000010"


@pytest.mark.slow
def test_moe_ep2_run_logs_load_balancing_loss(tmp_path):
    train(tmp_path, "moe", *MOE_EP2, "trainer.train_steps=4")
    rows = step_rows(tmp_path / "moe")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    balance = [row["moe/load_balancing_loss"] for row in rows]
    # 1.0 = perfectly balanced routing, num_experts / top-k = 2.0 = every token to the same two.
    assert all(math.isfinite(b) and 0.9 < b < 2.0 for b in balance), balance
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3, [row["loss"] for row in rows]
    plan = json.loads((tmp_path / "moe" / "plan.json").read_text())
    assert (plan["expert_parallel_size"], plan["expert_data_parallel_size"], plan["zero_stage"]) \
        == (2, 1, 1)


@pytest.mark.slow
def test_the_load_balancing_loss_is_a_mean_over_the_moe_layers_only(tmp_path):
    """With a dense first layer (model.moe_dense_layers=1 of 2) the logged loss is the mean over
    the one MoE layer: the same 1.0-2.0 band as above (averaged over every layer it read about
    half of that)."""
    train(tmp_path, "dense_first", *MOE_EP2, "model.moe_dense_layers=1", "trainer.train_steps=2")
    balance = [row["moe/load_balancing_loss"] for row in step_rows(tmp_path / "dense_first")]
    assert len(balance) == 2 and all(0.9 < b < 2.0 for b in balance), balance


DP_SHARDED = MEGATRON + ["parallelism.zero_stage=1", "engine.optimizer_checkpoint=dp_reshardable",
                         "trainer.save_interval=2", "trainer.keep_last=0",
                         "trainer.eval_interval=0"]


@pytest.mark.slow
def test_dp_reshardable_checkpoints_resume_bitwise_reshard_dp_and_refuse_a_tp_change(tmp_path):
    """engine.optimizer_checkpoint=dp_reshardable (each rank writes its optimizer shard as it
    is): recorded in the checkpoint; a resume at the same layout repeats the straight run bit for
    bit (the second step after it needs the saved Adam step count: compat.keep_adam_step); DP=2
    -> DP=1 continues within 1e-5; a resume at TP=2 exits 2 naming the option and both fixes."""
    from megatron.core import dist_checkpointing

    train(tmp_path, "straight", *DP_SHARDED, "trainer.train_steps=4")
    step2 = tmp_path / "straight" / "checkpoints" / "step_000002"
    saved = dist_checkpointing.load_content_metadata(str(step2 / "megatron"))
    assert saved["distrib_optim_sharding_type"] == "dp_reshardable"
    straight = step_rows(tmp_path / "straight")[2:]
    train(tmp_path, "resumed", *DP_SHARDED, "trainer.train_steps=4", f"trainer.load={step2}")
    resumed = step_rows(tmp_path / "resumed")
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in resumed] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in straight]
    train(tmp_path, "dp1", *DP_SHARDED, "cluster.gpus_per_node=1", "trainer.train_steps=4",
          f"trainer.load={step2}")
    for mine, theirs in zip(step_rows(tmp_path / "dp1"), straight, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
    refused = train(tmp_path, "tp2", *DP_SHARDED, "parallelism.tensor_parallel_size=2",
                    "trainer.train_steps=4", f"trainer.load={step2}", expect=2)
    message = refused.stdout + refused.stderr
    assert "engine.optimizer_checkpoint=dp_reshardable" in message, message[-3000:]
    assert "resume with parallelism.tensor_parallel_size=1" in message
    assert "python -m launcher.convert reshard checkpoint=" in message
    assert "trainer.init_from=" in message
