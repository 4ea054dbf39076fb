"""A checkpoint's files uploaded as they are closed, while the engine is still writing the rest
of the step (so the save to an object store costs about the longer of the write and the
upload, not their sum).

The staged step folder is watched with watchdog (Linux inotify: a file closed after writing, a
file renamed into place); each closed file this process claims starts its upload on the
transfer manager at once. Of the processes of a node that see the folder, one sends each
file: the one with the fewest bytes given so far (ties to the lowest LOCAL_RANK). Each process
computes that on its own, over the events it sees, and the kernel reports the same events in
the same order to every watch of the folder, so they agree without talking; if they did not
(an event one watch missed), a file would go twice or after the write, never be lost. Files
written on another node of a shared filesystem raise no event here (inotify sees local writes
only) and are uploaded after the write, as are files this watch missed (closed before the
watch of a new subfolder was in place).

What was sent early counts only if the file is still the one sent: at :meth:`EarlyUploads.stop`
a file closed twice, or whose size or modification time changed since, is waited for and left
to the upload after the write; an early upload of a file that is gone (a temporary file renamed
into place) is waited for and its key deleted. Nothing here decides what is committed: the
commit record lists the files every rank saw after the write (:mod:`checkpoint_store`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Optional

from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from launcher.core import objectstore
from launcher.core.objectstore import ObjectURI


def _local_share() -> tuple[int, int]:
    """(this process's index, processes) among the ranks of this node (the elastic agent's
    LOCAL_RANK and LOCAL_WORLD_SIZE; alone without them)."""
    size = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return int(os.environ.get("LOCAL_RANK", "0") or 0) % max(size, 1), max(size, 1)


def _stat(path: Path) -> Optional[tuple[int, int]]:
    """(bytes, modification ns) of ``path``; None when it is gone."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


class EarlyUploads:
    """The early uploads of one staged step folder (:meth:`start`, then :meth:`stop`)."""

    def __init__(self, staged: Path, folder: ObjectURI,
                 share: Optional[tuple[int, int]] = None):
        self.staged, self.folder = Path(staged), folder
        self.share = share or _local_share()
        """(this process's index, processes) among those of the node that see the folder."""
        self.loads = [0] * self.share[1]
        """Bytes each process of the node has been given so far (the same on each: see
        :meth:`closed`)."""
        self.sent: dict = {}
        """Name inside the step -> ((bytes, mtime ns) when sent, the upload's future)."""
        self.seen: set = set()
        """Names closed at least once (whoever sends them)."""
        self.dirty: set = set()
        """Names closed again after they were first seen."""
        self._lock = threading.Lock()
        self._watching = False
        self._observer = None

    def start(self) -> "EarlyUploads":
        self.staged.mkdir(parents=True, exist_ok=True)
        self._observer = Observer()
        self._observer.schedule(_Closed(self), str(self.staged), recursive=True)
        self._observer.daemon = True
        self._watching = True
        self._observer.start()
        return self

    def closed(self, path: str) -> None:
        """The watch saw ``path`` closed after writing (or renamed into place)."""
        try:
            name = Path(path).relative_to(self.staged).as_posix()
        except ValueError:
            return
        with self._lock:
            if not self._watching or name in self.seen:
                self.dirty.add(name)
                return
            self.seen.add(name)
            stat = _stat(self.staged / name)
            if stat is None:
                return
            owner = min(range(len(self.loads)), key=lambda i: (self.loads[i], i))
            self.loads[owner] += stat[0]
            if owner != self.share[0]:
                return
            future = objectstore.start_upload(self.staged / name, self.folder.bucket,
                                              self.folder.key(name))
            self.sent[name] = (stat, future)

    def stop(self, deadline: float) -> dict:
        """Stop watching (after every rank's write); (local file, key) -> future of the early
        uploads that still match their file. The others are waited for (their failure does not
        matter: the upload after the write sends them), and the keys of files gone are
        deleted."""
        with self._lock:
            self._watching = False
        if self._observer is not None:
            self._observer.stop()
            self._observer.join()
        kept, stale = {}, []
        for name, (stat, future) in self.sent.items():
            path = self.staged / name
            if name not in self.dirty and _stat(path) == stat:
                kept[(path, self.folder.key(name))] = future
            else:
                stale.append((name, future))
        for _, future in stale:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the upload after the write sends it again
                pass
        gone = [self.folder.key(name) for name, _ in stale if _stat(self.staged / name) is None]
        if gone:
            try:
                objectstore.delete_keys(self.folder.bucket, gone, deadline)
            except objectstore.StoreFailure:
                pass  # debris outside the commit record: keep-k removes its folder
        return kept


class _Closed(FileSystemEventHandler):
    """watchdog's handler of one :class:`EarlyUploads`' folder: a file closed after writing,
    or moved into place."""

    def __init__(self, uploads: EarlyUploads):
        super().__init__()
        self.uploads = uploads

    def on_closed(self, event) -> None:
        if not event.is_directory:
            self.uploads.closed(os.fsdecode(event.src_path))

    def on_moved(self, event) -> None:
        if not event.is_directory:
            self.uploads.closed(os.fsdecode(event.dest_path))
