"""A rank's failure keeps its cause however its report goes: the console line, the rank log
diverted when its disk is full, the exit code kept through a failing flush at exit, and the
launcher's verdict taken from the ranks' announced causes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launcher.config import ResilienceConfig
from launcher.launch.watchdog import Attempt, _final_reason
from launcher.runtime.heartbeat import Heartbeat, decided_exit, read_beat, record_path
from tests.helpers.training import REPO

RANK_ON_A_FULL_DISK = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from launcher.runtime.console import route_output
    run_dir = Path(sys.argv[1])
    console = route_output(run_dir, 0, verbose=False)
    for name in ("filler", "logs/rank_0.log"):    # fill the disk, to the log's last page
        with open(run_dir / name, "ab", buffering=0) as f:
            for size in (1 << 16, 1 << 12, 1):
                try:
                    while True:
                        f.write(b"x" * size)
                except OSError:
                    pass
    print("library chatter")                       # buffered in sys.stdout, cannot be flushed
    if "error" in sys.argv[2]:
        console.error("train: rank 0: the cause")
    if "settle" in sys.argv[2]:
        console.settle()
    sys.exit(2)
""")


def _rank_on_full_disk(tmp_path: Path, disk: Path, mode: str) -> subprocess.CompletedProcess:
    fallback = tmp_path / "fallback"
    fallback.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as ranks
    env.update(PYTHONPATH=str(REPO), TMPDIR=str(fallback))
    return subprocess.run([sys.executable, "-c", RANK_ON_A_FULL_DISK, str(disk / "run"), mode],
                          env=env, capture_output=True, text=True, timeout=60)


def test_a_rank_whose_log_is_on_a_full_disk_keeps_its_exit_code_and_says_where_output_went(
        tmp_path, mount_tmpfs):
    disk = mount_tmpfs("1m")
    proc = _rank_on_full_disk(tmp_path, disk, "error,settle")
    assert proc.returncode == 2, proc.stderr
    fallback = tmp_path / "fallback" / "trainwright-run-rank_0.log"
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"train: rank 0: the cause [{disk / 'run' / 'logs' / 'rank_0.log'} cannot "
                     f"be written (No space left on device); its output goes to {fallback}]"]
    kept = fallback.read_text()
    assert "cannot be written (No space left on device)" in kept
    assert "train: rank 0: the cause" in kept and "library chatter" in kept
    again = _rank_on_full_disk(tmp_path, disk, "error,settle")  # starts on the full disk
    assert again.returncode == 2 and again.stderr.strip().splitlines() == lines


def test_a_rank_that_wrote_nothing_since_its_log_filled_keeps_its_exit_code(tmp_path,
                                                                           mount_tmpfs):
    """What :meth:`Console.settle` is for: the interpreter's own flush of a full log at exit
    turns exit 2 into 120; settled first, the buffered output goes to the fallback instead."""
    assert _rank_on_full_disk(tmp_path, mount_tmpfs("1m"), "exit").returncode == 120
    proc = _rank_on_full_disk(tmp_path, mount_tmpfs("1m"), "settle")
    assert proc.returncode == 2, proc.stderr
    assert "library chatter" in (tmp_path / "fallback" / "trainwright-run-rank_0.log").read_text()


def test_the_launcher_takes_a_final_cause_announced_by_any_rank(tmp_path):
    """Rank 0 exits 1 first (it failed while reporting); rank 1 announced exit 2 (a full disk)
    in its heartbeat before the watch killed it: the job ends with 2 and is not restarted."""
    pids = {0: 1000, 1: os.getpid()}
    beat = Heartbeat(record_path(tmp_path, 1), ResilienceConfig())
    beat.exiting(2)
    assert decided_exit(read_beat(record_path(tmp_path, 1))) == 2
    attempt = Attempt(0, 0.0, pids, failure=(0, 1))
    attempt.decided[1] = decided_exit(read_beat(record_path(tmp_path, 1)))
    assert attempt.verdict() == (1, 2)
    assert _final_reason({}, attempt).startswith("exit 2 is a config error or a full disk")
    assert Attempt(0, 0.0, pids, failure=(0, 1)).verdict() == (0, 1)
    assert _final_reason({}, Attempt(0, 0.0, pids, failure=(0, 1))) == ""


@pytest.mark.parametrize("phase,code", [("exiting 75", 75), ("exiting x", None),
                                        ("forward", None)])
def test_only_an_exiting_phase_announces_a_code(tmp_path, phase, code):
    beat = Heartbeat(record_path(tmp_path, 0), ResilienceConfig())
    beat.phase(phase)
    assert decided_exit(read_beat(record_path(tmp_path, 0))) == code
