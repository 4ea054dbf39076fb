"""Each rank's progress, published for the hang watchdog of its node's launcher.

A rank writes one fixed-size record into a small memory-mapped file,
``$TRAINWRIGHT_HEARTBEAT_DIR/rank_<r>.hb``, every time it enters a phase: the seven phases of a
step (through :class:`launcher.core.phases.PhaseTimer`), evaluation, the final save. A record
holds the step, the phase, the wall time of the beat, the rank's pid and the timeout the rank
asks for its current phase. Writing it is a ``struct.pack_into`` into shared memory (about a
microsecond, no system call), so progress reporting costs no step time. The launcher's
watchdog (:mod:`launcher.launch.watchdog`) reads the records; it does not share the ranks' fate.

The timeout of a phase (``resilience.hang_timeout_s``; 0 = automatic): a fixed value, or
``auto_timeout_factor`` x the longest phase this rank has seen (steps, saves and evaluations
alike), never below ``auto_timeout_floor_s`` nor above ``first_phase_timeout_s``. Start-up and
a phase this process has not finished yet (the first step of an attempt, with its data-loader
start and warm-up; the first save) get ``first_phase_timeout_s`` in both modes: a fixed
timeout sized for steady steps tripped on the first step of a restarted attempt on a loaded
machine. Ranks agree on the longest step at
every straggler check (the step times all ranks gather there anyway: :meth:`Heartbeat.agree`).

Records are written under a sequence lock (odd while being written), so the reader never takes
a half-written record for a whole one.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from launcher.config import ResilienceConfig
from launcher.plan.resilience import first_phase_s

HEARTBEAT_DIR_ENV = "TRAINWRIGHT_HEARTBEAT_DIR"
"""Set by the launcher for its ranks: where each rank's record lives (unset: no heartbeat)."""
STARTUP = "startup"
"""The phase of a rank from its start to its first step (import, build, checkpoint load)."""
EXITING = "exiting"
"""The phase of a rank that has decided its exit code: ``exiting <code>``
(:meth:`Heartbeat.exiting`)."""
RECORD = struct.Struct("<QqddQ24s")
"""seq, step, beat time (epoch seconds), timeout (s), pid, phase (ascii, NUL-padded)."""


@dataclass(frozen=True)
class Beat:
    """One rank's last record."""

    step: int
    """Steps completed when the phase began."""
    phase: str
    time: float
    """Wall-clock time (epoch seconds) the phase began."""
    timeout_s: float
    """Seconds this phase may take before the rank counts as hung; <= 0: never."""
    pid: int


def record_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank_{rank}.hb"


class Heartbeat:
    """The writer of one rank's record (see the module docstring)."""

    def __init__(self, path: Path, resilience: ResilienceConfig):
        self._r = resilience
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, RECORD.size)
            self._map = mmap.mmap(fd, RECORD.size)
        finally:
            os.close(fd)
        self._seq, self._pid = 0, os.getpid()
        self.step, self._phase, self._since = 0, "", time.time()
        self._longest: dict[str, float] = {}

    @classmethod
    def from_env(cls, rank: int, resilience: ResilienceConfig) -> Optional["Heartbeat"]:
        """This rank's writer when its launcher watches for hangs, else None."""
        directory = os.environ.get(HEARTBEAT_DIR_ENV)
        return cls(record_path(directory, rank), resilience) if directory else None

    def phase(self, name: str) -> None:
        """This rank entered phase ``name`` of step ``self.step`` (a PhaseTimer hook)."""
        now = time.time()
        if self._phase:
            seconds = now - self._since
            if seconds > self._longest.get(self._phase, 0.0):
                self._longest[self._phase] = seconds
        self._phase, self._since = name, now
        self._write(now, self.timeout_for(name))

    def exiting(self, code: int, in_startup: bool = False) -> None:
        """This rank has decided to exit with ``code``: its launcher's watch reads the cause from
        here even when another rank's exit reaches it first (:func:`decided_exit`).
        ``in_startup``: it ends before its first step, having saved nothing, so the other ranks
        cannot save either (:func:`ended_in_startup`)."""
        self.phase(f"{EXITING} {int(code)}" + (f" {STARTUP}" if in_startup else ""))

    def agree(self, step_times: Iterable[float]) -> None:
        """Fold every rank's step time (gathered for the straggler check) into the history, so
        the automatic timeouts of all ranks learn from the slowest."""
        longest = max(step_times, default=0.0)
        if longest > self._longest.get("step", 0.0):
            self._longest["step"] = longest

    def timeout_for(self, name: str) -> float:
        """Seconds phase ``name`` may take (module docstring); <= 0 = never a hang."""
        r = self._r
        if r.hang_timeout_s < 0:
            return -1.0
        if name == STARTUP or name not in self._longest:
            return first_phase_s(r)
        if r.hang_timeout_s > 0:
            return r.hang_timeout_s
        learned = r.auto_timeout_factor * max(self._longest.values())
        return min(first_phase_s(r), max(r.auto_timeout_floor_s, learned))

    def _write(self, now: float, timeout_s: float) -> None:
        phase = self._phase.encode("ascii", "replace")[:24]
        self._seq += 1  # odd: being written
        struct.pack_into("<Q", self._map, 0, self._seq)
        RECORD.pack_into(self._map, 0, self._seq, self.step, now, timeout_s, self._pid, phase)
        self._seq += 1  # even: whole
        struct.pack_into("<Q", self._map, 0, self._seq)

    def close(self) -> None:
        self._map.close()


def decided_exit(beat: Optional[Beat]) -> Optional[int]:
    """The exit code a rank announced with :meth:`Heartbeat.exiting` (None: none)."""
    if beat is None or not beat.phase.startswith(EXITING + " "):
        return None
    try:
        return int(beat.phase.split()[1])
    except (ValueError, IndexError):
        return None


def ended_in_startup(beat: Optional[Beat]) -> bool:
    """The rank announced its exit before its first step (``exiting <code> startup``)."""
    return decided_exit(beat) is not None and beat.phase.endswith(" " + STARTUP)


def read_beat(path: Path) -> Optional[Beat]:
    """The last whole record at ``path``; None when there is none (yet)."""
    try:
        with open(path, "rb") as f:
            for _ in range(3):
                raw = f.read(RECORD.size)
                if len(raw) < RECORD.size:
                    return None
                seq, step, when, timeout_s, pid, phase = RECORD.unpack(raw)
                if seq and seq % 2 == 0:
                    return Beat(step, phase.rstrip(b"\0").decode("ascii", "replace"), when,
                                timeout_s, pid)
                f.seek(0)
    except OSError:
        return None
    return None
