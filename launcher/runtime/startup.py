"""Where a rank's start-up goes: :class:`StartupClock`.

Each rank marks the end of every part of its start-up; rank 0 logs the parts as one
``startup`` event (events.jsonl, the console, the run's report) just before its first step:

    [startup] 7.9 s from launch to the first step: launcher 1.4 (compose, plan, spawn), imports
    2.6, process group 0.3, run directory 0.2, build 1.6, checkpoint 0.0, data 1.5

The clock starts at the launching process's start (``launched_at``, the Job's), so the parts
add up to the whole wait a user sees; a rank started from outside (srun, torchrun) counts from
its own process start.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

PARTS = {"launcher": "compose, plan, spawn", "imports": "", "process_group": "",
         "run_directory": "lock, metrics", "build": "model, optimizer, engine",
         "checkpoint": "resume or initial weights", "data": "datasets, loaders"}
"""The parts in order, with what each holds where the name does not say."""


def process_start_time() -> float:
    """When this process started (epoch seconds, to the clock tick). On Linux: its start in
    ticks after boot (``/proc/self/stat``) on a boot time of ``time.time()`` less
    ``/proc/uptime``. psutil's boot time is ``/proc/stat``'s btime, in whole seconds, which put
    a start up to 1 s early (and a forked rank's "imports" at 0.9 s where it took 0.03 s); its
    figure is kept where /proc says otherwise (a container whose uptime is its own)."""
    import psutil

    rough = psutil.Process().create_time()
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
            since_boot = float(uptime.read().split()[0])
        exact = time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return rough
    return exact if abs(exact - rough) <= 1.5 else rough


@dataclass
class StartupClock:
    """Marks of one rank's start-up (:data:`PARTS`), from ``origin`` (epoch seconds)."""

    origin: float
    marks: dict = field(default_factory=dict)
    """part -> the epoch second it ended."""

    @classmethod
    def start(cls, launched_at: Optional[float]) -> "StartupClock":
        """A clock from the launcher's start (``launched_at``; None: this process's start);
        the part up to this process's start is the launcher's."""
        clock = cls(launched_at or process_start_time())
        if launched_at:
            clock.marks["launcher"] = process_start_time()
        return clock

    def mark(self, part: str) -> None:
        """``part`` (a key of :data:`PARTS`) ends now."""
        self.marks[part] = time.time()

    def parts(self) -> dict:
        """{part: seconds} of the parts marked, in order."""
        out, previous = {}, self.origin
        for part in PARTS:
            if part in self.marks:
                out[part] = max(0.0, self.marks[part] - previous)
                previous = self.marks[part]
        return out

    def total(self) -> float:
        return sum(self.parts().values())

    def text(self) -> str:
        """``7.9 s from launch to the first step: launcher 1.4 (compose, plan, spawn), ...``"""
        parts = ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}"
                          + (f" ({PARTS[name]})" if PARTS[name] else "")
                          for name, seconds in self.parts().items())
        return f"{self.total():.1f} s from launch to the first step: {parts}"
