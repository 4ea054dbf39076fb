"""Per-phase wall-clock timing of the training step.

    timer = PhaseTimer(sync=torch.cuda.synchronize if torch.cuda.is_available() else None)
    with timer.phase("forward"):
        loss = model(batch)
    ...
    metrics.update({f"time/{k}": v for k, v in timer.snapshot().items()})

Every phase of :data:`PHASES` is always present in a snapshot (0.0 when unused), so metric keys
stay stable from step to step.

**Fused phases.** Some engines cannot separate two phases: DeepSpeed's ``engine.backward`` reduces
gradients while it runs backward, so "backward" and "grad_sync" are one measurement. Such an
engine times the combined work under ``backward`` and calls
``timer.rename("backward", "backward+grad_sync")`` once; snapshots then report that time under the
key ``backward+grad_sync`` instead of ``backward``, and ``grad_sync`` keeps reporting 0.0 (or
whatever was timed under it separately). A reader therefore never mistakes a fused time for a pure
backward time.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterator, Optional

PHASES = ("data", "forward", "loss", "backward", "grad_sync", "optimizer", "checkpoint")
"""Phases of one optimizer step, in order (each is a ``time/<phase>`` metric)."""


class PhaseTimer:
    """Accumulates seconds per phase between snapshots.

    ``sync`` (e.g. ``torch.cuda.synchronize``) is called before each clock reading, so
    asynchronous device work is charged to the phase that launched it. Phases not in
    :data:`PHASES` may be used too; they appear in snapshots once used. ``on_phase(name)`` is
    called as each phase begins (the rank's heartbeat: launcher.runtime.heartbeat).
    """

    def __init__(self, sync: Optional[Callable[[], None]] = None,
                 on_phase: Optional[Callable[[str], None]] = None):
        self._sync = sync
        self._on_phase = on_phase
        self._totals: Dict[str, float] = {name: 0.0 for name in PHASES}
        self._names: Dict[str, str] = {}

    def _now(self) -> float:
        """Monotonic seconds after waiting for outstanding device work."""
        if self._sync is not None:
            self._sync()
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block and add it to phase ``name`` (also when the block raises)."""
        if self._on_phase is not None:
            self._on_phase(name)
        start = self._now()
        try:
            yield
        finally:
            self.add(name, self._now() - start)

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` measured elsewhere to phase ``name``."""
        if seconds < 0:
            raise ValueError(f"phase {name!r}: negative duration {seconds}")
        self._totals[name] = self._totals.get(name, 0.0) + float(seconds)

    def rename(self, name: str, metric_name: str) -> None:
        """Report phase ``name`` as ``metric_name`` in snapshots (for fused phases, see module)."""
        self._names[name] = metric_name

    def snapshot(self, reset: bool = True) -> Dict[str, float]:
        """Seconds per phase since the last reset, keyed by reported name (every phase present).

        With ``reset`` (the default) the totals restart from zero.
        """
        out = {self._names.get(name, name): total for name, total in self._totals.items()}
        if reset:
            self._totals = {name: 0.0 for name in self._totals}
        return out

    def total(self) -> float:
        """Seconds summed over every phase since the last reset."""
        return sum(self._totals.values())
