"""Graceful stop for requeue: a signal sets a flag; all ranks agree to stop at one step boundary.

Slurm sends a configurable early-warning signal (``#SBATCH --signal=USR1@120``) before the time
limit and SIGTERM on preemption/cancel. The handlers only set a flag (nothing else is
async-signal-safe in the middle of a collective); the training loop asks
``stop.agree()`` at each step boundary. ``agree`` all-reduces the flag (MAX) over the default
group, so if any rank got the signal every rank sees True at the same step, saves a checkpoint and
exits with :data:`REQUEUE_EXIT_CODE`.

    stop = StopRequest(cfg.trainer.stop_signal)
    for step in ...:
        train_step()
        if stop.agree():
            save_checkpoint(); raise SystemExit(REQUEUE_EXIT_CODE)
    stop.restore()
"""

from __future__ import annotations

import signal
from typing import Any, Dict, Optional

REQUEUE_EXIT_CODE = 75
"""Exit code meaning "checkpoint saved, requeue me" (EX_TEMPFAIL of sysexits.h). The Slurm
wrapper requeues the job (``scontrol requeue``) when the training step exits with it."""


def _resolve_signal(name: str) -> signal.Signals:
    """``"SIGUSR1"``, ``"USR1"`` or ``"10"`` -> signal.SIGUSR1; clear error otherwise."""
    text = str(name).strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise ValueError(f"trainer.stop_signal={name!r} is not a signal name on this platform "
                         f"(e.g. SIGUSR1, SIGUSR2, SIGINT)") from None


class StopRequest:
    """Flag set by SIGTERM or ``signal_name``; installed on construction (main thread only)."""

    def __init__(self, signal_name: str = "SIGUSR1"):
        self._flag = False
        self._previous: Dict[signal.Signals, Any] = {}
        for sig in {signal.SIGTERM, _resolve_signal(signal_name)}:
            self._previous[sig] = signal.signal(sig, self._handle)
        self.signal_received: Optional[int] = None

    def _handle(self, signum: int, frame: Any) -> None:
        """Signal handler: record the request, nothing else."""
        self._flag = True
        self.signal_received = signum

    @property
    def requested(self) -> bool:
        """True once this process received one of the signals (no communication)."""
        return self._flag

    def agree(self, group: Any = None) -> bool:
        """True on every rank if any rank of ``group`` (default: the world) got a signal.

        A collective: every rank of the group must call it at the same step. Without an
        initialised process group it returns the local flag.
        """
        from launcher.runtime import collectives

        return collectives.any_rank(self._flag, group)

    def restore(self) -> None:
        """Put back the handlers that were installed before this object."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
