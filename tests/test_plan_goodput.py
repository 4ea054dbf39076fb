"""The plan's goodput model (cluster.mtbf_hours, Young/Daly) and the resilience checks."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from launcher.compose import compose_config, to_object
from launcher.plan import PlanError, compute_plan
from launcher.plan.goodput import (EXIT_S, STARTUP_S, LaunchCost, expected_goodput,
                                   plan_goodput, run_goodput)
from launcher.plan.resilience import (FIRST_PHASE_FLOOR_S, UNPLANNED_FIRST_PHASE_S,
                                      collective_timeout_s)

EXP_70B = "experiment=llama3_70b_16k_h100"


def plan_of(*overrides):
    return compute_plan(to_object(compose_config(list(overrides))))


def test_best_interval_maximises_the_expected_goodput_near_young_daly():
    g = plan_goodput(checkpoint_bytes=int(500e9), bytes_per_gpu=int(5e9), nodes=100,
                     gbps_per_node=0.5, node_mtbf_hours=1000.0, async_save=False,
                     step_time_s=2.0, save_interval=50, train_steps=100_000)
    assert g.save_s == pytest.approx(10.0) and g.mtbf_hours == pytest.approx(10.0)
    young = math.sqrt(2 * 10.0 * 36_000.0) / 2.0  # steps
    assert abs(g.best_save_interval - young) / young < 0.02
    mtbf_s = 36_000.0

    def at(k):  # the run of 100,000 steps also pays one launch (start-up, exit, final save)
        return run_goodput(expected_goodput(k * 2.0, 10.0, STARTUP_S + 10.0, mtbf_s),
                           100_000 * 2.0, STARTUP_S + EXIT_S)

    assert g.expected_at_best == pytest.approx(at(g.best_save_interval))
    assert all(at(k) <= g.expected_at_best for k in (1, 10, 50, 200, 400, 1000, 5000))
    assert g.expected == pytest.approx(at(50)) and g.expected < g.expected_at_best


def test_async_save_stalls_for_the_host_copy_only():
    kw = dict(checkpoint_bytes=int(500e9), bytes_per_gpu=int(5e9), nodes=100, gbps_per_node=0.5,
              node_mtbf_hours=1000.0, step_time_s=2.0, save_interval=50, train_steps=1000)
    sync, background = plan_goodput(async_save=False, **kw), plan_goodput(async_save=True, **kw)
    assert sync.stall_s == sync.save_s == pytest.approx(10.0)
    assert background.stall_s == pytest.approx(0.2) and background.save_s == sync.save_s
    assert background.best_save_interval < sync.best_save_interval


def test_16k_plan_json_says_what_interruptions_cost():
    out = subprocess.run([sys.executable, "-m", "launcher.plan", EXP_70B, "plan.format=json"],
                         capture_output=True, text=True, check=True).stdout
    g = json.loads(out)["goodput"]
    assert {"mtbf_hours", "save_s", "expected", "best_save_interval",
            "expected_at_best"} <= set(g)
    assert g["mtbf_hours"] == pytest.approx(6330.0 / 2048)
    assert 0 < g["expected"] < g["expected_at_best"] <= 1
    p = plan_of(EXP_70B)
    saved = p.params.total * 14  # bf16 weights + fp32 master, momentum, variance
    assert g["checkpoint_bytes"] == saved
    assert g["save_s"] == pytest.approx(saved / 2048 / 1e9)


def test_mtbf_changes_the_best_interval():
    often = plan_of(EXP_70B, "cluster.mtbf_hours=600").goodput
    rarely = plan_of(EXP_70B, "cluster.mtbf_hours=60000").goodput
    assert often.best_save_interval < rarely.best_save_interval
    assert often.expected_at_best < rarely.expected_at_best


def test_save_interval_longer_than_the_mtbf_is_warned():
    p = plan_of(EXP_70B, "trainer.save_interval=2000")
    warning = [w for w in p.warnings if "trainer.save_interval=2000" in w]
    assert warning and f"save_interval={p.goodput.best_save_interval}" in warning[0]
    assert not [w for w in plan_of(EXP_70B).warnings if "save_interval" in w]


@pytest.mark.parametrize("overrides,keys,fix", [
    (["resilience.hang_timeout_s=600", "resilience.collective_timeout_s=900"],
     ("resilience.collective_timeout_s", "resilience.hang_timeout_s"), "collective_timeout_s >= 1200"),
    (["resilience.hang_timeout_s=1", "cluster.checkpoint_gbps_per_node=0.01"],
     ("resilience.hang_timeout_s",), "shorter than a checkpoint save"),
    (["resilience.restarts_in_job=5", "cluster.time_limit=00:10:00",
      "cluster.checkpoint_gbps_per_node=0.001"],
     ("resilience.restarts_in_job", "cluster.time_limit"), "or a longer time limit"),
])
def test_resilience_settings_that_cannot_work_are_refused(overrides, keys, fix):
    with pytest.raises(PlanError) as info:
        plan_of(EXP_70B, *overrides)
    problems = [p for p in info.value.problems if p.keys == keys]
    assert len(problems) == 1 and fix in problems[0].message
    assert info.value.plan is not None and info.value.plan.goodput is not None


def test_resilience_refusal_exits_2_naming_the_key():
    run = subprocess.run([sys.executable, "-m", "launcher.plan", EXP_70B,
                          "resilience.hang_timeout_s=600", "resilience.collective_timeout_s=60"],
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert "resilience.collective_timeout_s=60 is shorter than" in run.stderr


def test_collective_timeout_backs_up_the_hang_timeout():
    r = to_object(compose_config([])).resilience
    assert r.first_phase_timeout_s == 0  # derived by the plan; unplanned it is 30 minutes
    assert collective_timeout_s(r) == 2 * UNPLANNED_FIRST_PHASE_S
    planned = dataclasses.replace(r, first_phase_timeout_s=plan_of().first_phase_timeout_s)
    assert collective_timeout_s(planned) == max(1800.0, 2 * planned.first_phase_timeout_s)
    r = to_object(compose_config(["resilience.hang_timeout_s=7200",
                                  "resilience.first_phase_timeout_s=600"])).resilience
    assert collective_timeout_s(r) == 14400.0
    r = to_object(compose_config(["resilience.collective_timeout_s=99"])).resilience
    assert collective_timeout_s(r) == 99.0


def test_srun_mode_says_it_has_no_watchdog():
    srun = plan_of("cluster=slurm_cpu", "launch.mode=srun").warnings
    assert any("launch.mode=srun" in w and "no in-job restart" in w for w in srun)
    assert not any("launch.mode=srun" in w
                   for w in plan_of("cluster=slurm_cpu", "launch.mode=torchrun").warnings)
    assert not any("launch.mode=srun" in w for w in plan_of("cluster=local_cpu").warnings)


def test_a_short_run_pays_its_start_up_exit_and_evaluations():
    """100 steps of 0.4 s: 40 s of training against 10 s of start-up, 2 s of exit plus the
    final save and 5 s of evaluations. The interruption model alone says ~100%."""
    kw = dict(checkpoint_bytes=int(1e9), bytes_per_gpu=int(1e8), nodes=1, gbps_per_node=1.0,
              node_mtbf_hours=10_000.0, async_save=False, step_time_s=0.4, save_interval=0,
              train_steps=100)
    g = plan_goodput(launch=LaunchCost(10.0, 2.0, "measured: here"), eval_s=5.0, **kw)
    assert (g.startup_s, g.shutdown_s, g.eval_s) == (10.0, 3.0, 5.0)
    assert g.launch_source == "measured: here"
    # the final save (1 s) is the one save of the interval model; counted once
    assert g.expected == pytest.approx(40.0 / (40.0 + 1.0 + 10.0 + 2.0 + 5.0), rel=1e-3)
    free = plan_goodput(launch=LaunchCost(0.0, 0.0), **kw)
    assert free.expected > 0.97 and g.expected < 0.7


def test_the_cpu_plan_counts_its_launch():
    p = plan_of("cluster=local_cpu", "trainer.train_steps=100", "trainer.eval_interval=40",
                "trainer.precision=fp32")
    g = p.goodput
    assert g.startup_s == 6.0 and g.launch_source == "assumed"
    assert g.eval_s == pytest.approx(2 * p.compute.step_time_s * 10 / 3)  # 2 passes of 10 iters
    train_s = 100 * p.compute.step_time_s
    assert g.expected < train_s / (train_s + g.startup_s + g.shutdown_s + g.eval_s) + 1e-9


def test_the_start_up_timeout_is_derived_from_the_plan():
    """A run stuck in start-up is found in minutes: 30 minutes was the old fixed timeout."""
    tiny = plan_of("cluster=local_cpu", "trainer.precision=fp32")
    assert tiny.first_phase_timeout_s == FIRST_PHASE_FLOOR_S
    big = plan_of(EXP_70B)
    g = big.goodput
    assert big.first_phase_timeout_s == pytest.approx(max(
        FIRST_PHASE_FLOOR_S, 10 * (g.startup_s + g.load_s), 20 * big.compute.step_time_s,
        3 * g.save_s))
    assert big.first_phase_timeout_s < UNPLANNED_FIRST_PHASE_S
    fixed = plan_of("cluster=local_cpu", "resilience.first_phase_timeout_s=42")
    assert fixed.first_phase_timeout_s == 42 and fixed.to_dict()["first_phase_timeout_s"] == 42


def test_an_object_store_adds_its_upload_to_the_save_and_its_download_to_restarts():
    """500 GB on 100 nodes: 10 s to local disk at 0.5 GB/s, then 5 s of upload at 1 GB/s (the
    step commits after both; the loop stalls for the local write only); a restart downloads the
    whole 500 GB on a node (500 s) then reads its 5 GB share (10 s)."""
    kw = dict(checkpoint_bytes=int(500e9), bytes_per_gpu=int(5e9), nodes=100, gbps_per_node=0.5,
              node_mtbf_hours=1000.0, step_time_s=2.0, save_interval=50, train_steps=1000,
              async_save=False)
    disk, store = plan_goodput(**kw), plan_goodput(store_gbps_per_node=1.0, **kw)
    assert (disk.save_s, disk.load_s, disk.upload_s) == pytest.approx((10.0, 10.0, 0.0))
    assert (store.save_s, store.upload_s, store.stall_s) == pytest.approx((15.0, 5.0, 10.0))
    assert store.load_s == pytest.approx(510.0)
    assert store.restart_s == pytest.approx(STARTUP_S + 510.0)
    assert store.expected < disk.expected  # restarts cost more


def test_the_plan_prices_the_store_only_for_s3_checkpoints():
    local = plan_of(EXP_70B)
    s3 = plan_of(EXP_70B, "trainer.checkpoint_uri=s3://bucket/run",
                 "cluster.store_gbps_per_node=2.0")
    upload = local.goodput.checkpoint_bytes / 2048 / 2e9
    assert local.goodput.upload_s == 0 and s3.goodput.upload_s == pytest.approx(upload)
    assert s3.goodput.save_s == pytest.approx(local.goodput.save_s + upload)
    assert "cluster.store_gbps_per_node=2 GB/s" in s3.sources["checkpoint save/load"]
    with pytest.raises(PlanError, match="cluster.store_gbps_per_node=0.0 must be a rate > 0"):
        plan_of("cluster.store_gbps_per_node=0")
