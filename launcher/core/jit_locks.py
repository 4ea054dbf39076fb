"""JIT-build locks left by killed processes: found and removed, never those of a live build.

torch 2.13's ``cpp_extension`` guards each JIT-built op with a ``FileBaton`` (``<build
dir>/lock``) and every later load of the op waits for that file to go away. A process killed
while it held the baton (DeepSpeed builds its CPU shared-memory comm op in every rank's
``init_distributed``) leaves it behind, and every later build of the op waits forever. These
functions patch nothing: they clean the build cache (the checks that torch still waits on the
baton are :mod:`launcher.engines.compat`'s shims "JIT-build locks of killed ranks" and "stale
JIT-build locks"). Torch-free at import, so the launcher's own process (the watchdog) does not
import torch for them.
"""

from __future__ import annotations

import os
from pathlib import Path


def release_jit_build_locks(since: float) -> list:
    """Remove the JIT-build locks made since ``since`` (epoch seconds) that no live process
    holds (those of ranks that were just killed); the paths removed.

    torch 2.13's ``cpp_extension`` guards each JIT-built op with a ``FileBaton``
    (``<build dir>/lock``) and every later load waits for that file to go away. A rank killed
    while it held the baton (DeepSpeed builds its CPU shared-memory comm op in every rank's
    ``init_distributed``) leaves it behind, and every rank of the next attempt waits forever.
    The baton's holder keeps the file open until it releases it, so a lock that some process
    still has open belongs to a live build (another job's on the same machine, sharing the
    cache): it is left alone (removing it made that build fail with FileNotFoundError)."""
    candidates = []
    for root in _build_roots():
        for depth in ("*/lock", "*/*/lock"):
            for lock in Path(root).glob(depth):
                try:
                    if lock.stat().st_mtime >= since:
                        candidates.append(lock)
                except OSError:
                    pass
    return _remove_unheld(candidates)


def _remove_unheld(locks: list) -> list:
    """Remove the ``locks`` no process has open (those held are live builds); the paths
    removed."""
    held = _open_files({str(c.resolve()) for c in locks})
    removed = []
    for lock in locks:
        if str(lock.resolve()) in held:
            continue
        try:
            lock.unlink()
            removed.append(str(lock))
        except OSError:
            pass
    return removed


def _build_roots() -> set:
    """Where torch's cpp_extension JIT-builds ops: $TORCH_EXTENSIONS_DIR and its default root."""
    from torch.utils.cpp_extension import get_default_build_root  # only when cleaning up

    return {os.environ.get("TORCH_EXTENSIONS_DIR") or "", get_default_build_root()} - {""}


def take_over_stale_build_locks() -> list:
    """Remove every JIT-build lock that nobody holds and whose product (a built ``.so``) is
    already there; the paths removed. Such a lock was left by a process killed after its build
    finished (a test killed during DeepSpeed's shm op build left one): torch 2.13's
    ``cpp_extension._jit_compile`` sees the lock and waits in ``FileBaton.wait`` for it to go,
    forever, in every later process on the machine. A lock some process has open is a live build
    (another job's): left alone. A lock without a product may be a build in progress by a
    process this user cannot inspect: left alone too (the watch's
    :func:`release_jit_build_locks` clears those of ranks it killed)."""
    candidates = []
    for root in _build_roots():
        for depth in ("*/lock", "*/*/lock"):
            for lock in Path(root).glob(depth):
                if any(lock.parent.glob("*.so")):
                    candidates.append(lock)
    return _remove_unheld(candidates)


def _open_files(paths: set) -> set:
    """The members of ``paths`` that some process of this machine has open (Linux /proc;
    processes this user cannot inspect are not seen)."""
    found: set = set()
    if not paths or not os.path.isdir("/proc"):
        return found
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target in paths:
                found.add(target)
    return found
