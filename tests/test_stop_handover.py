"""The pieces of the start-up stop contract (launcher.core.stop, the watch, the sbatch script), in
real processes and real signals, each a few hundred milliseconds; tests/test_startup_stop_sweep.py
runs them together in real training runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from launcher.core.exits import REQUEUE_EXIT
from launcher.launch.sbatch import requeue_codes
from launcher.runtime.heartbeat import Beat, decided_exit, ended_in_startup
from tests.helpers.training import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def run_script(code: str, timeout: float = 30, env: dict = ENV,
               **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, **kw)


def test_a_stop_before_any_rank_exists_ends_the_command_at_once_with_one_line():
    """The first line's handler: a stop while the main thread is busy (here: asleep in C) ends
    the process within a fraction of a second with the code and one line."""
    proc = run_script("""
        import os, signal, time
        from launcher.core.stop import stop_from_first_line
        stop_from_first_line(75, "train", "__main__")
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(30)
        print("not stopped")
    """)
    assert proc.returncode == REQUEUE_EXIT, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "train: stopped by SIGUSR1 during start-up (nothing to save: the run resumes from its "
        "latest checkpoint); exiting 75"]
    assert "not stopped" not in proc.stdout


def test_a_signal_held_before_exec_is_delivered_to_the_first_line_handler():
    """What the agent does: hold the stop signals, then exec. Without the hold the exec'd
    interpreter dies of SIGTERM (-15); with it the signal waits, pending, for the handler."""
    proc = run_script("""
        import os, signal, sys
        from launcher.core.stop import hold_stop_signals
        hold_stop_signals()
        os.kill(os.getpid(), signal.SIGTERM)  # pending: held
        child = "from launcher.core.stop import stop_from_first_line; " \\
                "stop_from_first_line(75, 'train', '__main__'); import time; time.sleep(30)"
        os.execv(sys.executable, [sys.executable, "-c", child])
    """)
    assert proc.returncode == REQUEUE_EXIT, proc.stderr
    assert "stopped by SIGTERM during start-up" in proc.stderr


def test_in_a_spawned_child_it_installs_only_for_a_rank_of_the_launcher():
    """``__mp_main__``: in a rank its launcher spawned (parent pid = LAUNCHER_PID_ENV) the stop is
    handled, silently; in any other child (a rank's helper process) nothing is installed."""
    code = """
        import os, signal, time
        from launcher.core.stop import stop_from_first_line, this_process_stop
        stop_from_first_line(75, "train", "__mp_main__")
        print("installed" if this_process_stop() else "not installed", flush=True)
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(30)
    """
    ours = run_script(code, env={**ENV, "TRAINWRIGHT_LAUNCHER_PID": str(os.getpid())})
    assert (ours.returncode, ours.stdout.strip(), ours.stderr) == (75, "installed", "")
    other = run_script(code, env={**ENV, "TRAINWRIGHT_LAUNCHER_PID": "1"})
    assert (other.returncode, other.stdout.strip()) == (-signal.SIGUSR2, "not installed")


def test_a_forwarding_launcher_records_the_stop_and_sends_it_to_late_ranks_once(tmp_path):
    """After forward_to, a stop no longer ends the launcher: it is recorded and sent to the
    ranks that exist; forward_late sends it to ranks started after it, each once."""
    # The ranks write their stderr to files (not this script's pipes, which a rank left alive
    # would hold open past the script's end), and a rank still alive when the script ends is
    # killed: a failure reports what the launcher had received instead of a bare timeout. The
    # waits are generous: a CI host at the end of the suite has stalled a process for seconds.
    proc = run_script(f"""
        import os, signal, subprocess, sys, time
        from launcher.core.stop import stop_from_first_line, this_process_stop
        stop_from_first_line(75, "train", "__main__")
        request, stops = this_process_stop()
        ranks = []
        stops.forward_to(lambda: [p.pid for p in ranks])
        child = ("import signal, sys, time; "
                 "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42)); "
                 "open(sys.argv[1], 'w').close(); time.sleep(120)")
        def start(name):
            err = open(r"{tmp_path}/" + name + ".err", "w")
            ranks.append(subprocess.Popen([sys.executable, "-c", child, r"{tmp_path}/" + name],
                                          stdout=subprocess.DEVNULL, stderr=err))
            while not os.path.exists(r"{tmp_path}/" + name):
                time.sleep(0.01)
        try:
            start("early")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
            print("received", stops.received, flush=True)
            print("early", ranks[0].wait(timeout=60), flush=True)
            start("late")
            stops.forward_late()
            stops.forward_late()  # once only: the late rank gets one signal
            print("late", ranks[1].wait(timeout=60), flush=True)
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
    """, timeout=180)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert proc.stdout.split() == ["received", str(int(signal.SIGTERM)), "early", "42",
                                   "late", "42"]


def test_the_resource_tracker_outlives_stop_signals_to_the_group():
    """SIGUSR1 to the whole group killed multiprocessing's resource tracker (it ignores only INT
    and TERM); started deaf to stops, it survives and this process too."""
    code = """
        import os, signal, time
        from multiprocessing import resource_tracker
        from launcher.core.stop import (StartupStop, StopRequest,
                                        start_resource_tracker_deaf_to_stops)
        request = StopRequest()
        stops = StartupStop("SIGUSR1", None, request=request)
        start_resource_tracker_deaf_to_stops()
        tracker = resource_tracker._resource_tracker._pid
        os.killpg(0, signal.SIGUSR1)
        os.killpg(0, signal.SIGUSR2)
        time.sleep(0.5)
        state = open(f"/proc/{tracker}/stat").read().rsplit(")", 1)[1].split()[0]
        print(state, signal.Signals(stops.received).name)
    """
    proc = run_script(code, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    state, received = proc.stdout.split()
    assert state in ("S", "R") and received == "SIGUSR1", proc.stdout


def test_a_stop_announced_in_start_up_is_told_apart_from_a_saved_one():
    def beat(phase):
        return Beat(step=0, phase=phase, time=time.time(), timeout_s=1.0, pid=1)

    assert decided_exit(beat("exiting 75 startup")) == 75 and ended_in_startup(
        beat("exiting 75 startup"))
    assert decided_exit(beat("exiting 75")) == 75 and not ended_in_startup(beat("exiting 75"))
    assert decided_exit(beat("startup")) is None and not ended_in_startup(None)


@pytest.mark.parametrize("stop_signal, extra", [("SIGUSR1", 138), ("SIGHUP", 129)])
def test_the_sbatch_script_requeues_a_stop_signal_death_of_the_interpreters_first_instants(
        stop_signal, extra):
    """srun reports a task ended by signal N as 128 + N (seen on this machine's Slurm: 143 for
    TERM, 138 for USR1)."""
    codes = requeue_codes(stop_signal)
    assert codes[0] == REQUEUE_EXIT and {143, 130, 140, extra} <= set(codes)
    assert 137 not in codes and 139 not in codes  # SIGKILL, SIGSEGV: failures, not stops
