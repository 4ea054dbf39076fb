"""No test leaves a process behind: every process a test starts carries the test's mark in its
environment (:data:`MARK`, set by the autouse fixture in tests/conftest.py), and whatever still
runs with it when the test ends (a training run a timed-out ``subprocess.run`` left, a Slurm
job's steps, DataLoader workers) is killed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

MARK = "TRAINWRIGHT_TEST_MARK"
"""The environment variable that carries the running test's mark."""


def marked(mark: str) -> list[int]:
    """Pids of the processes whose environment has ``MARK=mark`` (this process excluded)."""
    needle = f"{MARK}={mark}\0".encode()
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        pid = int(d.name)
        if pid == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


def forked_not_exec(pid: int = 0) -> list[int]:
    """Children of ``pid`` (default: this process) still running its own program: forked and
    not yet exec-ed, so /proc shows them this process's environment as it was at its start,
    without the mark that os.environ added since (a Popen a moment old)."""
    pid = pid or os.getpid()
    try:
        own = Path(f"/proc/{pid}/cmdline").read_bytes()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = []
    for child in map(int, children):
        try:
            if Path(f"/proc/{child}/cmdline").read_bytes() == own:
                out.append(child)
        except OSError:
            continue
    return out


def kill_marked(mark: str) -> list[int]:
    """SIGKILL every process marked ``mark`` (three sweeps, for children forked meanwhile, and
    for a child caught between its fork and its exec, when its mark cannot be seen yet); the
    pids killed."""
    killed: list[int] = []
    for _ in range(3):
        pids = marked(mark)
        if not pids and not forked_not_exec():
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return killed


def unmarked_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's) without the test's mark: for processes meant to outlive
    the test (a Slurm cluster's daemons)."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k != MARK}
