"""The node launcher's watch over its ranks: hangs found from their heartbeats, failures
restarted inside the allocation by torch elastic's own agent.

torch elastic's agent (:func:`launcher.launch.local.launch_world`) already supervises the
ranks: it notices a dead or failed rank, stops the others and restarts the whole worker group
from a new rendezvous round while it has restarts left (``max_restarts``; the ranks resume
from the latest complete checkpoint, as after a requeue). :class:`JobWatch` adds what it lacks,
through one hook called after each of the agent's health checks
(:func:`launcher.engines.compat.monitored_elastic_agent`):

* **Hangs.** Every rank publishes its progress (:mod:`launcher.runtime.heartbeat`). When no
  rank of this node has entered a new phase for longer than the timeout the ranks ask for,
  the job is hung: one line and a ``hang`` event name the rank(s) that stopped first and the
  phase of every rank (a SIGSTOPped process shows as ``stopped``), every rank's Python stack
  goes to ``<run_dir>/hangs/attempt_<n>/rank_<r>.txt`` (py-spy reads it from outside, so a
  stopped or deadlocked rank is read too), then the ranks are killed; the agent sees the
  failure and restarts them.
* **Which failures restart.** Config errors (exit 2), non-finite losses (3) and stops for
  requeue (75) are final; so is a failure of an attempt that completed no step since its
  restart. A restart is one line and a ``restart`` event; when the restarts are spent the
  launcher prints every attempt's cause and exits with the failing rank's code (never 75).
* **Attempts.** Each attempt (start, cause of its end, steps reached) is an event in
  ``events.jsonl``, which the goodput report (``launcher.report``) reads.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from launcher.config import ResilienceConfig
from launcher.core.atomic import atomic_write_text
from launcher.core.exits import (BAD_DATA_EXIT, CONFIG_ERROR_EXIT, PERMANENT_EXITS, REQUEUE_EXIT,
                                 STORAGE_EXIT)
from launcher.core.jit_locks import release_jit_build_locks
from launcher.plan.resilience import first_phase_s
from launcher.runtime.heartbeat import (STARTUP, Beat, decided_exit, ended_in_startup, read_beat,
                                        record_path)
from launcher.runtime.metrics import append_event

FINAL_EXITS = {CONFIG_ERROR_EXIT: "a config error or a full disk",
               BAD_DATA_EXIT: "a non-finite loss",
               STORAGE_EXIT: "checkpoints failing to save",
               REQUEUE_EXIT: "a stop for requeue"}
"""Exit codes that are never restarted: retrying reproduces them, or they were asked for."""
CHECK_INTERVAL_S = 0.5
"""Seconds between two reads of the heartbeats."""
STACK_TIMEOUT_S = 20.0
"""Longest wait for one rank's stack."""


@dataclass
class Attempt:
    """One start of the worker group."""

    number: int
    started: float
    pids: dict
    """Global rank -> pid."""
    first_step: Optional[int] = None
    """Steps completed when its ranks first reported (the checkpoint it resumed from)."""
    last_step: Optional[int] = None
    cause: str = ""
    """Why it ended ('' while it runs)."""
    failure: Optional[tuple] = None
    """(rank, exit code) of the first rank seen failing (128 + N for a signal N), before the
    watch killed the others (which the agent then also reports as failed)."""
    decided: dict = field(default_factory=dict)
    """Global rank -> the exit code it announced before exiting (its heartbeat): a rank that
    failed while reporting a full disk, or that the watch killed, still tells its cause."""
    final: str = ""
    """Why this attempt's failure is not restarted ('' when it may be, or while it runs)."""
    saved: bool = False
    """A rank of it ended 75 after the loop's stop: the ranks agreed to stop and saved."""

    def verdict(self) -> Optional[tuple]:
        """(rank, exit code) the job ends with: the first rank that decided a final exit (a
        config error or full disk, non-finite numbers, a stop for requeue; in that order), else
        the first failure seen; None when none was seen."""
        for code in FINAL_EXITS:
            ranks = sorted(r for r, c in self.decided.items() if c == code)
            if ranks:
                return ranks[0], code
        return self.failure


