"""Stop signals sent at chosen moments of a 2-rank ``python -m launcher.train``'s start-up, and
what came of each (:func:`stop_at`): several runs started together, each signalled at the same
delay after its own launch, so that each runs under the load of the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.signals import launch

EXIT_WITHIN_S = 5.0
"""Longest time from the signal to the launcher's exit."""
STEPS_AFTER_A_STOP_IN_TRAINING = 1
"""Steps that may begin after a signal that reaches a run already training: the ranks honour
a stop at the next step boundary they agree on, and a signal that lands between an agreement
and the next step's start (sent to the launcher: still being forwarded to the ranks; on a
loaded 2-core host, a CI of 2026-11-29 saw it once, step 19 of a run whose steps took 0.1 s)
lets that step begin. A stop during start-up lets none begin."""
CLOCK_SLACK_S = 0.1
"""A step may start this long after the signal was sent: the signal's delivery and the ranks'
agreement take a moment (a step whose agreement had already begun runs)."""


@dataclass
class Case:
    """One run signalled ``delay`` seconds after its launch."""

    name: str
    sig: signal.Signals
    target: str
    """"group" (kill -SIG -- -<pgid>) or "launcher" (its pid alone)."""
    delay: float
    proc: subprocess.Popen = None
    launched: float = 0.0
    sent_wall: float = 0.0
    code: int | None = None
    took: float = 0.0
    output: str = ""
    step_starts: list = field(default_factory=list)
    """Wall-clock start of every step the run logged."""
    events: list = field(default_factory=list)

    @property
    def steps_before(self) -> int:
        return sum(start <= self.sent_wall for start in self.step_starts)

    @property
    def steps_after(self) -> int:
        return sum(start > self.sent_wall + CLOCK_SLACK_S for start in self.step_starts)

    def problems(self) -> list[str]:
        """What this case did against the stop contract ('' none)."""
        out = []
        stopped_lines = [l for l in self.output.splitlines() if "stopped by" in l]
        if self.code != 75:
            out.append(f"exit {self.code}, not 75")
        if self.took > EXIT_WITHIN_S:
            out.append(f"exited {self.took:.1f} s after the signal")
        if self.steps_after > (STEPS_AFTER_A_STOP_IN_TRAINING if self.steps_before else 0):
            out.append(f"{self.steps_after} step(s) began after the signal")
        if "restarting every rank" in self.output or \
                any(e["kind"] == "restart" for e in self.events):
            out.append("restarted")
        if "Traceback" in self.output:
            out.append("a traceback on the console")
        if len(stopped_lines) != 1:
            out.append(f"{len(stopped_lines)} 'stopped by' lines, not 1")
        return out

    def row(self) -> str:
        return (f"{self.name}: {self.sig.name} to the {self.target} at {self.delay:.2f} s -> "
                f"exit {self.code} after {self.took:.2f} s, steps before/after the signal "
                f"{self.steps_before}/{self.steps_after}")


def read_run(case: Case, run_dir: Path, log: Path) -> None:
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.exists() else []
    case.step_starts = [r["time"] - r["step_time"] for r in rows if "step_time" in r]
    events = run_dir / "events.jsonl"
    case.events = [json.loads(l) for l in events.read_text().splitlines()] \
        if events.exists() else []
    case.output = log.read_text()


def _first_line_ran(pid: int, sig: signal.Signals, timeout_s: float = 30.0) -> None:
    """Wait (up to ``timeout_s``) until the launcher ``pid`` catches or holds ``sig``: its
    command's first line has run. Before it the interpreter is still starting, and no Python
    program can catch a signal (0.05-0.08 s on an idle 2-core host; a loaded CI host once took
    past the sweep's first point, 0.5 s)."""
    bit, deadline = 1 << (int(sig) - 1), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            return
        masks = [int(line.split()[1], 16) for line in status.splitlines()
                 if line.startswith(("SigCgt:", "SigBlk:"))]
        if any(mask & bit for mask in masks):
            return
        time.sleep(0.005)


def stop_at(tmp: Path, delay: float, kinds: list[tuple[signal.Signals, str]]) -> list[Case]:
    """Start one run per (signal, target) of ``kinds`` at once; signal each ``delay`` s after its
    launch; wait for all; read what each logged."""
    cases = [Case(f"{sig.name.lower()}_{target}_{delay:.2f}".replace(".", "_"), sig, target,
                  delay) for sig, target in kinds]
    for case in cases:
        case.proc = launch(tmp, case.name, tmp / f"{case.name}.log")
        case.launched = time.monotonic()
    sent = {}
    for case in cases:
        time.sleep(max(0.0, case.launched + delay - time.monotonic()))
        _first_line_ran(case.proc.pid, case.sig)
        case.sent_wall, sent[case.name] = time.time(), time.monotonic()
        if case.target == "group":
            os.killpg(case.proc.pid, case.sig)
        else:
            os.kill(case.proc.pid, case.sig)
    waiting, deadline = list(cases), time.monotonic() + 120
    while waiting:
        for case in [c for c in waiting if c.proc.poll() is not None]:
            case.code, case.took = case.proc.returncode, time.monotonic() - sent[case.name]
            waiting.remove(case)
        if time.monotonic() > deadline:
            for case in waiting:
                os.killpg(case.proc.pid, signal.SIGKILL)
                case.code, case.took = case.proc.wait(), time.monotonic() - sent[case.name]
            break
        time.sleep(0.02)
    for case in cases:
        read_run(case, tmp / case.name, tmp / f"{case.name}.log")
    return cases
