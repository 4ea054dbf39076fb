"""A process a test leaves behind (a run a timed-out ``subprocess.run`` left, detached in its
own session) is killed when the test ends (tests/conftest.py, tests/helpers/processes.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("no_process_left")

LEFT = Path(os.environ.get("TMPDIR", "/tmp")) / f"trainwright-left-behind-{os.getppid()}.pid"


def test_a_test_that_leaves_a_detached_process_behind():
    with pytest.raises(subprocess.TimeoutExpired):  # what a timed-out run of launcher.train does
        subprocess.run([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); "
                        "time.sleep(300)"], timeout=8.0, start_new_session=True,
                       stdout=open(LEFT, "w"))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                            start_new_session=True)
    LEFT.write_text(f"{LEFT.read_text().strip()} {proc.pid}")


def test_what_it_left_is_gone():
    # the timed-out child has 8 s to print its pid: its interpreter's start took over 3 s once,
    # on a 2-core host under the suite's load, and the pid was missing
    pids = [int(p) for p in LEFT.read_text().split()]
    LEFT.unlink()
    time.sleep(0.5)
    alive = [p for p in pids if Path(f"/proc/{p}").exists()
             and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert len(pids) == 2 and alive == []


FORKED = Path(os.environ.get("TMPDIR", "/tmp")) / f"trainwright-forked-{os.getppid()}.pid"


def test_a_test_that_ends_while_its_child_is_between_fork_and_exec():
    """A Popen a moment old: /proc shows the child this process's environment as it was at its
    start, without the mark, until the child execs (here 0.3 s after its fork)."""
    pid = os.fork()
    if pid == 0:  # the child: what subprocess does, slowed down (never back into pytest)
        try:
            time.sleep(0.3)
            os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)"],
                      dict(os.environ))
        finally:
            os._exit(1)
    FORKED.write_text(str(pid))


def test_the_child_caught_between_fork_and_exec_is_gone():
    pid = int(FORKED.read_text())
    FORKED.unlink()
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it was killed (it is this process's child)
    except ChildProcessError:
        pass
    time.sleep(0.3)
    assert not Path(f"/proc/{pid}").exists() or \
        Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
