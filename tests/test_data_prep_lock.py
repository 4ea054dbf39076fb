"""One live data_prep run per output part (data_prep.output_lock), with real concurrent processes.

Before: two runs into one output directory at once both went ahead; one exited 0 with a manifest
saying ``complete`` over the other run's ``.bin``. Now the second exits 2 naming the holder's host,
pid and lock file, while the first finishes with correct output; array tasks writing different
parts run side by side; a lock left by a dead process is taken over, and stderr says so.

The first run is held still with SIGSTOP once its lock file names it, so the two runs overlap
whatever the machine's load (a stopped process is alive: its lock must be respected).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import numpy as np
import psutil
import pytest
from tests.helpers.data_prep import PYTHON, REPO, load, prepare, read_documents, run_module, stdlib_documents, write_jsonl

from data_prep.cli import compose
from data_prep.errors import OutputLockedError
from data_prep.output_lock import OutputLock, lock_name
from data_prep.run import execute

HOST = socket.gethostname()
ARGS = ["tokenizer.kind=byte", "workers=1", "block_bytes=4096", "shard_tokens=8000", "name=c"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lock")
    docs = stdlib_documents(24, offset=40, max_chars=3000)
    write_jsonl(root / "a.jsonl", docs[:12])
    write_jsonl(root / "b.jsonl", docs[12:])
    return root, docs


def _inputs(root) -> str:
    return f"input=[{root / 'a.jsonl'},{root / 'b.jsonl'}]"


def _texts(out) -> list:
    return [bytes(d[:-1].astype(np.uint8)).decode("utf-8") for d in read_documents(out)]


def _start(*overrides: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.Popen([PYTHON, "-m", "data_prep", "progress=false", *overrides], cwd=REPO,
                            env=dict(env, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _stop_once_locked(proc: subprocess.Popen, lock, timeout: float = 120.0) -> None:
    """SIGSTOP ``proc`` as soon as the lock file names it (it has taken the output)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads(lock.read_text())["pid"] == proc.pid:
                os.kill(proc.pid, signal.SIGSTOP)
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.002)
    raise AssertionError(f"{lock} never named pid {proc.pid} (exit {proc.poll()})")


