"""One live data_prep run per output part: a lock file in the output directory.

Two runs writing the same shards and manifest at once would leave a manifest saying ``complete``
over another run's ``.bin`` files. A run therefore takes a lock before it writes anything and
removes it when it ends, however it ends (a crash or ``kill -9`` leaves a stale lock, see below):

* ``<output>/.data_prep.lock``: a single run (``num_tasks=1``) and ``data_prep.merge``, which
  both write ``manifest.json``, ``data.yaml`` and ``conf/``;
* ``<output>/.data_prep.task-IIIII.lock``: array task ``I``, which writes only its own
  ``<name>_taskIIIII_*`` shards and ``manifest.task-IIIII-of-*.json``. Tasks of one array never
  wait for each other; two runs of the same task index (any ``num_tasks``: the shard names do not
  hold it) conflict, as they would write the same files.

A second run on a part held by a live run fails with :class:`OutputLockedError` (exit code 2)
naming the holder's host, pid and the lock file. The lock is safe on shared filesystems (NFS,
Lustre): it is created with ``O_CREAT | O_EXCL`` (no ``flock``), holding the holder's host, pid
and start time as JSON. A holder on this host whose pid is gone, a zombie, or a reused pid is
dead; an earlier incarnation of this Slurm job (same ``SLURM_JOB_ID``, lower
``SLURM_RESTART_COUNT``) is dead wherever it ran. A dead holder's lock is taken over: renamed
aside (only one of several contenders can rename it), checked to be the very file judged dead,
then a new lock is created with ``O_EXCL``. A holder on another host cannot be checked from here;
its lock is respected and the message says how to remove it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Optional, Tuple

from data_prep.errors import OutputLockedError
from launcher.core.locks import Holder, job_identity

LOCK_PREFIX = ".data_prep"
UNREADABLE_STALE_S = 60.0
"""A lock file without readable contents this old was left by a crash between its creation and
its first write (the write follows the creation at once)."""
ATTEMPTS = 5


def lock_name(num_tasks: int, task_index: int) -> str:
    """The lock file name of one output part (see the module docstring)."""
    return f"{LOCK_PREFIX}.lock" if num_tasks == 1 else f"{LOCK_PREFIX}.task-{task_index:05d}.lock"


def parse_holder(data: bytes) -> Optional[Holder]:
    """The holder written in a lock file's ``data``; None when it is not (yet) readable."""
    try:
        fields = json.loads(data.decode("utf-8"))
        return Holder(str(fields["host"]), int(fields["pid"]), float(fields.get("started", 0)),
                      str(fields.get("job", "")), int(fields.get("restart", 0)))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _read(path: str) -> Optional[Tuple[bytes, os.stat_result]]:
    """(contents, stat) of the lock file, or None when there is none."""
    try:
        with open(path, "rb") as handle:
            return handle.read(), os.fstat(handle.fileno())
    except FileNotFoundError:
        return None


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size) == (b.st_dev, b.st_ino, b.st_size)


class OutputLock:
    """The lock of one output part: :meth:`acquire`, then :meth:`release` (or ``with``)."""

    def __init__(self, out_dir: str, name: str) -> None:
        self.out_dir, self.path = out_dir, os.path.join(out_dir, name)
        self.mine: Optional[bytes] = None
        """What this run wrote into the lock file while it holds it."""
        self.taken_over = ""
        """Description of the stale lock this run took over, if any."""

    def acquire(self) -> str:
        """Take the lock; returns a description of the dead holder whose lock was taken over
        ("" if none). Raises OutputLockedError while a live or unverifiable run holds it.
        The output directory must exist."""
        for _ in range(ATTEMPTS):
            if self._create():
                return self.taken_over
            found = _read(self.path)
            if found is not None:
                self._judge(*found)  # raises unless the holder is dead
                self._set_aside(*found)
        raise OutputLockedError(f"{self.path}: several runs are taking this output at the same "
                                "moment; run only one of them")

    def _create(self) -> bool:
        job, restart = job_identity()
        data = (json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                            "job": job, "restart": restart}) + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:  # (disk full) leave no empty lock behind
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.mine = data
        return True

    def _judge(self, data: bytes, stat: os.stat_result) -> None:
        """Return when the lock's holder is dead (and note it); raise OutputLockedError otherwise."""
        holder = parse_holder(data)
        if holder is None:
            if time.time() - stat.st_mtime < UNREADABLE_STALE_S:
                raise OutputLockedError(f"output {self.out_dir} is being locked by another run "
                                        f"starting just now (lock file {self.path}); run only one")
            self.taken_over = f"an unreadable lock file {self.path} (a run crashed while creating it)"
            return
        alive = holder.alive()
        if alive is False:
            self.taken_over = f"{holder.describe()}, which is no longer running (lock file {self.path})"
            return
        where = "" if alive else ", on another host, so it cannot be checked from here"
        gone = "" if alive else f"; if that run is gone, delete {self.path}"
        raise OutputLockedError(f"output {self.out_dir} is being written by {holder.describe()}{where} "
                                f"(lock file {self.path}); wait for that run to end, stop it, or use "
                                f"another output={gone}")

    def _set_aside(self, data: bytes, stat: os.stat_result) -> None:
        """Remove the stale lock judged from (data, stat): rename it aside, an atomic step only one
        contender can make; a lock that turns out newer (another run took over first) is put back."""
        aside = f"{self.path}.stale.{socket.gethostname()}.{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another run set it aside first
        moved = _read(aside)
        if moved is not None and not (moved[0] == data and _same_file(moved[1], stat)):
            try:
                os.link(aside, self.path)  # never over a lock created since
            except FileExistsError:
                pass
        os.unlink(aside)

    def release(self) -> None:
        """Remove the lock file if it is still this run's."""
        if self.mine is None:
            return
        found = _read(self.path)
        if found is not None and found[0] == self.mine:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.mine = None

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
