"""Quiet by default: the console shows step lines, events and errors; libraries talk to a log.

Megatron-Core, DeepSpeed, torch, wandb and their C++ parts print banners, warnings and memory
reports on every rank ("Apex is not installed", "MA 0.48 GB ... CPU Virtual Memory", "Building a
BlendedDataset", op-build messages). In each training process :func:`route_output` points the
process's own stdout and stderr (file descriptors 1 and 2, so C++ output and DataLoader workers
follow) at ``<run_dir>/logs/rank_<r>.log`` and returns a :class:`Console` that still writes to
the terminal (or to Slurm's output file). The launcher's own lines go through that console:

* rank 0's step lines and events (:mod:`launcher.runtime.metrics`);
* every rank's errors, one line each (a crash's traceback goes to the rank log:
  :func:`report_crash`; when the log cannot be written, to a fallback: :class:`Console`).

The launcher process that spawns the ranks on one machine keeps its console for its own one-line
verdict ("rank 1 failed with exit code 1"); torch elastic's log records (its own tracebacks of
failed children, and torch.multiprocessing's "Terminating process ...") go to
``<run_dir>/logs/launcher.log`` (:func:`library_logs_to`).

``run.verbose=true`` leaves the streams alone: everything reaches the console as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, TextIO


@dataclass
class Console:
    """Where the launcher's own lines go: ``out`` (steps, events) and ``err`` (errors)."""

    out: TextIO
    err: TextIO
    log: Path | None = None
    """The rank's log file that receives everything else; None in verbose mode."""
    diverted: str = ""
    """Why the rank log could not be written ('' while it can): from then on the process's
    output goes to :attr:`fallback` (see :func:`divert_output`)."""
    fallback: Path | None = None
    """Where the output goes once the log could not be written (None: nowhere, /dev/null)."""

    def error(self, message: str) -> None:
        """An error line in the rank's log and on the console. It never raises: a log that
        cannot be written (a full disk) sends the rest of the rank's output elsewhere, and the
        console line says where."""
        if self.log is not None:
            self.to_log(message)
        print(message + self.diversion_note(), file=self.err, flush=True)

    def to_log(self, text: str) -> None:
        """``text`` into the rank's log (this process's stderr), else into the fallback."""
        try:
            print(text, file=sys.stderr, flush=True)
        except OSError as exc:
            self.divert(exc)
            with contextlib.suppress(OSError):
                print(text, file=sys.stderr, flush=True)

    def divert(self, exc: OSError) -> None:
        """The rank log failed with ``exc``: point fds 1 and 2 at the fallback (once)."""
        if self.log is None or self.diverted:
            return
        self.diverted = exc.strerror or str(exc)
        self.fallback = divert_output(self.log, self.diverted)

    def settle(self) -> None:
        """Flush this process's stdout and stderr before it exits, diverting them when the log
        cannot take what they hold: a flush that fails at interpreter exit would turn the
        rank's exit code into 1 (or 120), whatever the rank decided."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError as exc:
                self.divert(exc)
                with contextlib.suppress(OSError):
                    stream.flush()
            except ValueError:  # closed
                pass

    def diversion_note(self) -> str:
        """'' while the log is written; else where this rank's output went instead."""
        if not self.diverted:
            return ""
        where = f"its output goes to {self.fallback}" if self.fallback is not None \
            else "no other place could take its output"
        return f" [{self.log} cannot be written ({self.diverted}); {where}]"


FALLBACK_DIRS = ("TMPDIR", "/dev/shm", "/tmp")
"""Where a rank's output goes when its log cannot be written, first that fits: a directory on
another filesystem than the log's, with room (``$TMPDIR`` is read from the environment)."""
FALLBACK_MIN_FREE = 16 << 20
"""Bytes a fallback directory must have free."""


