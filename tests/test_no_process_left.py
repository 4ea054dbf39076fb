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
                        "time.sleep(300)"], timeout=0.5, start_new_session=True,
                       stdout=open(LEFT, "w"))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                            start_new_session=True)
    LEFT.write_text(f"{LEFT.read_text().strip()} {proc.pid}")


def test_what_it_left_is_gone():
    pids = [int(p) for p in LEFT.read_text().split()]
    LEFT.unlink()
    time.sleep(0.5)
    alive = [p for p in pids if Path(f"/proc/{p}").exists()
             and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert len(pids) == 2 and alive == []
