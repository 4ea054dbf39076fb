"""The stop contract: a stop signal sets a flag; all ranks agree to stop at one step boundary.

Stop signals are SIGTERM (preemption, ``scancel``, Kubernetes), SIGINT (Ctrl-C), SIGUSR2
(submitit's time-limit warning) and ``trainer.stop_signal`` (Slurm's early warning,
``#SBATCH --signal=USR1@120``). They arrive in three ways, and each ends the same way (every rank
saves the same step, the job exits :data:`~launcher.core.exits.REQUEUE_EXIT`):

* to one rank: :class:`StopRequest` in that rank sets its flag, the others learn it at the next
  agreement;
* to the launcher only (``kill <pid>``, ``scancel --signal``): the launcher process
  (``launcher.train`` on one machine, ``launcher.launch.agent`` per node) forwards it to its ranks
  (:meth:`StartupStop.forward_to`) and waits for their exit code;
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

Start-up (docs/training.md, "A stop during start-up") has nothing to save and no step boundary
to wait for: :func:`stop_from_first_line` and :class:`StartupStop` end a process at once, from
the command's first line until its ranks run (a launcher then forwards, a rank hands over to the
step contract above); :func:`hold_stop_signals` keeps a signal pending across an ``exec``.
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


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that started it ends (its parent's
    main thread: a rank's launcher or fork server, a rank for its helper processes)
    (``prctl(PR_SET_PDEATHSIG)``); nothing elsewhere."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def rank_helper(stop_signal: str = "SIGUSR1", *_: Any) -> None:
    """Start of a helper process forked by a rank that must outlive no rank and no stop: it
    ignores stop signals (:func:`ignore_stop_signals`) and dies with the rank
    (:func:`die_with_parent`; a fork holds the rank's sockets open, so a rank killed with -9
    would otherwise look alive to its peers for as long as the helper ran)."""
    ignore_stop_signals(stop_signal)
    die_with_parent()


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
    """Pids of the processes that run this launcher's ranks: its children, not multiprocessing's
    helper processes, and the children of its fork server (each a rank forked from it,
    :mod:`launcher.launch.rank_preload`): what a launcher forwards stop signals to."""
    out = []
    for child in psutil.Process().children():
        try:
            cmdline = " ".join(child.cmdline())
            if "forkserver" in cmdline:
                out.extend(rank.pid for rank in child.children())
            elif "resource_tracker" not in cmdline:
                out.append(child.pid)
        except psutil.Error:
            continue
    return out


class StopRequest:
    """Flag set by any stop signal (:func:`stop_signals`); installed on construction (main thread
    only). ``any_rank(flag)`` is the collective that tells whether any rank's flag is set (the
    default, for a single process: the local flag)."""

    def __init__(self, signal_name: str = "SIGUSR1",
                 any_rank: Optional[Callable[[bool], bool]] = None):
        self._any_rank = any_rank or bool
        self._flag = False
        self.signal_received: Optional[int] = None
        self.decided = False  # the ranks agreed to stop: stop signals are ignored from then on
        self._previous: Dict[signal.Signals, Any] = {}
        self.watch_also(signal_name)

    def watch_also(self, signal_name: str) -> None:
        """Count ``signal_name`` (e.g. the configured ``trainer.stop_signal``) as a stop too.
        Stop signals held until now (:func:`hold_stop_signals`: by the launcher that spawned
        this process, or an agent that exec'd it) are delivered here, to these handlers."""
        for sig in stop_signals(signal_name):
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(self._previous))

    def agree_through(self, any_rank: Callable[[bool], bool]) -> None:
        """From now on :meth:`agree` asks every rank through ``any_rank`` (a request created
        before the process group existed, at the command's first line)."""
        self._any_rank = any_rank

    def _handle(self, signum: int, frame: Any) -> None:
        """Signal handler: record the request, nothing else."""
        if self.signal_received is None:
            self.signal_received = signum
        self._flag = True

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
    """While a process starts up (imports, compose and plan, process groups, the build, the
    data, the load), a stop signal ends it within a fraction of a second, whatever the main thread
    is doing: there is nothing to save yet (the checkpoint on disk is what a requeue resumes
    from), and a process blocked in a C call (a JIT build's file lock, a rendezvous) would never
    reach a step boundary to agree on stopping.

    Python runs signal handlers only in the main thread, between bytecodes, so the
    :class:`StopRequest` flag alone cannot help a blocked process. Here the C-level handler also
    writes the signal number into a pipe (``signal.set_wakeup_fd``); a daemon thread reading it
    calls ``on_stop(signum)`` (which says so on the console) and ends the process with
    ``os._exit(code)``. The thread takes the stop signals for itself (unblocked), so they are
    delivered even while the main thread holds them (:func:`hold_stop_signals`).

    Two ways out of start-up:

    * :meth:`finish` (a rank's first step is about to run) hands stops back to the step-boundary
      contract of its :class:`StopRequest`;
    * :meth:`forward_to` (this process is a launcher about to start its ranks): from then on a
      stop is recorded (:attr:`received`) and sent on to the ranks instead of ending this
      process, and :meth:`forward_late` sends it to ranks started after it arrived.

    Create it in the main thread, after the StopRequest whose handlers feed it (``request``: a
    stop that reached that request before this object existed ends the process here and now)."""

    def __init__(self, stop_signal: str, code: Optional[int],
                 on_stop: Optional[Callable[[int], None]] = None,
                 request: Optional[StopRequest] = None):
        import threading

        self._sigs = {int(s) for s in stop_signals(stop_signal)}
        self._code, self.on_stop, self.active = code, on_stop, True
        self.received: Optional[int] = None
        """The first stop signal this process received while this object was active."""
        self._targets: Optional[Callable[[], Iterable[int]]] = None
        self._sent: set = set()
        self._lock = threading.Lock()
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._write = write
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="startup-stop", daemon=True).start()
        if request is not None and request.signal_received is not None:
            self._stop(int(request.signal_received))

    def watch_also(self, stop_signal: str) -> None:
        """Count ``stop_signal`` (the configured ``trainer.stop_signal``) as a stop too."""
        self._sigs |= {int(s) for s in stop_signals(stop_signal)}

    def _watch(self) -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self._sigs)  # the delivery thread
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data or not self.active:
                os.close(self._read)
                return
            for signum in (b for b in data if b in self._sigs):
                self._stop(signum)

    def _stop(self, signum: int) -> None:
        with self._lock:
            if self.received is None:
                self.received = signum
            forwarding = self._targets is not None
        if forwarding:
            self._send(signum, every=True)
            return
        if self._code is None:  # recording only
            return
        try:
            if self.on_stop is not None:
                self.on_stop(signum)
        finally:
            os._exit(self._code)

    def forward_to(self, targets: Callable[[], Iterable[int]]) -> None:
        """This process now starts ranks (``targets()``: their pids): a stop signal is recorded
        and sent on to them, no longer the end of this process."""
        with self._lock:
            self._targets = targets

    def record_only(self) -> None:
        """The ranks have ended: a stop signal is recorded, nothing more (the launcher is
        writing the run's end)."""
        with self._lock:
            self._targets, self._code = None, None

    def forward_late(self) -> None:
        """Send the stop signal received so far to every rank that has not had it (ranks
        started after it arrived)."""
        if self.received is not None and self._targets is not None:
            self._send(self.received, every=False)

    def _send(self, signum: int, every: bool) -> None:
        try:  # a failure here must not end the watcher thread, nor the launcher
            pids = list(self._targets() if self._targets is not None else ())
        except Exception as exc:
            os.write(2, f"launcher: could not forward signal {signum} to the ranks: "
                        f"{exc}\n".encode())
            return
        with self._lock:
            pids = [p for p in pids if every or p not in self._sent]
            self._sent.update(pids)
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def finish(self) -> None:
        """Start-up is over: stops wait for the next step boundary again (main thread)."""
        if not self.active:
            return
        self.active = False
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write)  # the thread's read returns empty and it ends
        if _this_process is not None and _this_process[1] is self:
            _forget_this_process()