def _resume_and_finish(proc: subprocess.Popen) -> str:
    os.kill(proc.pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    return stderr


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.communicate()


@pytest.mark.slow  # concurrent processes
def test_a_second_run_on_a_live_output_is_refused_and_the_first_finishes(corpus, tmp_path):
    root, docs = corpus
    out = tmp_path / "out"
    first = _start(_inputs(root), f"output={out}", *ARGS)
    try:
        _stop_once_locked(first, out / ".data_prep.lock")
        second = prepare(_inputs(root), f"output={out}", *ARGS, check=False)
        assert second.returncode == 2, second.stderr
        assert f"pid {first.pid} on {HOST}" in second.stderr
        assert f"lock file {out / '.data_prep.lock'}" in second.stderr
        _resume_and_finish(first)
    finally:
        _kill(first)
    manifest = load(out / "manifest.json")
    assert manifest["complete"] and manifest["totals"]["documents"] == len(docs)
    assert _texts(out) == docs
    assert not (out / ".data_prep.lock").exists()


@pytest.mark.slow  # concurrent processes
def test_array_tasks_run_side_by_side_but_one_task_index_is_taken_once(corpus, tmp_path):
    root, docs = corpus
    out = tmp_path / "out"
    task0 = _start(_inputs(root), f"output={out}", "num_tasks=2", "task_index=0", *ARGS)
    try:
        _stop_once_locked(task0, out / ".data_prep.task-00000.lock")
        task1 = prepare(_inputs(root), f"output={out}", "num_tasks=2", "task_index=1", *ARGS, check=False)
        assert task1.returncode == 0, task1.stderr
        same_index = prepare(_inputs(root), f"output={out}", "num_tasks=3", "task_index=0", *ARGS,
                             check=False)  # its shards would be named like task0's
        assert same_index.returncode == 2 and f"pid {task0.pid} on {HOST}" in same_index.stderr
        _resume_and_finish(task0)
    finally:
        _kill(task0)
    assert run_module("data_prep.merge", str(out)).returncode == 0
    assert _texts(out) == docs
    assert not list(out.glob(".data_prep*"))


@pytest.mark.slow
def test_a_dead_holders_lock_is_taken_over_and_said_on_stderr(corpus, tmp_path):
    root, docs = corpus
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # exited and reaped: its pid runs nothing now
    (out / ".data_prep.lock").write_text(json.dumps({"host": HOST, "pid": gone.pid, "started": time.time()}))
    proc = prepare(_inputs(root), f"output={out}", *ARGS)
    assert "took over the lock of" in proc.stderr and f"pid {gone.pid} on {HOST}" in proc.stderr
    assert "no longer running" in proc.stderr and str(out / ".data_prep.lock") in proc.stderr
    assert load(out / "manifest.json")["complete"] and _texts(out) == docs
    assert not (out / ".data_prep.lock").exists()


def test_a_zombie_holder_is_dead_and_the_lock_goes_even_when_the_run_fails(corpus, tmp_path, capsys):
    root, _ = corpus
    out = tmp_path / "out"
    out.mkdir()
    zombie = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:  # exited, never waited for
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (out / ".data_prep.lock").write_text(json.dumps({"host": HOST, "pid": zombie.pid, "started": time.time()}))
        (tmp_path / "blank.jsonl").write_text("\n\n")
        cfg = compose([f"input={tmp_path / 'blank.jsonl'}", f"output={out}", "progress=false", *ARGS])
        with pytest.raises(Exception, match="no documents"):
            execute(cfg)
    finally:
        zombie.wait()
    assert f"took over the lock of pid {zombie.pid} on {HOST}" in capsys.readouterr().err
    assert not (out / ".data_prep.lock").exists(), "a failed run releases its lock"


def test_a_lock_from_another_host_is_respected_with_the_way_out(tmp_path):
    (tmp_path / ".data_prep.lock").write_text(json.dumps({"host": "node-elsewhere", "pid": 4242,
                                                          "started": time.time()}))
    with pytest.raises(OutputLockedError) as caught:
        OutputLock(str(tmp_path), lock_name(1, 0)).acquire()
    message = str(caught.value)
    assert "pid 4242 on node-elsewhere" in message and "another host" in message
    assert f"delete {tmp_path / '.data_prep.lock'}" in message


def test_a_live_holder_is_refused_and_release_only_removes_ones_own_lock(tmp_path):
    mine = OutputLock(str(tmp_path), lock_name(2, 1))
    assert mine.acquire() == "" and (tmp_path / ".data_prep.task-00001.lock").exists()
    with pytest.raises(OutputLockedError, match=f"pid {os.getpid()} on {HOST}"):
        OutputLock(str(tmp_path), lock_name(2, 1)).acquire()
    OutputLock(str(tmp_path), lock_name(2, 0)).acquire()  # another task's part is free
    OutputLock(str(tmp_path), lock_name(2, 1)).release()  # never acquired: removes nothing
    assert (tmp_path / ".data_prep.task-00001.lock").exists()
    mine.release()
    assert not (tmp_path / ".data_prep.task-00001.lock").exists()


def test_taking_over_never_removes_a_lock_created_since_the_stale_one_was_judged(tmp_path):
    """Two runs judge the same stale lock; the first takes it over; the second's set-aside step
    moves the *new* lock and must put it back, not delete it."""
    path = tmp_path / ".data_prep.lock"
    path.write_text(json.dumps({"host": HOST, "pid": 1 << 22, "started": 1.0}))
    judged = (path.read_bytes(), os.stat(path))
    winner = OutputLock(str(tmp_path), ".data_prep.lock")
    assert "no longer running" in winner.acquire()
    OutputLock(str(tmp_path), ".data_prep.lock")._set_aside(*judged)
    assert path.read_bytes() == winner.mine
    assert [p.name for p in tmp_path.iterdir()] == [".data_prep.lock"]
    winner.release()


def test_an_unreadable_lock_is_respected_while_young_and_taken_over_when_old(tmp_path):
    path = tmp_path / ".data_prep.lock"
    path.write_bytes(b"")  # a run between creating the file and writing it, or one that crashed there
    with pytest.raises(OutputLockedError, match="starting just now"):
        OutputLock(str(tmp_path), ".data_prep.lock").acquire()
    os.utime(path, (time.time() - 600, time.time() - 600))
    lock = OutputLock(str(tmp_path), ".data_prep.lock")
    assert "unreadable lock file" in lock.acquire()
    lock.release()
