"""A training run's hold on its run directory: the lock, the metrics logger and its first events.

:func:`run_session` is entered by every rank of a training job at the same point (it is
collective): rank 0 takes the run directory's lock (:mod:`launcher.core.locks`), then every rank
gets the run's metrics logger (a no-op off rank 0), whose first events say what start-up found.
On the way out the metrics are closed and the lock released, however the run ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Iterator, Optional

from launcher.config import LoggerConfig, TrainwrightConfig
from launcher.core import locks
from launcher.core.checkpoints import Resume
from launcher.parallel import collectives
from launcher.plan import Plan
from launcher.runtime.console import Console
from launcher.runtime.metrics import Metrics, make_metrics_logger


@contextlib.contextmanager
def run_session(run_dir: Path, *, rank: int, console: Console, logger: LoggerConfig,
                config: dict, plan: Plan, notes: tuple[str, ...] = ()
                ) -> Iterator[Optional[Metrics]]:
    """The run's metrics logger, with the run directory locked (collective); None on every rank
    when a live run holds the directory (rank 0 has printed which)."""
    locked, stale = take_run_lock(run_dir, rank, console)
    if not locked:
        yield None
        return
    metrics = None
    try:
        metrics = make_metrics_logger(rank, run_dir=run_dir, logger=logger, config=config,
                                      plan=plan, run_name=run_dir.name, console=console.out)
        first_events(metrics, run_dir=run_dir, console=console, stale=stale, notes=notes)
        collectives.barrier()
        yield metrics
    finally:
        try:
            if metrics is not None:
                metrics.close()
        finally:
            locks.release(run_dir)


def take_run_lock(run_dir: Path, rank: int, console: Console
                  ) -> tuple[bool, Optional[locks.Holder]]:
    """Rank 0 locks the run directory (collective): (every rank may go on, the dead holder whose
    lock was taken over or None). A live holder is printed and every rank stops."""
    stale, refused = None, False
    if rank == 0:
        try:
            stale = locks.acquire(run_dir)
        except locks.RunLocked as exc:
            console.error(f"train: {exc}")
            refused = True
    return not collectives.any_rank(refused), stale


def first_events(metrics: Metrics, *, run_dir: Path, console: Console,
                 stale: Optional[locks.Holder], notes: tuple[str, ...]) -> None:
    """A stale lock taken over, where the library output goes, and the job's notes (a re-plan
    for the kernels this machine runs)."""
    if stale is not None:
        metrics.log_event("lock", f"took over the lock of pid {stale.pid} on {stale.host}, which "
                          "is no longer running")
    if console.log is not None:
        metrics.log_event("logs", f"library output of each rank: {run_dir / 'logs'}/rank_<r>.log "
                          "(run.verbose=true shows it here)")
    for note in notes:
        metrics.log_event("attention", note)


def run_dir_free(run_dir: Path, command: str = "train") -> bool:
    """Before spawning anything: False (and why, on stderr) when a live run holds the run
    directory (rank 0 takes the lock itself; this only fails early)."""
    import sys

    try:
        locks.check_free(run_dir)
    except locks.RunLocked as exc:
        print(f"{command}: {exc}", file=sys.stderr, flush=True)
        return False
    return True


def initial_weights(cfg: TrainwrightConfig, resume: Optional[Resume],
                    metrics: Metrics) -> TrainwrightConfig:
    """``cfg`` with ``trainer.init_from`` cleared when the run resumes from its own checkpoint
    (its trained weights win); the choice is logged."""
    if not cfg.trainer.init_from:
        return cfg
    if resume is not None:
        metrics.log_event("init_from", f"ignored trainer.init_from={cfg.trainer.init_from}: "
                          f"resuming from {resume.where}")
        return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, init_from=""))
    metrics.log_event("init_from", f"weights from {cfg.trainer.init_from} (optimizer fresh, "
                      "step 0)")
    return cfg
