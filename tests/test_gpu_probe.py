"""The machine probe on a CUDA GPU, two ranks sharing it (``cluster.ranks_per_gpu=2``): every
figure measured on the device, NCCL collectives included, and the plan composed from them.

First run on an H100 (2026-11-27), where the probe failed at once: its passes built the batch,
the norms' weights and the AdamW state on the host and read the clock without waiting for the
GPU. Skips without CUDA; on a GPU machine: ``bash bench/device/run_gpu_tests.sh
tests/test_gpu_probe.py`` (verify.sh's ``gpu_layouts`` step runs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.helpers.gpu import COMMON, DP2, MEGATRON, REPO, TWO_RANKS_ONE_GPU  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
JOB = [*TWO_RANKS_ONE_GPU, *COMMON, *MEGATRON, *DP2, "parallelism.zero_stage=1"]


def test_the_probe_measures_the_gpu_and_calibrates_the_plan(tmp_path):
    env = {**os.environ, "TRAINWRIGHT_PROFILE_DIR": str(tmp_path / "profiles"),
           "NCCL_SOCKET_IFNAME": "lo", "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "launcher.probe", *JOB,
                           f"run.output_root={tmp_path}", "run.name=probe"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = (tmp_path / "profiles").glob("*.json")
    profile = json.loads(path.read_text())
    assert profile["device"] != "cpu" and profile["ranks"] == 2, profile["device"]
    passes = profile["figures"]["passes"]
    assert passes and all(r["layer_s"] > 0 and r["embedding_s"] > 0 and r["output_s"] > 0
                          for r in passes)
    ops = {r["key"]["op"] for r in profile["figures"]["collectives"]}
    assert {"all_reduce", "reduce_scatter", "all_gather"} <= ops, ops
    engine = [r for r in profile["figures"]["engine"] if r["key"]["engine"] == "megatron"]
    assert [r["layers"] for r in engine] == [1, 2, 1]  # the third in micro-batches of one
    assert 0 < engine[0]["seconds"] < engine[1]["seconds"]  # a layer more
    plan = json.loads(subprocess.run([sys.executable, "-m", "launcher.plan", *JOB,
                                      "plan.format=json"], cwd=REPO, env=env, check=True,
                                     capture_output=True, text=True).stdout)
    assert plan["sources"]["step time"].startswith("measured: "), plan["sources"]
    assert plan["step_time_s"] == pytest.approx(sum(plan["step_time_parts"].values()))


def collective_worker(args: dict) -> dict:
    """One rank: the probe's all-reduce figure of ``args["numel"]`` fp32 elements, and the same
    all-reduce timed here with the device drained before the clock stops (the reference)."""
    import time

    import torch.distributed as dist

    from launcher.parallel import collectives

    numel = args["numel"]
    probe = collectives.collective_seconds("all_reduce", numel, torch.float32, reps=3)
    data = torch.ones(numel, device="cuda")
    reference = []
    for _ in range(3):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        dist.all_reduce(data)
        torch.cuda.synchronize()
        reference.append(time.perf_counter() - start)
    return {"probe_s": probe, "reference_s": sorted(reference)[1]}


def test_a_collective_is_timed_to_its_completion_on_the_device():
    """NCCL returns when the all-reduce is enqueued: the probe's clock stopped there, and a
    1 GiB all-reduce came out at the cost of its launch, which priced every layout's DP, TP and
    PP traffic near free. Now it waits for the device (launcher/parallel/timing.py)."""
    from tests.helpers.dist import run_distributed

    numel = 2 ** 28  # 1 GiB of fp32 per rank
    results = run_distributed("tests.test_gpu_probe:collective_worker", 2, {"numel": numel},
                              timeout=600, backend="nccl")
    for r in results:
        assert r["probe_s"] >= 0.5 * r["reference_s"], r
        assert r["probe_s"] >= numel * 4 / 5e12, r  # not faster than reading it once from HBM
