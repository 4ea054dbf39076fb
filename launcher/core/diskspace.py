"""What a failed checkpoint write says about the disk: a full one is reported as such.

(:func:`no_space_cause`, :func:`free_space_text` and :func:`human_bytes` also serve data_prep's
output, :mod:`data_prep.output_space`.)

A full disk surfaces in two shapes: an ``OSError`` with ``errno`` ENOSPC (or EDQUOT, a full
quota) from Python's own writes, and torch's zip writer failing without an errno, e.g.
``[enforce fail at inline_container.cc:672] . unexpected pos 3712 vs 3604`` or
``PytorchStreamWriter failed writing file data/0: file write failed``. For the second,
:func:`out_of_space` looks at the filesystem itself (:func:`shutil.disk_usage`): with (almost)
nothing free there, the disk is full.

:func:`write_error` turns either into a :class:`launcher.core.errors.CheckpointError` naming the
directory, the free space and the fix, e.g.::

    no space left on /scratch/run/checkpoints/step_000200.tmp (0 B free of 1.0 MiB) while saving
    step 200; the previous checkpoint (latest = step_000100) is intact. Free space on that
    filesystem or point run.output_root at a larger one, then restart: the run resumes from it.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Optional

from launcher.core.errors import CheckpointError
from launcher.core.exits import CONFIG_ERROR_EXIT

__all__ = ["TORCH_WRITE_FAILURES", "filesystem_usage", "free_space_text", "human_bytes",
           "is_write_failure", "no_space_cause", "out_of_space", "write_error"]

TORCH_WRITE_FAILURES = ("PytorchStreamWriter", "unexpected pos", "file write failed")
"""Fragments of torch's zip-writer errors (they carry no errno)."""

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""OS errors that mean the filesystem (or the user's quota on it) is full."""

LOW_WATER_BYTES = 256 * 2 ** 20
"""Free space below which (or below 1% of the filesystem, whichever is smaller) a torch write
failure is put down to a full disk."""


def human_bytes(count: float) -> str:
    """``1.5 GiB``-style size."""
    if count < 1024:
        return f"{count:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        count /= 1024
        if count < 1024 or unit == "TiB":
            break
    return f"{count:.1f} {unit}"


def filesystem_usage(path: Path) -> Optional[tuple]:
    """(total, used, free) bytes (:func:`shutil.disk_usage`) of ``path`` or of its nearest
    existing parent; None if none can be asked."""
    path = Path(path)
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate)
        except OSError:
            continue
    return None


def _chain(exc: BaseException):
    """``exc`` and the exceptions it was raised from or during."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_write_failure(exc: BaseException) -> bool:
    """An OSError or one of torch's zip-writer errors (not a programming error)."""
    return any(isinstance(e, OSError) or (isinstance(e, RuntimeError) and any(
        fragment in str(e) for fragment in TORCH_WRITE_FAILURES)) for e in _chain(exc))


def no_space_cause(exc: BaseException) -> Optional[OSError]:
    """The OSError saying that the filesystem or the quota is full: ``exc`` itself or one it was
    raised from or during; None when there is none."""
    return next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS),
                None)


def out_of_space(exc: BaseException, path: Path) -> bool:
    """Whether ``exc``, raised while writing under ``path``, means the disk or quota is full."""
    if no_space_cause(exc) is not None:
        return True
    if not is_write_failure(exc):
        return False
    usage = filesystem_usage(path)
    return usage is not None and usage.free < min(LOW_WATER_BYTES, usage.total // 100 + 1)


def free_space_text(path: Path) -> str:
    """``1.2 GiB free of 10.0 GiB`` for the filesystem holding ``path``."""
    usage = filesystem_usage(path)
    if usage is None:
        return "free space unknown"
    return f"{human_bytes(usage.free)} free of {human_bytes(usage.total)}"


class DiskFull(CheckpointError):
    """No space left for a checkpoint: exit 2, never restarted in the job (a restart would
    fill the same disk); the message says what to free or where to point run.output_root."""

    exit_code = CONFIG_ERROR_EXIT


def write_error(exc: BaseException, path: Path, *, step: int, latest: Optional[str]) -> \
        CheckpointError:
    """The CheckpointError for ``exc``, raised while saving ``step`` into ``path`` (the
    ``step_<N>.tmp`` directory); ``latest`` is the checkpoint that stays the resume point."""
    path = Path(path)
    kept = (f"the previous checkpoint (latest = {latest}) is intact" if latest
            else "no earlier checkpoint exists")
    if out_of_space(exc, path):
        return DiskFull(
            f"no space left on {path} ({free_space_text(path)}) while saving step {step}; {kept}. "
            "Free space on that filesystem or point run.output_root at a larger one, then "
            f"restart{': the run resumes from it' if latest else ''} "
            f"({type(exc).__name__}: {str(exc).strip()})")
    return CheckpointError(
        f"cannot write checkpoint files under {path} ({free_space_text(path)}) while saving step "
        f"{step}: {type(exc).__name__}: {str(exc).strip()}; {kept}")
