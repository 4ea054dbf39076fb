"""The early-warning stop signal reaching ONE rank of a 2-process ``python -m launcher.train``:
every rank saves the same step, the launcher exits 75 for requeue, and a restart finishes."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from launcher.core.exits import REQUEUE_EXIT
from tests.helpers.signals import STEPS, launch, logged_steps, wait_for
from tests.helpers.training import steps_of


def rank_pids(run_dir: Path) -> dict:
    logs = run_dir / "logs"
    return {r: int((logs / f"rank_{r}.pid").read_text()) for r in (0, 1)}


@pytest.mark.slow
def test_signal_to_one_rank_saves_same_step_on_all_ranks_then_restart_finishes(tmp_path):
    run_dir, log = tmp_path / "sig", tmp_path / "first.log"
    proc = launch(tmp_path, "sig", log)
    wait_for(proc, log, lambda: logged_steps(run_dir) >= 2)
    pids = rank_pids(run_dir)
    assert pids[0] != pids[1] and proc.pid not in pids.values()
    os.kill(pids[1], signal.SIGUSR1)  # rank 1 only; rank 0 and the launcher get nothing
    assert proc.wait(timeout=120) == REQUEUE_EXIT, log.read_text()[-4000:]

    ckpts = run_dir / "checkpoints"
    saved = (ckpts / "latest").read_text().strip()
    step = int(saved.split("_")[1])
    assert 2 <= step < STEPS
    assert max(steps_of(run_dir)) == step  # stopped right after the step it saved
    assert sorted(p.name for p in ckpts.glob("step_*")) == [saved]  # one save, no debris
    files = {p.relative_to(ckpts / saved).as_posix() for p in (ckpts / saved).rglob("*")}
    assert {"complete", "rng/rank_0.pt", "rng/rank_1.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files  # both ranks wrote that step
    meta = json.loads((ckpts / saved / "trainwright.json").read_text())
    assert meta["step"] == step and meta["consumed_samples"] == 8 * step
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    stops = [e for e in events if e["kind"] == "stop"]
    assert len(stops) == 1 and f"saving at step {step}" in stops[0]["message"]

    log2 = tmp_path / "second.log"
    proc = launch(tmp_path, "sig", log2)
    assert proc.wait(timeout=150) == 0, log2.read_text()[-4000:]
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    resumes = [e for e in events if e["kind"] == "resume"]
    assert len(resumes) == 1 and f"at step {step}" in resumes[0]["message"]
    steps = steps_of(run_dir)
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert steps[STEPS]["consumed_samples"] == 8 * STEPS
    assert (ckpts / "latest").read_text().strip() == f"step_{STEPS:06d}"
