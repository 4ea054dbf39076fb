"""Where a run's time goes: the wall time of its phases and the CPU time of each kind of process.

This is what tells, on a machine of many cores, what a run waits for: a main process whose CPU
time during tokenizing approaches the phase's wall time is the limit (it should use a few
hundredths of a second per 500 MB: it moves no bulk data); a long wait for the hashes means the
sha256 of the inputs is; otherwise the workers are. Children's CPU time is read from
``RUSAGE_CHILDREN``, which counts a child once it has been reaped: the hashers are reaped when
their digests arrive, the workers when the pool closes, so each difference belongs to one kind.
"""

from __future__ import annotations

import resource
import time
from contextlib import contextmanager
from typing import Dict, Iterator


def children_cpu_seconds() -> float:
    """User + system CPU time of this process's reaped children (seconds)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class RunTiming:
    """Created when the run starts (after imports and the config); :meth:`phase` times a phase,
    :meth:`hashers_reaped` and :meth:`workers_reaped` attribute the children's CPU time."""

    def __init__(self) -> None:
        self.startup_cpu_s = time.process_time()
        """CPU time of the main process before the run: interpreter, imports, config."""
        self.wall_s: Dict[str, float] = {}
        self.main_cpu_s: Dict[str, float] = {}
        self._children = children_cpu_seconds()
        self.hash_cpu_s = 0.0
        self.worker_cpu_s = 0.0
        self.hash_processes = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall_s[name] = self.wall_s.get(name, 0.0) + time.perf_counter() - wall
            self.main_cpu_s[name] = self.main_cpu_s.get(name, 0.0) + time.process_time() - cpu

    def _reaped_since(self) -> float:
        now = children_cpu_seconds()
        spent, self._children = now - self._children, now
        return spent

    def hashers_reaped(self, processes: int) -> None:
        self.hash_processes = processes
        self.hash_cpu_s += self._reaped_since()

    def workers_reaped(self) -> None:
        self.worker_cpu_s += self._reaped_since()

    def to_dict(self) -> dict:
        """The manifest's ``timing``: seconds, rounded to milliseconds."""
        def ms(value: float) -> float:
            return round(value, 3)

        return {"startup_cpu_s": ms(self.startup_cpu_s),
                **{f"{name}_s": ms(value) for name, value in self.wall_s.items()},
                **{f"main_{name}_cpu_s": ms(value) for name, value in self.main_cpu_s.items()},
                "worker_cpu_s": ms(self.worker_cpu_s), "hash_cpu_s": ms(self.hash_cpu_s),
                "hash_processes": self.hash_processes}
