"""One live run per run directory: ``<run_dir>/run.lock``.

Two ``launcher.train`` with the same ``run.name`` at once would write the same checkpoints and
metrics (one ends with a checkpoint whose files are the other's, metrics logged twice). Rank 0
takes the lock before anything is written and removes it when the run ends, however it ends;
a second launch of a live run exits 2 naming the holder's host and pid.

The lock is a file created with ``O_CREAT | O_EXCL`` (atomic on local disks and NFS), holding the
holder's host, pid and start time as JSON. A lock left by a dead process (same host, pid gone:
``kill -9``, a node that rebooted into the same name) is taken over, and the run says so. A lock
held from another host cannot be checked from here; it is respected, and the message says how to
remove it if that run is known to be gone. Except for a restarted job: a lock records the
scheduler's job id and restart count (:func:`job_identity`), and a later incarnation of the same
job (a higher count, on whichever node) takes over what its killed predecessor left. Slurm gives
``SLURM_JOB_ID`` and ``SLURM_RESTART_COUNT``; a Kubernetes JobSet (or TrainJob) pod gets
``TRAINWRIGHT_JOB_ID`` and ``TRAINWRIGHT_JOB_ATTEMPT`` from its JobSet's uid and restart-attempt
labels (the pod's host name, and which pod holds rank 0, change between attempts).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

LOCK_NAME = "run.lock"


class RunLocked(RuntimeError):
    """The run directory is in use by a live process; the message names it and the fix."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock (a run directory's, or a data_prep output's: data_prep.output_lock)."""

    host: str
    pid: int
    started: float
    job: str = ""  # SLURM_JOB_ID of the holder ("" outside Slurm)
    restart: int = 0  # its SLURM_RESTART_COUNT
    role: str = ""  # "" = a run; MERGE_ROLE = an eval job merging its scores (seconds)

    def alive(self) -> Optional[bool]:
        """True/False for a holder on this host or an earlier incarnation of this Slurm job;
        None when it is on another host."""
        job, restart = job_identity()
        if job and self.job == job and self.restart < restart:
            return False  # this job was restarted: the holder was its killed predecessor
        if self.host != socket.gethostname():
            return None
        import psutil

        try:
            process = psutil.Process(self.pid)
            if process.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped
                return False
            return not (self.started and process.create_time() > self.started + 1)  # pid reused
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True

    def describe(self) -> str:
        """``pid N on host (started <local time>)``."""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host} (started {since})"


JOB_ID_ENV = "TRAINWRIGHT_JOB_ID"
JOB_ATTEMPT_ENV = "TRAINWRIGHT_JOB_ATTEMPT"
"""Set in Kubernetes pods by the rendered manifests (launcher.launch.kubernetes.pod)."""


def job_identity() -> tuple:
    """(job id or "", restart count) of this process: Slurm's SLURM_JOB_ID and
    SLURM_RESTART_COUNT, else TRAINWRIGHT_JOB_ID and TRAINWRIGHT_JOB_ATTEMPT."""
    if os.environ.get("SLURM_JOB_ID"):
        return os.environ["SLURM_JOB_ID"], int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    attempt = os.environ.get(JOB_ATTEMPT_ENV, "")
    return os.environ.get(JOB_ID_ENV, ""), int(attempt) if attempt.isdigit() else 0


def holder(run_dir: Path) -> Optional[Holder]:
    """The current holder of ``run_dir``'s lock, or None (no lock, or an unreadable one)."""
    try:
        data = json.loads((Path(run_dir) / LOCK_NAME).read_text())
        return Holder(str(data["host"]), int(data["pid"]), float(data.get("started", 0)),
                      str(data.get("job", "")), int(data.get("restart", 0)),
                      str(data.get("role", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


MERGE_ROLE = "eval merge"
"""The role of an eval job that holds a finished run's lock to merge its scores
(launcher.evaluate): a launch waits up to :data:`MERGE_WAIT_S` for it instead of refusing."""
MERGE_WAIT_S = 120.0


def _wait_for_merge(run_dir: Path, current: Holder) -> Optional[Holder]:
    """The holder once an eval job's merge is over (None: the lock is gone)."""
    deadline = time.monotonic() + MERGE_WAIT_S
    while current is not None and current.role == MERGE_ROLE and current.alive() \
            and time.monotonic() < deadline:
        time.sleep(0.2)
        current = holder(run_dir)
    return current


def check_free(run_dir: Path) -> Optional[Holder]:
    """Raise :class:`RunLocked` when a live (or unverifiable) process holds ``run_dir``; return
    a dead holder (a stale lock that :func:`acquire` will take over), else None. An eval job
    merging its scores is waited for (:data:`MERGE_ROLE`)."""
    current = _wait_for_merge(run_dir, holder(run_dir))
    if current is None:
        return None
    alive = current.alive()
    if alive is False:
        return current
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(current.started))
    where = "on this host" if alive else "on another host, so it cannot be checked from here"
    raise RunLocked(
        f"run directory {run_dir} is in use by pid {current.pid} on {current.host} (since "
        f"{since}, {where}); wait for that run to end, stop it, or use another run.name"
        + ("" if alive else f"; if it is gone, delete {Path(run_dir) / LOCK_NAME}"))


def acquire(run_dir: Path, role: str = "") -> Optional[Holder]:
    """Take ``run_dir``'s lock for this process (``role``: "" for a run, :data:`MERGE_ROLE`);
    returns the dead holder taken over, if any. Raises :class:`RunLocked` when a live process
    holds it."""
    path = Path(run_dir) / LOCK_NAME
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    stale = check_free(run_dir)
    if stale is not None:
        path.unlink(missing_ok=True)
    job, restart = job_identity()
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
            "job": job, "restart": restart, **({"role": role} if role else {})}
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:  # another launch won the race between the check and the create
        check_free(run_dir)
        raise RunLocked(f"run directory {run_dir} was locked by another launch just now; "
                        "use another run.name") from None
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(mine) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return stale


def release(run_dir: Path) -> None:
    """Remove ``run_dir``'s lock if this process holds it."""
    current = holder(run_dir)
    if current is not None and current.pid == os.getpid() \
            and current.host == socket.gethostname():
        (Path(run_dir) / LOCK_NAME).unlink(missing_ok=True)
