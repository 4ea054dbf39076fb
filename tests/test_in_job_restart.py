"""Hangs found and failures restarted inside the job: real 2-rank runs, real signals.

A rank stopped with SIGSTOP is named by a ``hang`` event within the hang timeout plus a few
seconds, both ranks' stacks are written, the job restarts from the latest checkpoint and ends
with exit 0 and the losses of a straight run, bit for bit; the same after ``kill -9`` of one
rank; more failures than ``resilience.restarts_in_job`` end the job with a summary of every
attempt's cause.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.signals import wait_for
from tests.helpers.training import REPO, TINY, steps_of, train

pytestmark = pytest.mark.slow

STEPS = 30
RUN = [f"trainer.train_steps={STEPS}", "trainer.save_interval=5", "trainer.global_batch_size=8",
       "trainer.eval_interval=0"]
HANG_TIMEOUT_S = 4.0


def _events(run_dir: Path, kind: str) -> list:
    rows = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == kind]


def _last_losses(run_dir: Path) -> dict:
    """step -> loss, the last line of each step (a restart recomputes steps after the
    checkpoint it resumed from)."""
    return {step: row["loss"] for step, row in steps_of(run_dir).items()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("straight")
    train(tmp, "s", *RUN)
    return _last_losses(tmp / "s")


def _run_with(tmp: Path, name: str, *overrides: str):
    """The 2-rank run ``name`` in the background, in its own session."""
    log = tmp / f"{name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "launcher.train", *TINY, f"run.output_root={tmp}",
            f"run.name={name}", *_merged(RUN, overrides)]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log, tmp / name


def _merged(base: list, extra: tuple) -> list:
    """``base`` overrides with those of ``extra`` replacing the same keys."""
    keys = {o.split("=", 1)[0] for o in extra}
    return [o for o in base if o.split("=", 1)[0] not in keys] + list(extra)


def _at_step(run_dir: Path, step: int):
    return lambda: (run_dir / "metrics.jsonl").exists() and \
        f'"step": {step},' in (run_dir / "metrics.jsonl").read_text()


def _rank_pid(run_dir: Path, rank: int) -> int:
    return int((run_dir / "logs" / f"rank_{rank}.pid").read_text())


def test_stopped_rank_is_named_stacks_written_and_the_job_restarts(tmp_path, straight):
    proc, log, run_dir = _run_with(tmp_path, "hang", f"resilience.hang_timeout_s={HANG_TIMEOUT_S}")
    wait_for(proc, log, _at_step(run_dir, 12))
    stopped_at = time.time()
    os.kill(_rank_pid(run_dir, 1), signal.SIGSTOP)
    assert proc.wait(timeout=240) == 0, log.read_text()[-4000:]
    (hang,) = _events(run_dir, "hang")
    assert hang["ranks"] == [1] and "process stopped" in hang["message"]
    assert hang["time"] - stopped_at < HANG_TIMEOUT_S + 5.0, hang
    stacks = run_dir / "hangs" / "attempt_0"
    for rank in (0, 1):
        text = (stacks / f"rank_{rank}.txt").read_text()
        assert "Thread" in text and "launcher/" in text, text  # a Python stack of our code
    assert len(_events(run_dir, "restart")) == 1
    out = log.read_text()
    assert out.count("hung: no progress") == 2  # the line, then the restart line
    assert _last_losses(run_dir) == straight


def test_killed_rank_is_restarted_with_the_same_losses(tmp_path, straight):
    proc, log, run_dir = _run_with(tmp_path, "kill")
    wait_for(proc, log, _at_step(run_dir, 12))
    os.kill(_rank_pid(run_dir, 1), signal.SIGKILL)
    assert proc.wait(timeout=240) == 0, log.read_text()[-4000:]
    end = _events(run_dir, "attempt_end")[0]
    assert "rank 1 died (SIGKILL)" in end["message"] and end["restart"] is True
    assert "restart 1 of 3" in log.read_text()
    assert _last_losses(run_dir) == straight
    _check_goodput(run_dir, log)


def _check_goodput(run_dir: Path, log: Path) -> None:
    """One forced restart: recomputed steps and restart time are counted, the parts add up."""
    report = subprocess.run([sys.executable, "-m", "launcher.report", str(run_dir),
                             "--format", "json"], cwd=REPO, capture_output=True, text=True,
                            check=True)
    acc = json.loads(report.stdout)
    lost = acc["lost_s"]
    assert lost["recomputed"] > 0 and lost["restart"] > 0 and lost["startup"] > 0, acc
    total = acc["productive_s"] + sum(lost.values())
    assert abs(total - acc["wall_s"]) <= 0.02 * acc["wall_s"], acc
    assert 0 < acc["goodput"] < 1 and acc["goodput"] == acc["productive_s"] / acc["wall_s"]
    assert [a["cause"] for a in acc["attempts"]] == ["rank 1 died (SIGKILL)", "finished"]
    assert acc["attempts"][1]["resumed_at"] == 10
    assert "[goodput] goodput" in log.read_text()


def test_more_failures_than_restarts_end_the_job_with_every_cause(tmp_path):
    proc, log, run_dir = _run_with(tmp_path, "spent", "resilience.restarts_in_job=1",
                                   "trainer.train_steps=400")
    wait_for(proc, log, _at_step(run_dir, 8))
    os.kill(_rank_pid(run_dir, 1), signal.SIGKILL)
    first = _rank_pid(run_dir, 0)
    wait_for(proc, log, lambda: _rank_pid(run_dir, 0) != first and
             len(_events(run_dir, "resume")) == 1)
    resumed = max(steps_of(run_dir))
    wait_for(proc, log, lambda: max(steps_of(run_dir)) >= resumed + 3)
    os.kill(_rank_pid(run_dir, 0), signal.SIGKILL)
    code = proc.wait(timeout=120)
    assert code not in (0, 75), code
    out = log.read_text()
    assert "2 attempts: attempt 0: rank 1 died (SIGKILL)" in out
    assert "attempt 1: rank 0 died (SIGKILL)" in out
    assert [e["restart"] for e in _events(run_dir, "attempt_end")] == [True, False]
