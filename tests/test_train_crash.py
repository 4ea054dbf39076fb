"""Crash safety of ``python -m launcher.train`` (2 processes, CPU, gloo), end to end.

* ``kill -9`` of the whole process group while a checkpoint is being written: the restart ignores
  and removes the partial ``step_<N>.tmp``, resumes from the previous complete checkpoint (which
  ``latest`` still names) and reproduces the uninterrupted run's later steps exactly.
* A ``latest`` pointer naming garbage, or a truncated checkpoint shard, makes the restart exit
  non-zero with a message naming the file; it never starts from scratch.

The kill lands inside the save deterministically: the killed run gets a ``sitecustomize`` on its
PYTHONPATH that, in the processes of that run only, blocks forever when a file is about to be
written atomically into ``step_000006.tmp`` (rank 0's ``trainwright.json``, written after every
rank's DeepSpeed shards and RNG files, before ``complete``) and drops a marker file first. The test
waits for the marker and SIGKILLs the process group. Nothing else of the runtime is replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.training import REPO, TINY, steps_of

# its module-scoped runs are made once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("train_crash")

COMMON = ["trainer.train_steps=9", "trainer.global_batch_size=8", "trainer.save_interval=3",
          "trainer.keep_last=0", "trainer.eval_interval=0", "trainer.straggler_interval=0"]
HANG_IN = "step_000006.tmp"
HOOK = '''
import os, tempfile, time

_hang_in, _marker = os.environ.get("TW_TEST_HANG_IN"), os.environ.get("TW_TEST_HANG_MARKER")
if _hang_in and _marker:
    _mkstemp = tempfile.mkstemp
    def mkstemp(*args, **kwargs):
        where = kwargs.get("dir") or (args[2] if len(args) > 2 else None)
        if where is not None and os.path.basename(os.fspath(where)) == _hang_in:
            with open(_marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)
        return _mkstemp(*args, **kwargs)
    tempfile.mkstemp = mkstemp
'''


def env_for(extra_path: str = "", **extra: str) -> dict:
    path = os.pathsep.join(p for p in (extra_path, str(REPO)) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": path,
            **extra}


def argv(tmp: Path, name: str, *overrides: str) -> list:
    return [sys.executable, "-m", "launcher.train", *TINY, f"run.output_root={tmp}",
            f"run.name={name}", *COMMON, *overrides]


def train(tmp: Path, name: str, *overrides: str, expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv(tmp, name, *overrides), cwd=REPO, env=env_for(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def train_and_kill_during_save(tmp: Path, name: str) -> None:
    """Start a run that blocks inside the save of step 6; SIGKILL its process group there."""
    hook_dir, marker, log = tmp / "hook", tmp / "in_save.marker", tmp / f"{name}.killed.log"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    env = env_for(str(hook_dir), TW_TEST_HANG_IN=HANG_IN, TW_TEST_HANG_MARKER=str(marker))
    with open(log, "w") as out:
        proc = subprocess.Popen(argv(tmp, name), cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 200
    try:
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # launcher and both ranks: kill -9
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 9-step run, and a run killed while saving step 6 then restarted."""
    tmp = tmp_path_factory.mktemp("crash")
    train(tmp, "straight")
    train_and_kill_during_save(tmp, "crashed")
    ckpts = tmp / "crashed" / "checkpoints"
    after_kill = {
        "latest": (ckpts / "latest").read_text().strip(),
        "entries": sorted(p.name for p in ckpts.glob("step_*")),
        "tmp_files": sorted(p.name for p in (ckpts / HANG_IN).iterdir()),
        "steps": sorted(steps_of(tmp / "crashed")),
    }
    restart = train(tmp, "crashed")
    return {"tmp": tmp, "after_kill": after_kill, "restart": restart}


@pytest.mark.slow
def test_kill_during_save_leaves_previous_checkpoint_and_partial_tmp(runs):
    after = runs["after_kill"]
    assert after["latest"] == "step_000003"
    assert after["entries"] == ["step_000003", HANG_IN]  # step 6 never became a checkpoint
    assert "complete" not in after["tmp_files"] and "trainwright.json" not in after["tmp_files"]
    assert "mp_rank_00_model_states.pt" in after["tmp_files"]  # killed mid-save, shards written
    assert after["steps"] == list(range(1, 6))  # a step is logged after its save


@pytest.mark.slow
def test_restart_after_kill_resumes_previous_checkpoint_and_matches_straight_run(runs):
    tmp = runs["tmp"]
    events = [json.loads(l) for l in (tmp / "crashed" / "events.jsonl").read_text().splitlines()]
    resumes = [e["message"] for e in events if e["kind"] == "resume"]
    assert len(resumes) == 1 and "step_000003 at step 3" in resumes[0]
    ckpts = tmp / "crashed" / "checkpoints"
    assert not list(ckpts.glob("*.tmp"))  # the partial directory was cleaned up
    assert (ckpts / "latest").read_text().strip() == "step_000009"
    assert [p.name for p in sorted(ckpts.glob("step_*"))] == \
        ["step_000003", "step_000006", "step_000009"]
    straight, resumed = steps_of(tmp / "straight"), steps_of(tmp / "crashed")
    assert sorted(resumed) == list(range(1, 10))
    for step in range(4, 10):
        for key in ("loss", "grad_norm", "lr", "consumed_samples"):
            assert resumed[step][key] == straight[step][key], (step, key)


def copy_run(src: Path, dst: Path) -> Path:
    (dst / "checkpoints").parent.mkdir(parents=True)
    shutil.copytree(src / "checkpoints", dst / "checkpoints")
    return dst / "checkpoints"


@pytest.mark.slow
def test_garbage_latest_pointer_fails_naming_the_file(runs):
    tmp = runs["tmp"]
    ckpts = copy_run(tmp / "straight", tmp / "badlatest")
    (ckpts / "latest").write_text("step_0x1f?garbage\n")
    proc = train(tmp, "badlatest", "cluster.gpus_per_node=1", expect=1)
    assert f"{ckpts / 'latest'} names 'step_0x1f?garbage'" in proc.stderr
    assert not (tmp / "badlatest" / "metrics.jsonl").exists() or \
        not (tmp / "badlatest" / "metrics.jsonl").read_text()  # nothing trained from scratch
    assert (ckpts / "latest").read_text() == "step_0x1f?garbage\n"


@pytest.mark.slow
def test_truncated_shard_fails_naming_the_file(runs):
    tmp = runs["tmp"]
    ckpts = copy_run(tmp / "straight", tmp / "badshard")
    shard = ckpts / "step_000009" / "mp_rank_00_model_states.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    proc = train(tmp, "badshard", "trainer.train_steps=12", expect=1)  # past the saved step 9
    assert f"corrupt or truncated file(s): {shard}" in proc.stderr, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr  # a clear one-line error, not a crash
    assert not (tmp / "badshard" / "metrics.jsonl").exists() or \
        not (tmp / "badshard" / "metrics.jsonl").read_text()


def test_unreadable_files_finds_truncated_archives(tmp_path):
    import torch

    from launcher.runtime.checkpoint import unreadable_files

    (tmp_path / "rng").mkdir()
    for name in ("a.pt", "rng/b.pt", "c.pt"):
        torch.save({"x": torch.arange(1000)}, tmp_path / name)
    data = (tmp_path / "rng" / "b.pt").read_bytes()
    (tmp_path / "rng" / "b.pt").write_bytes(data[:-30])
    (tmp_path / "c.pt").write_bytes(b"")
    assert unreadable_files(tmp_path) == [tmp_path / "c.pt", tmp_path / "rng" / "b.pt"]
