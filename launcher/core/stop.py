"""The stop contract: a stop signal sets a flag; all ranks agree to stop at one step boundary.

Stop signals are SIGTERM (preemption, ``scancel``, Kubernetes), SIGINT (Ctrl-C), SIGUSR2
(submitit's time-limit warning) and ``trainer.stop_signal`` (Slurm's early warning,
``#SBATCH --signal=USR1@120``). They arrive in three ways, and each ends the same way (every rank
saves the same step, the job exits :data:`~launcher.core.exits.REQUEUE_EXIT`):

* to one rank: :class:`StopRequest` in that rank sets its flag, the others learn it at the next
  agreement;
* to the launcher only (``kill <pid>``, ``scancel --signal``): the launcher process
  (``launcher.train`` on one machine, ``launcher.launch.agent`` per node) forwards it to its ranks
  (:func:`forward_stop_signals`) and waits for their exit code;
* to the whole process group (Slurm's cgroup tracking, time limits, a terminal's Ctrl-C): every
  rank gets it; DataLoader worker processes ignore stop signals (:func:`ignore_stop_signals`, their
  ``worker_init_fn``) so they do not die mid-batch, and the launcher's forwarded copy only sets a
  flag that is already set. The handlers only set a flag (nothing else is
async-signal-safe in the middle of a collective); the training loop asks
``stop.agree()`` at each step boundary. ``agree`` reduces the flag over the ranks (the
``any_rank`` collective it is given, :func:`launcher.parallel.collectives.any_rank`), so if any
rank got the signal every rank sees True at the same step, saves a checkpoint and exits with
:data:`~launcher.core.exits.REQUEUE_EXIT`.

    stop = StopRequest(cfg.trainer.stop_signal, any_rank=collectives.any_rank)
    for step in ...:
        train_step()
        if stop.agree():
            save_checkpoint(); raise SystemExit(REQUEUE_EXIT)
    stop.restore()
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable, Dict, Iterable, Optional

# Imported here, never inside a handler: a second signal arriving during the import would run
# the handler again on a half-initialised module (a launcher gets a stop twice under Slurm:
# from Slurm itself and forwarded by its parent).
import psutil


def resolve_signal(name: str) -> signal.Signals:
    """``"SIGUSR1"``, ``"USR1"`` or ``"10"`` -> signal.SIGUSR1; clear error otherwise."""
    text = str(name).strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise ValueError(f"trainer.stop_signal={name!r} is not a signal name on this platform "
                         f"(e.g. SIGUSR1, SIGUSR2, SIGINT)") from None


ALWAYS_STOP = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
"""Stop signals whatever trainer.stop_signal says (preemption, Ctrl-C, submitit's warning)."""


def stop_signals(stop_signal: str = "SIGUSR1") -> tuple:
    """Every stop signal: :data:`ALWAYS_STOP` and ``trainer.stop_signal``."""
    extra = resolve_signal(stop_signal)
    return ALWAYS_STOP + (() if extra in ALWAYS_STOP else (extra,))


def ignore_stop_signals(stop_signal: str = "SIGUSR1", *_: Any) -> None:
    """Ignore every stop signal in this process: a helper process of a rank (a DataLoader
    worker, Megatron-Core's save-results server) that its rank saves and stops. Usable as
    ``worker_init_fn`` through functools.partial (extra arguments ignored)."""
    for sig in stop_signals(stop_signal):
        signal.signal(sig, signal.SIG_IGN)


def elastic_signals(stop_signal: str = "SIGUSR1") -> str:
    """torch elastic's ``LaunchConfig.signals_to_handle`` (signals its agent turns into "kill
    the workers"): the terminating signals that are not stop signals, so that a stop signal
    reaches the workers as a stop (see :func:`forward_stop_signals`)."""
    sigs = stop_signals(stop_signal)
    return ",".join(name for name in ("SIGHUP", "SIGQUIT") if getattr(signal, name) not in sigs)


def forward_stop_signals(stop_signal: str, targets: Callable[[], Iterable[int]]) -> dict:
    """In a launcher process: on a stop signal, send it on to every pid of ``targets()`` (its
    ranks) instead of dying (the elastic agent must leave these signals alone:
    :func:`elastic_signals`). Returns the previous handlers (for :func:`restore_handlers`)."""
    sigs = stop_signals(stop_signal)

    def forward(signum: int, frame: Any) -> None:
        try:  # a handler that raised would unwind the launcher from wherever it was interrupted
            pids = list(targets())
        except Exception as exc:
            print(f"launcher: could not forward signal {signum} to the ranks: {exc}",
                  file=sys.stderr, flush=True)
            return
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    return {sig: signal.signal(sig, forward) for sig in sigs}


def restore_handlers(previous: dict) -> None:
    """Put back handlers saved by :func:`forward_stop_signals`."""
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def child_ranks() -> list:
    """Pids of this process's children that run training ranks (not multiprocessing's helper
    processes): what a launcher forwards stop signals to."""
    out = []
    for child in psutil.Process().children():
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" not in cmdline and "forkserver" not in cmdline:
            out.append(child.pid)
    return out


class StopRequest:
    """Flag set by any stop signal (:func:`stop_signals`); installed on construction (main thread
    only). ``any_rank(flag)`` is the collective that tells whether any rank's flag is set (the
    default, for a single process: the local flag)."""

    def __init__(self, signal_name: str = "SIGUSR1",
                 any_rank: Optional[Callable[[bool], bool]] = None):
        self._any_rank = any_rank or bool
        self._flag = False
        self.decided = False  # the ranks agreed to stop: stop signals are ignored from then on
        self._previous: Dict[signal.Signals, Any] = {}
        for sig in stop_signals(signal_name):
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

    def agree(self) -> bool:
        """True on every rank if any rank got a signal. A collective: every rank must call it
        at the same step."""
        self.decided = self._any_rank(self._flag)
        if self.decided:  # later copies (a launcher's forwarded one) must not kill the rank
            for sig in self._previous:
                signal.signal(sig, signal.SIG_IGN)
        return self.decided

    def restore(self) -> None:
        """Put back the handlers that were installed before this object."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()


class StartupStop:
    """While a rank starts up (imports, process groups, the build, the data, the load), a stop
    signal ends it within a fraction of a second, whatever the main thread is doing: there is
    nothing to save yet (the checkpoint on disk is what a requeue resumes from), and a rank
    blocked in a C call (a JIT build's file lock, a rendezvous) would never reach a step boundary
    to agree on stopping.

    Python runs signal handlers only in the main thread, between bytecodes, so the
    :class:`StopRequest` flag alone cannot help a blocked rank. Here the C-level handler also
    writes the signal number into a pipe (``signal.set_wakeup_fd``); a daemon thread reading it
    calls ``on_stop(signum)`` (which says so on the console) and ends the process with
    ``os._exit(code)``. :meth:`finish` (the loop's first step is about to run) hands stops back to
    the step-boundary contract. Create it in the main thread, after the StopRequest."""

    def __init__(self, stop_signal: str, code: int,
                 on_stop: Optional[Callable[[int], None]] = None):
        import threading

        self._sigs = {int(s) for s in stop_signals(stop_signal)}
        self._code, self._on_stop, self.active = code, on_stop, True
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._write = write
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="startup-stop", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data or not self.active:
                os.close(self._read)
                return
            signum = next((b for b in data if b in self._sigs), None)
            if signum is None:
                continue
            try:
                if self._on_stop is not None:
                    self._on_stop(signum)
            finally:
                os._exit(self._code)

    def finish(self) -> None:
        """Start-up is over: stops wait for the next step boundary again (main thread)."""
        if not self.active:
            return
        self.active = False
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write)  # the thread's read returns empty and it ends
