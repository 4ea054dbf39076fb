"""A run stuck in start-up ends within seconds of a stop signal, whatever its ranks are blocked
in. The stuck ranks here are real: their data's index cache is a named pipe that nobody writes,
so every rank blocks inside open(2) while building the data (a hung network filesystem looks
the same), where Python never runs a signal handler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.training import REPO, TINY, train

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("startup_stop")]

RUN = ["trainer.train_steps=1", "trainer.save_interval=0", "trainer.eval_interval=0"]


@pytest.fixture(scope="module")
def blocking_cache(tmp_path_factory) -> Path:
    """A data cache whose training index is a FIFO: a run using it never gets past start-up."""
    root = tmp_path_factory.mktemp("stuck")
    cache = root / "cache"
    train(root, "warm", *RUN, f"data.cache_dir={cache}")
    index = next(cache.glob("*-train-document_index.npy"))
    index.unlink()
    os.mkfifo(index)
    return cache


def _pids(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in (run_dir / "logs").glob("rank_*.pid")]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("target", ["group", "launcher"])
def test_a_stop_signal_ends_a_run_stuck_in_start_up_within_seconds(tmp_path, blocking_cache,
                                                                   target):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": str(REPO)}
    log = tmp_path / "stuck.log"
    args = [sys.executable, "-m", "launcher.train", *TINY, f"run.output_root={tmp_path}",
            "run.name=stuck", *RUN, f"data.cache_dir={blocking_cache}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    run_dir = tmp_path / "stuck"
    try:
        deadline = time.monotonic() + 240
        while len(_pids(run_dir)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None and len(_pids(run_dir)) == 2, log.read_text()[-3000:]
        ranks = _pids(run_dir)
        time.sleep(3.0)  # well into the blocked data build
        assert proc.poll() is None, log.read_text()[-3000:]
        sent = time.monotonic()
        if target == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log.read_text()
    assert code == 75, out[-3000:]
    assert took < 5.0, (took, out[-3000:])
    assert "stopped by SIGTERM during start-up" in out and "Traceback" not in out, out[-3000:]
    assert not any(_alive(pid) for pid in ranks)
