"""``python -m launcher.train`` with two ranks sharing one CUDA GPU (``cluster.ranks_per_gpu=2``):
``train`` launches a run of the tiny model on mock data (``COMMON``: ``STEPS`` steps at a constant
lr) and asserts it exits 0; ``tail`` shows the end of its log. ``MEGATRON`` and ``DP2`` are
layout overrides.

Formerly in tests/test_gpu_layouts.py (its module docstring describes the setup);
tests/test_gpu_fp8.py uses them too. Importing this module needs no GPU: the GPU modules skip
before they import it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
LAUNCH_TIMEOUT_S = 600

TWO_RANKS_ONE_GPU = ["cluster=local_gpu", "cluster.gpus_per_node=1", "cluster.ranks_per_gpu=2"]
# A constant lr (no warmup, no decay) makes the lr of a step independent of train_steps, so a
# 3-step run resumed to 6 steps sees the same lrs as a 6-step run.
COMMON = ["model=tiny", "model.vocab_size=512", "data=mock", "logger=none",
          "trainer.precision=bf16", "trainer.micro_batch_size=2", f"trainer.train_steps={STEPS}",
          "trainer.eval_interval=0", "trainer.save_interval=0", "trainer.straggler_interval=0",
          "optimizer.lr=1e-3", "optimizer.warmup_steps=0", "optimizer.schedule=constant",
          "data.num_workers=1"]

MEGATRON = ["engine=megatron"]
DP2 = ["trainer.global_batch_size=8"]  # 2 ranks x 2 sequences x 2 accumulation steps


def train(tmp: Path, name: str, *overrides: str, env: dict | None = None) -> Path:
    """``python -m launcher.train`` with two ranks on the GPU; asserts exit 0; the run directory.

    Output goes to ``tmp/<name>.log`` (appended, so a re-launch of the same run keeps both).
    The launcher and its workers run in their own session, killed as a group on a timeout.
    """
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
                 "PYTHONUNBUFFERED": "1",
                 # keep PYTHONPATH (bench/device/setup.sh puts the carried packages on it)
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                             os.environ.get("PYTHONPATH")]))}
    # Two "hosts" on one machine talk over loopback, as in tests/helpers/dist.py.
    child_env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    child_env.update(env or {})
    args = [sys.executable, "-m", "launcher.train", *TWO_RANKS_ONE_GPU, *COMMON,
            f"run.output_root={tmp}", f"run.name={name}", *overrides]
    log = tmp / f"{name}.log"
    with open(log, "a") as out:
        out.write(f"$ {' '.join(args[1:])}\n")
        out.flush()
        proc = subprocess.Popen(args, cwd=REPO, env=child_env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"{name}: no exit within {LAUNCH_TIMEOUT_S} s\n{tail(log)}")
    assert code == 0, f"{name}: exit code {code}\n{tail(log)}"
    return tmp / name


def tail(log: Path, chars: int = 6000) -> str:
    return log.read_text(errors="replace")[-chars:]
