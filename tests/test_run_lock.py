"""One live run per run directory (launcher.core.locks), with real concurrent processes.

Before: two ``launcher.train`` with the same ``run.name`` both exited 0; a checkpoint directory
had ``complete`` but another run's files, and metrics.jsonl held each step twice. Now the second
launch exits 2 naming the holder's host and pid before anything is written, a lock left by a
dead process is taken over (and an event says so), and a finished run leaves no lock.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from launcher.core import locks
from launcher.core.exits import REQUEUE_EXIT
from tests.helpers.signals import launch, logged_steps, wait_for
from tests.helpers.training import steps_of, train


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / locks.LOCK_NAME).write_text(json.dumps(
            {"host": socket.gethostname(), "pid": sleeper.pid, "started": time.time()}))
        with pytest.raises(locks.RunLocked, match=f"in use by pid {sleeper.pid} on "
                                                    f"{socket.gethostname()}"):
            locks.acquire(tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()
    stale = locks.acquire(tmp_path)  # the holder is gone now
    assert stale is not None and stale.pid == sleeper.pid
    assert locks.holder(tmp_path).pid == os.getpid()
    locks.release(tmp_path)
    assert locks.holder(tmp_path) is None


def test_a_killed_but_unreaped_holder_counts_as_dead(tmp_path):
    """A rank killed with the whole job stays a zombie where nobody reaps it (a container whose
    PID 1 does not); its lock is stale, not live."""
    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while locks.Holder(socket.gethostname(), zombie.pid, time.time()).alive() is not False:
        assert time.monotonic() < deadline  # exited, not yet waited for: a zombie
        time.sleep(0.01)
    (tmp_path / locks.LOCK_NAME).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": zombie.pid, "started": time.time()}))
    assert locks.acquire(tmp_path).pid == zombie.pid
    locks.release(tmp_path)
    zombie.wait()


def test_lock_from_another_host_is_respected_with_the_way_out(tmp_path):
    (tmp_path / locks.LOCK_NAME).write_text(json.dumps(
        {"host": "node-elsewhere", "pid": 4242, "started": 0}))
    with pytest.raises(locks.RunLocked, match="another host.*delete .*run.lock"):
        locks.acquire(tmp_path)


def test_a_requeued_slurm_job_takes_over_its_predecessors_lock(tmp_path, monkeypatch):
    """Killed on one node, requeued onto another: same job id, higher restart count."""
    (tmp_path / locks.LOCK_NAME).write_text(json.dumps(
        {"host": "node-elsewhere", "pid": 4242, "started": 0, "job": "77", "restart": 0}))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with pytest.raises(locks.RunLocked):  # the same incarnation: a second launch, refused
        locks.acquire(tmp_path)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert locks.acquire(tmp_path).host == "node-elsewhere"
    assert locks.holder(tmp_path).restart == 1
    locks.release(tmp_path)


def test_a_restarted_jobset_takes_over_the_lock_its_killed_attempt_left(tmp_path, monkeypatch):
    """A JobSet restart recreates every pod: rank 0 may land on another pod (another host name)
    and the killed attempt's lock stays behind. Its pods carry the JobSet's uid and restart
    attempt (TRAINWRIGHT_JOB_ID/ATTEMPT, from labels): a later attempt of the same JobSet takes
    the lock over; the same attempt, or another JobSet, is refused. Before the fix, every
    restart after a crash was refused with exit 2, which fails a JobSet for good."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / locks.LOCK_NAME).write_text(json.dumps(
        {"host": "tw-run-node-0-1", "pid": 31, "started": 0, "job": "5f1c-uid", "restart": 0}))
    monkeypatch.setenv(locks.JOB_ID_ENV, "5f1c-uid")
    monkeypatch.setenv(locks.JOB_ATTEMPT_ENV, "0")
    with pytest.raises(locks.RunLocked):
        locks.acquire(tmp_path)
    monkeypatch.setenv(locks.JOB_ID_ENV, "another-jobset")
    monkeypatch.setenv(locks.JOB_ATTEMPT_ENV, "1")
    with pytest.raises(locks.RunLocked):
        locks.acquire(tmp_path)
    monkeypatch.setenv(locks.JOB_ID_ENV, "5f1c-uid")
    assert locks.acquire(tmp_path).host == "tw-run-node-0-1"
    assert (locks.holder(tmp_path).job, locks.holder(tmp_path).restart) == ("5f1c-uid", 1)
    locks.release(tmp_path)


@pytest.mark.slow
def test_second_launch_of_a_live_run_exits_2_and_the_first_is_unharmed(tmp_path):
    run_dir, log = tmp_path / "busy", tmp_path / "first.log"
    first = launch(tmp_path, "busy", log, "trainer.train_steps=100000")  # runs until stopped
    wait_for(first, log, lambda: logged_steps(run_dir) >= 1)
    second = train(tmp_path, "busy", "trainer.train_steps=60", "trainer.global_batch_size=8",
                   expect=2)
    holder = locks.holder(run_dir)
    assert f"in use by pid {holder.pid} on {holder.host}" in second.stderr
    assert first.poll() is None  # still training
    os.kill(first.pid, signal.SIGTERM)  # stop it: it saves and exits for requeue
    assert first.wait(timeout=300) == REQUEUE_EXIT, log.read_text()[-3000:]
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == sorted(set(steps))  # every step logged once: the second run wrote nothing
    assert not (run_dir / locks.LOCK_NAME).exists()  # released at the end


@pytest.mark.slow
def test_a_crashed_runs_lock_is_taken_over_on_restart(tmp_path):
    run_dir = tmp_path / "crashed"
    run_dir.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run_dir / locks.LOCK_NAME).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": dead.pid, "started": 0}))
    train(tmp_path, "crashed", "trainer.train_steps=3", "trainer.global_batch_size=8")
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["message"] for e in events if e["kind"] == "lock"] == [
        f"took over the lock of pid {dead.pid} on {socket.gethostname()}, which is no longer "
        "running"]
    assert max(steps_of(run_dir)) == 3 and not (run_dir / locks.LOCK_NAME).exists()
