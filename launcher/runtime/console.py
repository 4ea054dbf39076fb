"""Quiet by default: the console shows step lines, events and errors; libraries talk to a log.

Megatron-Core, DeepSpeed, torch, wandb and their C++ parts print banners, warnings and memory
reports on every rank ("Apex is not installed", "MA 0.48 GB ... CPU Virtual Memory", "Building a
BlendedDataset", op-build messages). In each training process :func:`route_output` points the
process's own stdout and stderr (file descriptors 1 and 2, so C++ output and DataLoader workers
follow) at ``<run_dir>/logs/rank_<r>.log`` and returns a :class:`Console` that still writes to
the terminal (or to Slurm's output file). The launcher's own lines go through that console:

* rank 0's step lines and events (:mod:`launcher.runtime.metrics`);
* every rank's errors, and the traceback of any rank that crashes (:func:`report_crash`).

The launcher process that spawns the ranks on one machine keeps its console for its own one-line
verdict ("rank 1 failed with exit code 1"); torch elastic's log records (its own tracebacks of
failed children) go to ``<run_dir>/logs/launcher.log`` (:func:`library_logs_to`).

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


@dataclass(frozen=True)
class Console:
    """Where the launcher's own lines go: ``out`` (steps, events) and ``err`` (errors)."""

    out: TextIO
    err: TextIO
    log: Path | None = None
    """The rank's log file that receives everything else; None in verbose mode."""

    def error(self, message: str) -> None:
        """An error line on the console, and in the rank's log."""
        print(message, file=self.err, flush=True)
        if self.log is not None:
            print(message, file=sys.stderr, flush=True)


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
    print(f"=== rank {rank}, pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')} ===",
          flush=True)
    return Console(out, err, log)


def report_crash(console: Console, rank: int, exc: BaseException, command: str) -> None:
    """An exception that ends a rank: one line on the console naming the rank and the cause,
    the traceback in the rank's log (on the console only when the log cannot take it, e.g. on
    a full disk, or in verbose mode, where the log is the console)."""
    text = "".join(traceback.format_exception(exc)).rstrip()
    if console.log is None:
        print(f"{command}: rank {rank} failed:\n{text}", file=console.err, flush=True)
        return
    try:
        print(text, file=sys.stderr, flush=True)
        where = f"traceback in {console.log}"
    except OSError as log_error:
        print(text, file=console.err, flush=True)
        where = f"traceback above: the rank log cannot be written ({log_error.strerror})"
    cause = (str(exc).strip().splitlines() or [""])[0][:400]
    print(f"{command}: rank {rank} failed: {type(exc).__name__}: {cause} ({where})",
          file=console.err, flush=True)


class _QuietFileHandler(logging.FileHandler):
    """A log file that, when it cannot be written (a full disk), drops the record instead of
    printing a 'Logging error' traceback on the console."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


@contextlib.contextmanager
def library_logs_to(path: Optional[Path], names: tuple = ("torch.distributed.elastic",)
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