@dataclass
class JobWatch:
    """The hook of :func:`launcher.engines.compat.monitored_elastic_agent` (module docstring)."""

    resilience: ResilienceConfig
    heartbeat_dir: Path
    run_dir: Optional[Path]
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    stops: Optional[Any] = None
    """The launcher's stop signals (:class:`launcher.core.stop.StartupStop`, set by
    :func:`launcher.launch.local.launch_world`): once it has received one, the job is stopping
    (:meth:`stopping`)."""
    attempts: list = field(default_factory=list)
    _hang: str = ""
    _checked: float = 0.0

    def __call__(self, agent, worker_group, result):
        from torch.distributed.elastic.agent.server.api import WorkerState

        pids = {w.global_rank: w.id for w in worker_group.workers if w.id is not None}
        if not self.attempts or self.attempts[-1].pids != pids:
            self._begin(pids)
        if self.stopping() is not None:
            self.stops.forward_late()  # ranks spawned after the signal
        self._follow_steps()
        if result.state == WorkerState.FAILED:
            self._failed(agent, result)
        elif result.state == WorkerState.SUCCEEDED:
            self._finished()
        elif result.state == WorkerState.HEALTHY and not self._end_broken_world():
            self._check_hang_now_and_then()
        return result

    def _finished(self) -> None:
        attempt = self.attempts[-1]
        if not attempt.cause:
            attempt.cause = "finished"
            self._event("attempt_end", f"attempt {attempt.number}: finished",
                        attempt=attempt.number, step=attempt.last_step, restart=False)

    def _check_hang_now_and_then(self) -> None:
        now = time.monotonic()
        if self.resilience.hang_timeout_s >= 0 and not self._hang \
                and now - self._checked >= CHECK_INTERVAL_S:
            self._checked = now
            self._check_hang()

    def stopping(self) -> Optional[int]:
        """The stop signal the launcher received (None: none): the job is stopping, so no
        failure restarts it and it exits 75 (:meth:`stopped`)."""
        return self.stops.received if self.stops is not None else None

    def _end_broken_world(self) -> bool:
        """A rank that died or failed (an exit other than 0 and 75, or a 75 before its first
        step, read from its zombie before the agent reaps it) leaves the others waiting on it:
        kill them now, so the agent does not spend its 30 s SIGTERM grace on ranks that cannot
        save anyway."""
        attempt, beats = self.attempts[-1], self._beats()
        dead = {r: _exit_status(pid) for r, pid in attempt.pids.items() if _state(pid) == "Z"}
        broken = [r for r, status in dead.items()
                  if status is not None and (status & 0x7F or status >> 8 not in (0, REQUEUE_EXIT)
                                             or (status >> 8 == REQUEUE_EXIT
                                                 and not _saved_stop(beats.get(r))))]
        if not broken:
            return False
        if attempt.failure is None:
            status = dead[broken[0]]
            attempt.failure = (broken[0], 128 + (status & 0x7F) if status & 0x7F else status >> 8)
        self._read_decisions()
        for rank, pid in attempt.pids.items():
            if rank not in dead:
                _kill_tree(pid)
        return True

    def _begin(self, pids: dict) -> None:
        number = len(self.attempts)
        self.attempts.append(Attempt(number, time.time(), dict(pids)))
        self._hang = ""
        self._event("attempt_start", f"attempt {number}: {len(pids)} rank(s) started",
                    attempt=number)

    def _read_decisions(self) -> None:
        """Note the exit codes the current attempt's ranks have announced so far."""
        for rank, beat in self._beats().items():
            code = decided_exit(beat)
            if code is not None:
                self.attempts[-1].decided.setdefault(rank, code)

    def _beats(self) -> dict:
        """Global rank -> its current attempt's last beat (None before the first)."""
        out = {}
        for rank, pid in self.attempts[-1].pids.items():
            beat = read_beat(record_path(self.heartbeat_dir, rank))
            out[rank] = beat if beat is not None and beat.pid == pid else None
        return out

    def _follow_steps(self) -> None:
        attempt = self.attempts[-1]
        steps = [b.step for b in self._beats().values()
                 if b is not None and b.phase != STARTUP and not ended_in_startup(b)]
        if steps:
            if attempt.first_step is None:
                attempt.first_step = min(steps)
            attempt.last_step = max(steps + [attempt.last_step or 0])

    def _check_hang(self) -> None:
        attempt, beats, now = self.attempts[-1], self._beats(), time.time()
        live = {r: pid for r, pid in attempt.pids.items() if _alive(pid)}
        if not live:
            return
        last = max((b.time for r, b in beats.items() if b and r in live), default=attempt.started)
        timeout = max((b.timeout_s for r, b in beats.items() if b and r in live),
                      default=first_phase_s(self.resilience))
        if any(beats.get(r) is None for r in live):
            timeout = max(timeout, first_phase_s(self.resilience))
        if timeout <= 0 or now - last <= timeout:
            return
        self._declare_hang(live, beats, now - last, timeout)

    def _declare_hang(self, live: dict, beats: dict, idle: float, timeout: float) -> None:
        attempt = self.attempts[-1]
        stuck = _first_stopped(live, beats)
        where = "; ".join(f"rank {r}: {_where(beats.get(r), live[r])}" for r in sorted(live))
        stacks = self._dump_stacks(attempt.number, live)
        self._hang = (f"rank(s) {', '.join(map(str, stuck))} hung: no progress for {idle:.0f} s "
                      f"(timeout {timeout:.0f} s; {where})")
        self.say(f"launcher: {self._hang}; {stacks}")
        self._event("hang", self._hang, attempt=attempt.number, ranks=stuck, idle_s=round(idle, 1),
                    timeout_s=timeout, stacks=stacks)
        for pid in live.values():
            _kill_tree(pid)
        release_jit_build_locks(attempt.started)

    def _dump_stacks(self, number: int, live: dict) -> str:
        if not self.resilience.stack_dumps or self.run_dir is None:
            return "stack dumps are off (resilience.stack_dumps)"
        spy = shutil.which("py-spy") or _beside_python("py-spy")
        if spy is None:
            return "no stacks: py-spy is not installed (pip install py-spy)"
        folder = self.run_dir / "hangs" / f"attempt_{number}"
        folder.mkdir(parents=True, exist_ok=True)
        runs = {r: subprocess.Popen([spy, "dump", "--nonblocking", "--pid", str(pid)],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for r, pid in live.items()}
        for rank, run in runs.items():
            try:
                text, _ = run.communicate(timeout=STACK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                run.kill()
                text = f"py-spy did not answer within {STACK_TIMEOUT_S:.0f} s\n"
            atomic_write_text(folder / f"rank_{rank}.txt", text)
        return f"stacks of {len(runs)} rank(s) in {folder}"

    def _failed(self, agent, result) -> None:
        attempt = self.attempts[-1]
        if attempt.cause:
            return
        self._read_decisions()
        attempt.cause = self._hang or _failure_cause(result.failures, attempt.verdict())
        final = _final_reason(result.failures, attempt)
        if self.stopping() is not None:
            final = f"the job was asked to stop ({signal.Signals(self.stopping()).name})"
        left = getattr(agent, "_remaining_restarts", 0)
        if final:
            agent._remaining_restarts = 0
            attempt.final = final
        attempt.saved = self._saving(result.failures)
        if not attempt.saved:
            for pid in attempt.pids.values():  # nothing to save: the checkpoint on disk is
                _kill_tree(pid)                # what the next attempt resumes from
            release_jit_build_locks(attempt.started)
        self._event("attempt_end", f"attempt {attempt.number}: {attempt.cause}",
                    attempt=attempt.number, step=attempt.last_step,
                    restart=bool(left and not final))
        if left and not final:
            total = self.resilience.restarts_in_job
            self.say(f"launcher: {attempt.cause}; restarting every rank from the latest "
                     f"checkpoint (restart {total - left + 1} of {total})")
            self._event("restart", f"restart {total - left + 1} of {total} after: "
                        f"{attempt.cause}", attempt=attempt.number + 1)

    def _saving(self, failures: dict) -> bool:
        """Some rank ended 75 after its first step: the ranks agreed to stop and save, and the
        others may still be writing their share (a 75 before the first step saved nothing)."""
        beats, attempt = self._beats(), self.attempts[-1]
        stopped = {r for r, f in failures.items() if f.exitcode == REQUEUE_EXIT} | \
            {r for r, code in attempt.decided.items() if code == REQUEUE_EXIT}
        return any(_saved_stop(beats.get(r)) for r in stopped)

    def verdict(self) -> Optional[tuple]:
        """(rank, exit code) of the last attempt's failure (:meth:`Attempt.verdict`); None: the
        agent's report decides."""
        return self.attempts[-1].verdict() if self.attempts else None

    def stopped(self) -> Optional[tuple]:
        """(75, the line that says so) when the launcher was asked to stop: whatever the ranks
        ended with (saved and exited 75, ended in start-up, killed before their handlers), the
        job stopped; None when it was not asked to, or a rank decided a config error or
        non-finite numbers or failing saves (2, 3, 4), which a requeue would only meet again."""
        signum, verdict = self.stopping(), self.verdict()
        if signum is None or (verdict is not None and verdict[1] in PERMANENT_EXITS):
            return None
        name = signal.Signals(signum).name
        attempt = self.attempts[-1] if self.attempts else None
        if attempt is not None and attempt.saved:
            return REQUEUE_EXIT, f"stopped by {name}; the ranks saved their last step"
        if attempt is None or attempt.last_step is None:
            return REQUEUE_EXIT, (f"stopped by {name} during start-up (nothing to save: the run "
                                  "resumes from its latest checkpoint)")
        return REQUEUE_EXIT, (f"stopped by {name}; the ranks ended without saving (the run "
                              "resumes from its latest checkpoint)")

    def summary(self) -> str:
        """Every attempt and how it ended (printed when the job fails for good)."""
        return "; ".join(f"attempt {a.number}: {a.cause or 'running'}"
                         + (f" (at step {a.last_step})" if a.last_step is not None else "")
                         for a in self.attempts)

    def _event(self, kind: str, message: str, **fields) -> None:
        """An event in the run's events.jsonl; a run directory that cannot take it (a full
        disk) loses the event, and the run's end says the account could not be written."""
        if self.run_dir is not None:
            try:
                append_event(self.run_dir, kind, message, **fields)
            except OSError:
                pass


def _saved_stop(beat: Optional[Beat]) -> bool:
    """The rank announced exit 75 after the loop's stop, that is after saving (a 75 announced in
    start-up, or none announced: it stopped before its heartbeat existed, saved nothing)."""
    return decided_exit(beat) == REQUEUE_EXIT and not ended_in_startup(beat)


def _final_reason(failures: dict, attempt: Attempt) -> str:
    """Why this failure must not be restarted ('' when it may)."""
    codes = {f.exitcode for f in failures.values()} | set(attempt.decided.values()) | \
        {attempt.failure[1] if attempt.failure else 0}
    for code, what in FINAL_EXITS.items():
        if code in codes:
            return f"exit {code} is {what}, which a restart would not change"
    if attempt.number > 0 and (attempt.last_step is None
                               or attempt.last_step <= (attempt.first_step or 0)):
        return "it failed again before completing a step since the last restart"
    return ""


def _failure_cause(failures: dict, first: Optional[tuple] = None) -> str:
    """'rank 1 died (SIGKILL)' / 'rank 0 exited with code 1': the first failure the watch saw,
    else the first own failure the agent reports."""
    if first is not None:
        rank, code = first
        return (f"rank {rank} died ({signal.Signals(code - 128).name})" if code > 128
                else f"rank {rank} exited with code {code}")
    own = {r: f for r, f in failures.items() if f.exitcode > 0} or failures
    rank = min(own, key=lambda r: (own[r].timestamp, r))
    f = own[rank]
    return (f"rank {rank} exited with code {f.exitcode}" if f.exitcode > 0
            else f"rank {rank} died ({f.signal_name()})")


def _first_stopped(live: dict, beats: dict) -> list:
    """The ranks that stopped first: stopped processes, else the least advanced beat."""
    stopped = [r for r, pid in live.items() if _state(pid) in ("T", "t")]
    if stopped:
        return sorted(stopped)
    known = {r: b for r, b in beats.items() if b is not None and r in live}
    if not known:
        return sorted(live)
    oldest = min(b.time for b in known.values())
    return sorted(r for r, b in known.items() if b.time - oldest < 1.0)


def _where(beat: Optional[Beat], pid: int) -> str:
    state = {"T": ", process stopped", "t": ", process stopped", "D": ", in uninterruptible I/O",
             "Z": ", exited"}.get(_state(pid), "")
    if beat is None or beat.phase == STARTUP:
        return "starting up" + state
    return f"{beat.phase} of step {beat.step + 1}{state}"


def _state(pid: int) -> str:
    """The process's state letter from /proc (R, S, D, T, Z; '' when unknown)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        return ""


def _exit_status(pid: int) -> Optional[int]:
    """The wait status of a zombie (the last field of /proc/<pid>/stat, Linux >= 3.5)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(" ", 1)[-1])
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in ("", "Z", "X")


def _kill_tree(pid: int) -> None:
    """SIGKILL a hung rank and its DataLoader workers (a stopped process dies of it too)."""
    import psutil

    try:
        family = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.Error:
        return
    for proc in family:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def _beside_python(name: str) -> Optional[str]:
    """A console script installed next to this interpreter (a virtual environment's bin)."""
    path = Path(sys.executable).parent / name
    return str(path) if os.access(path, os.X_OK) else None
