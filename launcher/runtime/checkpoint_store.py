"""Checkpoints on object storage, across ranks: every rank uploads its share of a step written
locally, rank 0 commits it; a resume downloads a committed step into the local checkpoints
folder, the ranks that share that folder splitting its files. The layout and the commit rule
are :mod:`launcher.core.remote_checkpoints`'s; the transfers :mod:`launcher.core.objectstore`'s.

Which rank uploads what: every rank lists the files it sees in the staged step directory; the
lists are gathered, and each file goes to the least-loaded rank (by bytes) among those that see
it. So a node-local staging folder (each node sees its own ranks' files) and a shared one (every
rank sees every file) both upload each file exactly once, spread over every rank that can.
Files already sent while the step was being written (:mod:`launcher.runtime.early_uploads`,
files closed on this node) are left out of that share-out; their uploads are waited for with
the rest.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from launcher.core import objectstore, remote_checkpoints
from launcher.core.atomic import atomic_symlink_or_pointer, atomic_write_text
from launcher.core.checkpoints import COMPLETE, LATEST, META, step_name
from launcher.core.objectstore import ObjectURI, StoreFailure
from launcher.core.remote_checkpoints import Commit
from launcher.parallel import collectives
from launcher.runtime.early_uploads import EarlyUploads

REMOTE_RECORD = "remote.json"
"""In a local step directory kept or fetched from the store: the commit record it matches."""


def local_files(step_dir: Path) -> dict:
    """Path inside ``step_dir`` -> bytes of every file this process sees there."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        return {}
    return {p.relative_to(step_dir).as_posix(): p.stat().st_size
            for p in sorted(step_dir.rglob("*")) if p.is_file()}


def assign(seen: list) -> list:
    """For each rank, the files it uploads: each file seen by several ranks goes to the one
    with the fewest bytes assigned so far (largest files first; ties to the lowest rank)."""
    sizes = {name: size for files in seen for name, size in files.items()}
    load, shares = [0] * len(seen), [[] for _ in seen]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        owner = min((r for r, files in enumerate(seen) if name in files),
                    key=lambda r: (load[r], r))
        shares[owner].append(name)
        load[owner] += sizes[name]
    return shares


@dataclass
class Transfer:
    """One rank's transfer on a thread (training, or the engine's build, goes on meanwhile);
    a failure of ``run()`` is kept as one line, never lost."""

    run: Callable[[], object]
    name: str = "checkpoint-transfer"
    error: str = ""
    _thread: Optional[threading.Thread] = field(default=None, repr=False)

    def start(self) -> "Transfer":
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.run()
        except StoreFailure as exc:
            self.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported as the transfer's failure
            self.error = f"{type(exc).__name__}: {exc}"

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


