"""Crash-safe file writes: a reader sees the old content or the new content, never a mix.

Every writer puts the data in a temporary file in the destination's directory (same filesystem,
so the rename is atomic), flushes and fsyncs it, ``os.replace``-s it over the final name and then
fsyncs the directory so the rename itself survives a power loss. A process killed mid-write leaves
at most a ``.<name>.tmp.*`` file behind, which never has the final name.

    atomic_write_json(run_dir / "plan.json", plan.to_dict())
    atomic_symlink_or_pointer(run_dir / "checkpoints" / "latest", "step_000100")
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Union

PathLike = Union[str, "os.PathLike[str]"]


def fsync_dir(directory: PathLike) -> None:
    """Flush a directory entry table to disk (no-op where directories cannot be opened)."""
    try:
        fd = os.open(os.fspath(directory), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename, fsync of the directory).

    The parent directory must exist. On any error the temporary file is removed and the previous
    content of ``path`` (if any) is untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON (trailing newline) to ``path`` atomically.

    Values JSON cannot encode (paths, enums, ...) are written as ``str(value)``.
    """
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def atomic_symlink_or_pointer(path: PathLike, target_name: str) -> None:
    """Point ``path`` (e.g. ``checkpoints/latest``) at ``target_name`` atomically.

    A small text file holding ``target_name`` and a newline is renamed over ``path``, so readers
    (``read_pointer``) always see either the old or the new target. A plain file is used rather
    than a symlink because it behaves the same on every shared filesystem and object-store mount.
    ``target_name`` must be a single path component (a name inside ``path``'s directory).
    """
    if not target_name or "/" in target_name or "\0" in target_name or "\n" in target_name:
        raise ValueError(f"pointer target must be a plain name in the same directory, "
                         f"got {target_name!r}")
    atomic_write_text(path, target_name + "\n")


def read_pointer(path: PathLike) -> str | None:
    """The target name stored by :func:`atomic_symlink_or_pointer`, or None if there is none.

    A symlink at ``path`` (written by other tools) is also understood: its target's name.
    """
    path = Path(path)
    if path.is_symlink():
        return Path(os.readlink(path)).name
    try:
        name = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return name or None