def hold_stop_signals(stop_signal: str = "SIGUSR1") -> None:
    """Hold (block) every stop signal in the calling thread: one that arrives waits, pending,
    until a handler is in place (:func:`release_stop_signals`). Processes this thread starts
    (fork, then exec) start with them held too, which is how a rank or an exec'd launcher
    never meets a stop signal before its own handler: the kernel keeps it for them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals(stop_signal))


def release_stop_signals(stop_signal: str = "SIGUSR1") -> None:
    """Deliver the stop signals held in the calling thread (:func:`hold_stop_signals`); call it
    once their handlers are installed."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals(stop_signal))


def start_resource_tracker_deaf_to_stops(stop_signal: str = "SIGUSR1") -> None:
    """Start multiprocessing's resource tracker (the helper process that every spawned child of
    this process shares) so that no stop signal can end it. It ignores SIGINT and SIGTERM by
    itself, but SIGUSR1 or SIGUSR2 sent to the process group killed it: "resource_tracker:
    process died unexpectedly, relaunching" and a traceback per shared-memory block on the
    console. Started while the stop signals are held here, it inherits them held, and it
    releases only the two it ignores; this process's watcher thread takes the signals
    meanwhile. Already running: nothing to do."""
    from multiprocessing import resource_tracker

    hold_stop_signals(stop_signal)
    try:
        resource_tracker.ensure_running()
    finally:
        release_stop_signals(stop_signal)