class StoreUploads:
    """One run's uploads to ``uri`` (collective methods: all ranks call them together)."""

    def __init__(self, uri: ObjectURI, *, retry_s: float):
        self.uri, self.retry_s = uri, retry_s
        self.upload: Optional[Transfer] = None
        self.early: Optional[EarlyUploads] = None
        self.files: dict = {}
        self.shared = False
        """Whether every rank saw every file of the last step (one shared staging folder):
        the local copy is then complete and is kept as a cache for a restart."""

    def deadline(self) -> float:
        return time.monotonic() + self.retry_s

    def clear_step(self, step: int) -> None:
        """Rank 0, before a save: remove what an earlier try left under this step's folder."""
        if collectives.rank() == 0:
            try:
                remote_checkpoints.clear(self.uri.child(step_name(step)), self.deadline())
            except StoreFailure:
                pass  # the upload meets the same store and says what is wrong

    def watch(self, staged: Path, step: int) -> None:
        """Upload ``staged``'s files as they are closed, while the step is still being written
        (:mod:`launcher.runtime.early_uploads`); :meth:`begin` or :meth:`abandon` ends it."""
        self.abandon()
        try:
            self.early = EarlyUploads(staged, self.uri.child(step_name(step))).start()
        except OSError:  # no inotify to spare (fs.inotify.max_user_instances): sent after
            self.early = None

    def abandon(self) -> None:
        """Stop watching a step whose write failed (its early uploads end; nothing commits)."""
        if self.early is not None:
            early, self.early = self.early, None
            early.stop(self.deadline())

    def begin(self, staged: Path, step: int) -> None:
        """Share out ``staged``'s files not uploaded early and start this rank's upload
        (collective; after every rank has written its files, rank 0 its metadata last)."""
        collectives.barrier()
        early, self.early = self.early, None
        started = early.stop(self.deadline()) if early is not None else {}
        seen = collectives.gather_objects(
            (local_files(staged), [path.relative_to(staged).as_posix() for path, _ in started]))
        sent_early = {name for _, names in seen for name in names}
        self.files = {name: size for files, _ in seen for name, size in files.items()}
        self.shared = all(len(files) == len(self.files) for files, _ in seen)
        mine = assign([{name: size for name, size in files.items() if name not in sent_early}
                       for files, _ in seen])[collectives.rank()]
        folder = self.uri.child(step_name(step))
        files = [(Path(staged) / name, folder.key(name)) for name in mine]
        files, bucket, deadline = files + list(started), self.uri.bucket, self.deadline()
        self.upload = Transfer(lambda: objectstore.upload(files, bucket, deadline, started),
                               "checkpoint-upload").start()

    def finished(self, blocking: bool) -> bool:
        """Whether every rank's upload has ended (collective; ``blocking``: wait for them)."""
        if blocking:
            self.upload.join()
        return not collectives.any_rank(not self.upload.done())

    def end(self, step: int) -> tuple[Optional[Commit], str]:
        """After :meth:`finished`: rank 0 commits when every rank sent its share (collective).
        (the commit, "") or (None, the first failure as one line)."""
        errors = [e for e in collectives.gather_objects(self.upload.error) if e]
        self.upload = None
        folder = self.uri.child(step_name(step))
        done, error = None, errors[0] if errors else ""
        if not errors and collectives.rank() == 0:
            try:
                done = remote_checkpoints.commit(folder, step, self.files, self.deadline())
            except StoreFailure as exc:
                error = str(exc)
        done, error = collectives.gather_objects((done, error))[0]  # rank 0's, on every rank
        return (done if not error else None), error

    def prune(self, keep_last: int) -> list:
        """Rank 0: keep-k on the store (failures are one line, never fatal); steps deleted."""
        try:
            return remote_checkpoints.prune(self.uri, keep_last, self.deadline())
        except StoreFailure:
            return []


def fetch(commit: Commit, checkpoints_dir: Path, retry_s: float) -> Path:
    """Download ``commit`` into ``checkpoints_dir/step_<N>`` unless the copy there already
    matches it; the ranks that see the same folder split its files (collective). Raises
    StoreFailure (on every rank) naming a key that is missing or truncated."""
    return start_fetch(commit, checkpoints_dir, retry_s).landed()


@dataclass
class Fetch:
    """A committed step landing in ``folder`` (its metadata there already, the rest arriving
    on this rank's :class:`Transfer`); :meth:`landed` waits for it (collective)."""

    commit: Commit
    folder: Path
    """Where the files land: the step directory itself once landed, else its ``.fetch``."""
    final: Path
    group: list = field(default_factory=list)
    """The ranks that share ``folder`` (the first renames it)."""
    transfer: Optional[Transfer] = None

    def landed(self) -> Path:
        """Wait for every rank's share, then the local copy takes the step's name (collective);
        the step directory. StoreFailure (on every rank) naming a key missing or truncated."""
        if self.transfer is None:
            return self.folder
        self.transfer.join()
        error, self.transfer = self.transfer.error, None
        _raise_any(error, self.commit)
        if collectives.rank() == self.group[0]:
            keep_local(self.folder, self.final, self.commit)
        collectives.barrier()
        self.folder = self.final
        return self.final


def _raise_any(error: str, commit: Commit) -> None:
    """StoreFailure on every rank when any rank's download of ``commit`` failed (collective)."""
    errors = [e for e in collectives.gather_objects(error) if e]
    if errors:
        raise StoreFailure(f"cannot load checkpoint {commit.uri}: {errors[0]}")


def start_fetch(commit: Commit, checkpoints_dir: Path, retry_s: float) -> Fetch:
    """Begin downloading ``commit`` (collective): its metadata file (``trainwright.json``)
    before returning, the rest on a thread per rank, so the engine can be built meanwhile;
    :meth:`Fetch.landed` before reading it. A local copy that matches the commit is used as
    it is."""
    final = Path(checkpoints_dir) / step_name(commit.step)
    if all(collectives.gather_objects(_matches(final, commit.record()))):
        return Fetch(commit, final, final)
    partial = final.with_name(final.name + ".fetch")
    group = _sharing_ranks(partial)
    if collectives.rank() == group[0]:
        shutil.rmtree(final, ignore_errors=True)
        for debris in partial.iterdir():  # an earlier fetch's files; never another's markers
            if not debris.name.startswith(".ranks-"):
                shutil.rmtree(debris) if debris.is_dir() else debris.unlink()
    collectives.barrier()
    deadline = time.monotonic() + retry_s

    def items(names: list) -> list:
        return [(commit.uri.key(n), partial / n, commit.files[n]) for n in names]

    error = ""
    if collectives.rank() == group[0] and META in commit.files:
        try:
            objectstore.download(items([META]), commit.uri.bucket, deadline)
        except StoreFailure as exc:
            error = str(exc)
    _raise_any(error, commit)
    names = sorted((n for n in commit.files if n != META), key=lambda n: (-commit.files[n], n))
    mine = items(names[group.index(collectives.rank())::len(group)])
    transfer = Transfer(lambda: objectstore.download(mine, commit.uri.bucket, deadline),
                        "checkpoint-download").start()
    return Fetch(commit, partial, final, group, transfer)


