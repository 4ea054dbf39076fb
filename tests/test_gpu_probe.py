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
    engine = profile["figures"]["engine"]
    assert [r["layers"] for r in engine] == [1, 2] and 0 < engine[0]["seconds"] < engine[1]["seconds"]
    plan = json.loads(subprocess.run([sys.executable, "-m", "launcher.plan", *JOB,
                                      "plan.format=json"], cwd=REPO, env=env, check=True,
                                     capture_output=True, text=True).stdout)
    assert plan["sources"]["step time"].startswith("measured: "), plan["sources"]
    assert plan["step_time_s"] == pytest.approx(sum(plan["step_time_parts"].values()))