_this_process: Optional[tuple] = None
"""(StopRequest, StartupStop) installed by :func:`stop_from_first_line`, until start-up ends."""


def _forget_this_process() -> None:
    global _this_process
    _this_process = None


LAUNCHER_PID_ENV = "TRAINWRIGHT_LAUNCHER_PID"
"""Set by a launcher for the ranks it spawns: its pid. A process whose parent has that pid is one
of its ranks (not a helper process a rank started)."""


def stop_from_first_line(code: int, command: str, main: str, announce: bool = True) -> None:
    """At a command's first line, before anything slow, with ``main`` its module's
    ``__name__``: from here to the process's exit a stop signal is never lost. Until the process
    starts ranks or becomes one (:func:`this_process_stop`), a stop ends it at once with
    ``code`` and one line on stderr (``announce``: this process speaks for the job); stop
    signals held by whatever started it (an agent that exec'd it: :func:`hold_stop_signals`)
    are delivered now, and end it the same way.

    ``main == "__main__"``: the command itself. ``main == "__mp_main__"``: multiprocessing's
    spawn re-imports the command's module in each child before anything else of it; in a rank
    its launcher spawned (:data:`LAUNCHER_PID_ENV`) this installs the same, silently (the
    launcher speaks for the job); in any other child it does nothing.

    Before this line only the interpreter's own start is exposed: a stop signal there takes its
    default action (docs/launching.md says what a scheduler sees then)."""
    global _forked_first_line
    if main == "__mp_main__":
        if os.environ.get(LAUNCHER_PID_ENV) != str(os.getppid()):
            _forked_first_line = (code, command)  # a fork server's child: see below
            return
        announce = False
    elif main != "__main__":
        return
    _install_first_line(code, command, announce)


def first_line_of_forked_rank() -> None:
    """In a rank forked from its launcher's fork server (:mod:`launcher.launch.rank_preload`),
    once it has its launcher's environment and before it takes its launcher's signal mask (the
    stop signals are held until then): what :func:`stop_from_first_line` installs in a spawned
    rank, silently. Its main module's first line ran under the server as parent, so it could not
    tell a rank from a helper process; the launcher's entry of a rank calls this. Nothing when
    the main module has no such line or this process already has one installed."""
    global _forked_first_line
    if _forked_first_line is not None and _this_process is None:
        _install_first_line(*_forked_first_line, announce=False)
    _forked_first_line = None


_forked_first_line: Optional[tuple] = None
"""(code, command) of a main module's first line met in a fork server's child
(:func:`first_line_of_forked_rank`)."""


def _install_first_line(code: int, command: str, announce: bool) -> None:
    global _this_process
    request = StopRequest()

    def say(signum: int) -> None:
        if announce:
            os.write(2, (f"{command}: stopped by {signal.Signals(signum).name} during start-up "
                         f"(nothing to save: the run resumes from its latest checkpoint); "
                         f"exiting {code}\n").encode())

    startup = StartupStop("SIGUSR1", code, on_stop=say, request=request)
    _this_process = (request, startup)


def this_process_stop() -> Optional[tuple]:
    """``(StopRequest, StartupStop)`` of :func:`stop_from_first_line` while its start-up runs
    (a rank or a launcher adopts them), else None."""
    return _this_process