def fallback_dir(log: Path) -> Optional[Path]:
    """The first of :data:`FALLBACK_DIRS` that is writable, on another filesystem than
    ``log`` and has :data:`FALLBACK_MIN_FREE` bytes free; None if none."""
    try:
        log_dev = os.stat(log.parent).st_dev
    except OSError:
        log_dev = None
    for name in FALLBACK_DIRS:
        folder = os.environ.get(name, "") if name.isupper() else name
        try:
            usage = os.statvfs(folder) if folder else None
            if usage is None or os.stat(folder).st_dev == log_dev or \
                    not os.access(folder, os.W_OK):
                continue
        except OSError:
            continue
        if usage.f_bavail * usage.f_frsize >= FALLBACK_MIN_FREE:
            return Path(folder)
    return None


def divert_output(log: Path, why: str) -> Optional[Path]:
    """Point this process's fds 1 and 2 at ``trainwright-<run>-<log name>`` in the
    :func:`fallback_dir` (at /dev/null when there is none), so that the rest of its output,
    and what its streams still buffer, is written somewhere; the file, or None."""
    folder = fallback_dir(log)
    target = folder / f"trainwright-{log.parent.parent.name}-{log.name}" if folder else None
    try:
        fd = os.open(target if target else os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o644)
    except OSError:
        target, fd = None, os.open(os.devnull, os.O_WRONLY)
    if target is not None:
        os.write(fd, f"=== pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}: {log} cannot "
                     f"be written ({why}); the rest of this rank's output follows ===\n"
                 .encode())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return target


def rank_log_path(run_dir: Path, rank: int) -> Path:
    """``<run_dir>/logs/rank_<rank>.log``."""
    return run_dir / "logs" / f"rank_{rank}.log"


def route_output(run_dir: Path, rank: int, verbose: bool) -> Console:
    """Send this process's stdout/stderr (fds 1 and 2) to its rank log, unless ``verbose``;
    the returned console writes where they pointed before."""
    if verbose:
        return Console(sys.stdout, sys.stderr)
    log = rank_log_path(run_dir, rank)
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    err = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    console = Console(out, err, log)
    console.to_log(f"=== rank {rank}, pid {os.getpid()}, started "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S')} ===")
    return console


def report_crash(console: Console, rank: int, exc: BaseException, command: str) -> None:
    """An exception that ends a rank: one line on the console naming the rank, the cause and
    where the traceback is (the rank's log; the fallback when the log cannot be written, e.g.
    on a full disk). In verbose mode the log is the console: the traceback goes there."""
    text = "".join(traceback.format_exception(exc)).rstrip()
    if console.log is None:
        print(f"{command}: rank {rank} failed:\n{text}", file=console.err, flush=True)
        return
    console.to_log(text)
    where = f"traceback in {console.log}" if not console.diverted else \
        (f"traceback in {console.fallback}" if console.fallback else "no traceback kept")
    print(f"{command}: rank {rank} failed: {one_line(exc)} ({where}){console.diversion_note()}",
          file=console.err, flush=True)


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 400 characters)."""
    cause = (str(exc).strip().splitlines() or [""])[0][:400]
    return f"{type(exc).__name__}: {cause}"


class _QuietFileHandler(logging.FileHandler):
    """A log file that, when it cannot be written (a full disk), drops the record instead of
    printing a 'Logging error' traceback on the console."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


@contextlib.contextmanager
def library_logs_to(path: Optional[Path], names: tuple = ("torch.distributed.elastic",
                                                          "torch.multiprocessing")
                    ) -> Iterator[None]:
    """While inside: the log records of the ``names`` loggers go to ``path`` only (None: leave
    them alone)."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _QuietFileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in names]
    saved = [(lg.handlers[:], lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.handlers, lg.propagate = [handler], False
    try:
        yield
    finally:
        for lg, (handlers, propagate) in zip(loggers, saved):
            lg.handlers, lg.propagate = handlers, propagate
        try:
            handler.close()
        except OSError:  # a full disk: the log's last lines are lost, the exit code is not
            pass
