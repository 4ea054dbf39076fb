"""A 2-rank ``python -m launcher.train`` started in the background, for tests that signal it:
``launch`` (in its own session, so a test can signal its process group), ``wait_for`` a
condition while it runs, ``logged_steps`` so far; ``STEPS`` steps, no periodic saves (``COMMON``).

Formerly in tests/test_train_signal.py; tests/test_stop_delivery.py and tests/test_run_lock.py use
them too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.training import REPO, TINY

STEPS = 60
COMMON = [f"trainer.train_steps={STEPS}", "trainer.global_batch_size=8",
          "trainer.save_interval=0", "trainer.eval_interval=0", "trainer.straggler_interval=0"]


def launch(tmp: Path, name: str, log: Path, *overrides: str) -> subprocess.Popen:
    """The 2-rank run ``name`` in its own session (so a test can signal its process group)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "launcher.train", *TINY, f"run.output_root={tmp}",
            f"run.name={name}", *COMMON, *overrides]
    with open(log, "w") as out:
        return subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_for(proc: subprocess.Popen, log: Path, ready, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"run ended or timed out before it was ready:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


def logged_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.exists() else 0
