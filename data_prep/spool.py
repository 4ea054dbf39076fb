"""Per-part token files: how worker processes hand token ids to the main process without a pipe.

A worker writes the ids of each part it tokenized to ``<output>/.data_prep-spool-<stem>/`` and
sends only the file's name, size and CRC-32; the shard writer appends the file to the shard with
``os.copy_file_range`` (in the kernel; a reflink on filesystems that share extents) and deletes it.
The directory lives beside the shards (same filesystem) and holds only parts in flight; a run
deletes what a killed run left there before it starts, and the directory when it ends.
"""

from __future__ import annotations

import errno
import os
import shutil
import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the shard writer imports this module; keep it light
    from data_prep.worker import PartResult

COPY_CHUNK = 1 << 30
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM}


def spool_dir(out_dir: str, stem: str) -> str:
    return os.path.join(out_dir, f".data_prep-spool-{stem}")


def reset_spool(path: str) -> None:
    """An empty spool directory (anything a killed run left is dropped)."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)


def remove_spool(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def spool_tokens(result: "PartResult", directory: str) -> None:
    """Move ``result.tokens`` into a file of ``directory``; the result keeps its name and CRC."""
    view = memoryview(result.tokens).cast("B")
    result.crc32 = zlib.crc32(view)
    if len(view):
        result.spool = os.path.join(directory, f"{result.index:09d}.{result.part:06d}.ids")
        with open(result.spool, "wb", buffering=0) as handle:
            while view:
                view = view[handle.write(view):]
    result.tokens = None


def append_file(source: str, nbytes: int, target_fd: int) -> None:
    """Append the ``nbytes`` bytes of ``source`` at the current offset of ``target_fd``."""
    with open(source, "rb", buffering=0) as handle:
        copied = 0
        try:
            while copied < nbytes:
                done = os.copy_file_range(handle.fileno(), target_fd, min(COPY_CHUNK, nbytes - copied))
                if done == 0:
                    break
                copied += done
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
        handle.seek(copied)
        while copied < nbytes:  # no kernel copy here (or a short one): copy through memory
            chunk = handle.read(min(COPY_CHUNK, nbytes - copied))
            if not chunk:
                raise OSError(f"{source}: {nbytes - copied} bytes missing from a token spool file")
            view = memoryview(chunk)
            while view:
                view = view[os.write(target_fd, view):]
            copied += len(chunk)