def keep_local(staged: Path, final: Path, done: Commit) -> None:
    """``staged`` (a step every rank staged in one folder, just committed; or a whole download)
    becomes the local copy of the commit ``final``: the commit record, ``complete``, the rename,
    ``latest``."""
    atomic_write_text(staged / REMOTE_RECORD, done.record())
    atomic_write_text(staged / COMPLETE, f"{done.step}\n")
    if final.exists():
        shutil.rmtree(final)
    staged.rename(final)
    atomic_symlink_or_pointer(final.parent / LATEST, final.name)


def _matches(step_dir: Path, record: str) -> bool:
    """Whether ``step_dir`` is a complete local copy of the commit ``record``."""
    try:
        if (step_dir / REMOTE_RECORD).read_text() != record:
            return False
    except OSError:
        return False
    files = json.loads(record)["files"]
    have = local_files(step_dir)
    return all(have.get(name) == size for name, size in files.items())


def _sharing_ranks(folder: Path) -> list:
    """The ranks that see the same ``folder`` as this one (a node-local disk, or everyone on a
    shared one), lowest first: each leaves a marker, then reads the markers it can see (in a
    folder named for this call, so a crashed call's markers never count)."""
    rank = collectives.rank()
    nonce = collectives.gather_objects(f"{random.getrandbits(48):012x}")[0]
    marks = folder / f".ranks-{nonce}"
    marks.mkdir(parents=True, exist_ok=True)
    (marks / f"{rank}@{socket.gethostname()}.{os.getpid()}").touch()
    collectives.barrier()
    seen = sorted(int(p.name.split("@")[0]) for p in marks.iterdir())
    collectives.barrier()
    if rank == seen[0]:
        shutil.rmtree(marks, ignore_errors=True)
    return seen


def _newest_commit(load: str, checkpoint_uri: str, retry_s: float) -> Optional[Commit]:
    """Rank 0: the commit to resume from: ``load`` when it names the store, else the newest
    under ``checkpoint_uri`` (None: nothing committed yet)."""
    where = ObjectURI.parse(load if objectstore.is_remote(load) else checkpoint_uri)
    return remote_checkpoints.resolve(where, time.monotonic() + retry_s)


def locate_resume(run_dir: Path, load: str, checkpoint_uri: str, retry_s: float):
    """The :class:`~launcher.core.checkpoints.Resume` of a run (collective): from the store when
    ``load`` names one or when the checkpoints live there and ``load`` is empty (the commit is
    downloaded into ``<run_dir>/checkpoints`` unless the copy there matches it: its metadata
    now, the rest while the engine is built, landed by ``Resume.landed`` before the read),
    else as :func:`launcher.core.checkpoints.find_resume` finds it locally."""
    from launcher.core.checkpoints import find_resume, resume_from_meta, resume_point
    from launcher.core.errors import CheckpointError

    remote = objectstore.is_remote(load) or (not load and objectstore.is_remote(checkpoint_uri))
    if not remote:
        return find_resume(run_dir, load)
    found, error = None, ""
    if collectives.rank() == 0:
        try:
            found = _newest_commit(load, checkpoint_uri, retry_s)
        except CheckpointError as exc:
            error = str(exc)
    found, error = collectives.gather_objects((found, error))[0]
    if error:
        raise CheckpointError(error)
    if found is None:
        return None
    fetching = start_fetch(found, Path(run_dir) / "checkpoints", retry_s)
    if fetching.transfer is None:
        return resume_point(fetching.folder)
    return replace(resume_from_meta(fetching.folder), arriving=fetching.landed,
                   origin=str(found.uri))


def uploads_to(checkpoint_uri: str, retry_s: float) -> Optional[StoreUploads]:
    """The uploads of a run whose trainer.checkpoint_uri names a store (None: local only)."""
    if not objectstore.is_remote(checkpoint_uri):
        return None
    return StoreUploads(ObjectURI.parse(checkpoint_uri), retry_s=retry_s)
