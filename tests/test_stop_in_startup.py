"""A stop signal at any moment of a run's start-up ends it as a stop: exit 75 within seconds, one
line, no restart, no step after the signal (issue 44).

A real 2-rank ``python -m launcher.train`` is signalled at points from 0.5 s after its launch to
its first step, two runs at a time, each the load beside the other, taking turns among three
deliveries: SIGTERM to the process group (as Slurm, Kubernetes and ``timeout`` send it), SIGUSR1
(the early warning) to the group, SIGTERM to the launcher's pid alone. The sweep ends at the first
point where both runs had begun training before their signal (the ordinary stop, which saves).
The points are ``TRAINWRIGHT_STARTUP_STOP_STEP_S`` apart (default 1.0 s; docs/training.md gives
a sweep at 0.25 s).

Before the fix: a signal in the launcher's first 2-3 s killed it with 143 and no line; later ones
were often taken for a rank failure ("rank 0 died (SIGTERM); restarting") and the restarted ranks
trained to the end (exit 0), or vanished (a launcher with no ranks yet forwarded it to nobody).
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers.startup_stops import stop_at

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("startup_stop_sweep")]

KINDS = [(signal.SIGTERM, "group"), (signal.SIGUSR1, "group"), (signal.SIGTERM, "launcher")]
STEP_S = float(os.environ.get("TRAINWRIGHT_STARTUP_STOP_STEP_S", "1.0"))
MAX_POINTS = 80


def test_a_stop_signal_at_any_moment_of_start_up_exits_75_at_once_without_restart(tmp_path):
    cases, delay = [], 0.5
    for k in range(MAX_POINTS):
        point = stop_at(tmp_path, delay, [KINDS[k % 3], KINDS[(k + 1) % 3]])
        cases += point
        if all(c.steps_before for c in point):  # every run was training: start-up is covered
            break
        delay += STEP_S
    table = "\n".join(c.row() for c in cases)
    bad = [f"{c.row()}: {'; '.join(c.problems())}\n{c.output[-1500:]}"
           for c in cases if c.problems()]
    assert not bad, "\n\n".join(bad) + "\n\nall cases:\n" + table
    in_start_up = [c for c in cases if not c.steps_before]
    assert len(in_start_up) >= 2 * 6, table  # the sweep did cover start-up
    assert {(c.sig, c.target) for c in in_start_up} == set(KINDS), table
    print(table)
