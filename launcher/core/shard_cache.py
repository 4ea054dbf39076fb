"""A node's local copies of dataset shards that live on object storage: the bounded shard cache.

Training reads shards with Megatron-Core's own memory-mapped readers, so an ``s3://`` prefix of
``data.prefixes`` is read from a local copy: :meth:`ShardCache.localize` downloads each shard
the run needs once per node (one process of the node at a time holds the cache's lock; the
others then find the copies), and every later run on that node reads the same copies. Under
the cache's root (``data.shard_cache_dir``)::

    <bucket>/<folder>/manifest.json          the dataset's commit record, as on the store
    <bucket>/<folder>/<name>_00000.bin, .idx the shard's files, checked
    <bucket>/<folder>/<name>_00000.cached    the shard's record, written after its files: JSON
                                             {uri, files: {name: [bytes, crc32]}, bytes}; its
                                             mtime is the shard's last use (the LRU clock)
    .lock                                    flock: one process of the node downloads or evicts

A shard is in the cache if and only if its record exists, matches the manifest's entry and its
files have the recorded sizes. A file is downloaded as ``<file>.part``, checked (its size, then
the manifest's CRC-32) and only then renamed; a process killed mid-download leaves a ``.part``
that the next holder of the lock deletes. With a bound (``data.shard_cache_gb``), shards this run
does not read are evicted, least recently used first (record first, then files), until the
run's missing shards fit; a run whose own shards exceed the bound is refused. Evicting a shard
that another run on the node is reading does not disturb it: its memory maps keep the files'
data until it closes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from launcher.core import objectstore
from launcher.core.atomic import atomic_write_bytes
from launcher.core.diskspace import human_bytes
from launcher.core.objectstore import StoreFailure
from launcher.core.remote_data import DataUnavailable, RemoteShard, ShardFile, resolve, split_prefix

CACHE_ENV = "TRAINWRIGHT_CACHE"
"""Root of trainwright's local caches (default ``~/.cache/trainwright``); shards go under
``shards/`` unless data.shard_cache_dir says otherwise."""
RECORD = ".cached"
PART = ".part"
DOWNLOAD_S = 600.0
"""Seconds one file's download keeps retrying transient failures before it fails the run."""
SHARDS_IN_FLIGHT = 4
"""Shards downloaded at once (their files one after the other, each in parts when large)."""


def cache_root() -> Path:
    """``$TRAINWRIGHT_CACHE``, else ``~/.cache/trainwright``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "trainwright")


def default_root() -> Path:
    """``$TRAINWRIGHT_CACHE/shards`` (``~/.cache/trainwright/shards``)."""
    return cache_root() / "shards"


def crc32_of(path: Path) -> int:
    """The CRC-32 (zlib's) of a file, read in 4 MiB chunks."""
    try:
        from zlib_ng.zlib_ng import crc32
    except ImportError:  # pragma: no cover - same values, slower
        from zlib import crc32
    crc = 0
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(1 << 22):
            crc = crc32(chunk, crc)
    return crc


@dataclass(frozen=True)
class Held:
    """A shard in the cache: its record, bytes and last use."""

    record: Path
    uri: str
    bytes: int
    used: float


@dataclass(frozen=True)
class ShardCache:
    """Local copies of ``s3://`` shards under ``root``, at most ``limit_bytes`` (0 = no bound)."""

    root: Path
    limit_bytes: int = 0

    @classmethod
    def at(cls, directory: str = "", gb: float = 0.0) -> "ShardCache":
        """The cache of ``data.shard_cache_dir`` (empty = :func:`default_root`) and
        ``data.shard_cache_gb`` (GB of 1e9 bytes; 0 = no bound)."""
        root = Path(directory).expanduser() if directory else default_root()
        return cls(root.absolute(), int(gb * 1e9))

    def local_prefix(self, prefix: str) -> str:
        """Where the copy of ``prefix`` lives (a local prefix is itself)."""
        if not objectstore.is_remote(prefix):
            return prefix
        uri = objectstore.ObjectURI.parse(prefix)
        return str(self.root / uri.bucket / uri.prefix)

    def cached(self, prefixes: Sequence[str]) -> Optional[list[str]]:
        """The local prefixes when every remote one is in the cache (checked here, without the
        store: record and sizes), their last use updated; None when one is not."""
        for prefix in prefixes:
            if objectstore.is_remote(prefix) and not self._whole(Path(self.local_prefix(prefix))):
                return None
        self._touch(prefixes)
        return [self.local_prefix(p) for p in prefixes]

    def localize(self, prefixes: Sequence[str], progress: bool = True) -> list[str]:
        """The local prefixes of ``prefixes``, each remote shard resolved against its folder's
        committed manifest on the store and downloaded unless the cache holds that very shard.
        DataUnavailable (exit 2) names what cannot be had; a summary line goes to stderr."""
        remote = [p for p in prefixes if objectstore.is_remote(p)]
        if remote:
            shards = list({s.prefix: s for s in resolve(remote)}.values())
            with self._locked():
                report = self._fill(shards, progress)
            print(f"[data] {report}", file=sys.stderr, flush=True)
        return [self.local_prefix(p) for p in prefixes]

    def _fill(self, shards: list[RemoteShard], progress: bool) -> str:
        """Make room for and download the shards the cache does not hold; the summary."""
        self._drop_partials()
        for shard in {s.folder: s for s in shards}.values():
            self._write_manifest(shard)
        missing = [s for s in shards if not self._holds(s)]
        evicted = self._make_room(shards, missing)
        started, need = time.perf_counter(), sum(s.bytes for s in missing)
        with TransferProgress(need, progress and bool(missing), "[data] shards") as bar:
            self._download(missing, bar)
        self._touch([s.prefix for s in shards])
        seconds = time.perf_counter() - started
        text = (f"{len(shards)} shard(s) on the store: {len(missing)} downloaded "
                f"({human_bytes(need)} in {seconds:.1f} s), {len(shards) - len(missing)} "
                f"already in the cache {self.root}")
        return text + (f"; evicted {len(evicted)} least recently used shard(s) "
                       f"({human_bytes(sum(h.bytes for h in evicted))})" if evicted else "")

    # -- what the cache holds ------------------------------------------------------------

    def _record_path(self, prefix: str) -> Path:
        return Path(self.local_prefix(prefix) + RECORD)

    def _holds(self, shard: RemoteShard) -> bool:
        """The cache holds this shard as the store's manifest describes it."""
        path = self._record_path(shard.prefix)
        try:
            files = json.loads(path.read_text())["files"]
        except (OSError, ValueError, KeyError):
            return False
        return files == _record_files(shard.files) and self._whole(path.with_suffix(""))

    @staticmethod
    def _whole(local: Path) -> bool:
        """The record of the shard at ``local`` exists and its files have its sizes."""
        try:
            files = json.loads(Path(str(local) + RECORD).read_text())["files"]
            return all((local.parent / name).stat().st_size == size
                       for name, (size, _) in files.items())
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def _held(self) -> list[Held]:
        """Every shard in the cache, least recently used first."""
        found = []
        for record in self.root.rglob("*" + RECORD):
            with contextlib.suppress(OSError, ValueError, KeyError):
                data = json.loads(record.read_text())
                found.append(Held(record, data["uri"], int(data["bytes"]),
                                  record.stat().st_mtime))
        return sorted(found, key=lambda h: h.used)

    def _touch(self, prefixes: Sequence[str]) -> None:
        """Mark the shards as used now (the LRU clock)."""
        for prefix in prefixes:
            if objectstore.is_remote(prefix):
                with contextlib.suppress(OSError):
                    os.utime(self._record_path(prefix))

    # -- making room ---------------------------------------------------------------------

    def _make_room(self, shards: list[RemoteShard], missing: list[RemoteShard]) -> list[Held]:
        """Evict shards this run does not read, least recently used first, until the cache
        with the missing ones fits its bound; the evicted. DataUnavailable when the run's own
        shards exceed the bound or the disk has no room for the missing ones."""
        run_bytes, need = sum(s.bytes for s in shards), sum(s.bytes for s in missing)
        if self.limit_bytes and run_bytes > self.limit_bytes:
            raise DataUnavailable(
                f"data.shard_cache_gb={self.limit_bytes / 1e9:g} holds less than the "
                f"{len(shards)} shard(s) this run reads ({run_bytes / 1e9:.3f} GB); raise it, "
                "or 0 for no bound")
        held, replaced = self._held(), {s.prefix for s in missing}
        total = sum(h.bytes for h in held if h.uri not in replaced) + need
        victims = [h for h in held if h.uri not in {s.prefix for s in shards}]
        evicted = []
        while self.limit_bytes and total > self.limit_bytes and victims:
            evicted.append(victims.pop(0))
            self._evict(evicted[-1])
            total -= evicted[-1].bytes
        if need > self._free():
            raise DataUnavailable(
                f"the shard cache {self.root} needs {need / 1e9:.3f} GB more for this run's "
                f"shards but has {self._free() / 1e9:.3f} GB free; free space there, point "
                "data.shard_cache_dir at a larger disk, or set data.shard_cache_gb to evict "
                "the shards of other runs")
        return evicted

    def _free(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        return shutil.disk_usage(self.root).free

    @staticmethod
    def _evict(held: Held) -> None:
        """Remove a shard: its record first (it stops being in the cache), then its files."""
        files = json.loads(held.record.read_text())["files"]
        held.record.unlink()
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                (held.record.parent / name).unlink()

    def _drop_partials(self) -> None:
        """Delete the ``.part`` files of downloads that were killed (the lock is held: no
        download of this node is running)."""
        for part in self.root.rglob("*" + PART):
            with contextlib.suppress(FileNotFoundError):
                part.unlink()

    # -- downloading ---------------------------------------------------------------------

    def _write_manifest(self, shard: RemoteShard) -> None:
        """The folder's manifest beside its shards (what the data checks read)."""
        local = Path(self.local_prefix(str(shard.folder.child("manifest.json"))))
        if not local.is_file() or local.read_text() != shard.manifest:
            local.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(local, shard.manifest.encode())

    def _download(self, shards: list[RemoteShard], bar: "TransferProgress") -> None:
        """Download every shard of ``shards``, a few at once; the first failure is raised once
        the others have ended (each shard that finished is in the cache)."""
        if not shards:
            return
        with ThreadPoolExecutor(max_workers=min(SHARDS_IN_FLIGHT, len(shards))) as pool:
            futures = [pool.submit(self._download_shard, shard, bar) for shard in shards]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _download_shard(self, shard: RemoteShard, bar: "TransferProgress") -> None:
        """A shard's files, each checked and renamed, then its record (it is in the cache)."""
        record = self._record_path(shard.prefix)
        record.unlink(missing_ok=True)  # out of the cache before any of its files changes
        for file in shard.files:
            self._fetch(shard, file, bar)
        atomic_write_bytes(record, json.dumps({"uri": shard.prefix, "bytes": shard.bytes,
                                               "files": _record_files(shard.files)}).encode())

    def _fetch(self, shard: RemoteShard, file: ShardFile, bar: "TransferProgress") -> None:
        """One file: downloaded as ``.part``, its size and CRC-32 checked, renamed."""
        uri = shard.uri(file)
        path = Path(self.local_prefix(str(uri)))
        part = path.with_name(path.name + PART)
        try:
            objectstore.fetch_object(uri, part, time.monotonic() + DOWNLOAD_S, bar.advance)
        except StoreFailure as exc:
            part.unlink(missing_ok=True)
            raise DataUnavailable(f"{shard.prefix}: cannot download {uri}: "
                                  f"{objectstore.unusable_reason(exc)}") from None
        problem = _check(part, file)
        if problem:
            part.unlink(missing_ok=True)
            raise DataUnavailable(f"{shard.prefix}: {uri} {problem} (the manifest "
                                  f"{shard.folder.child('manifest.json')}): the object was "
                                  "replaced or damaged; re-publish the dataset")
        os.replace(part, path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The cache's lock (flock: released by the kernel when its holder dies)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"[data] waiting for another process of this node to finish with the "
                      f"shard cache {self.root}", file=sys.stderr, flush=True)
                fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _record_files(files: Sequence[ShardFile]) -> dict:
    return {f.name: [f.bytes, f.crc32] for f in files}


def _check(path: Path, file: ShardFile) -> str:
    """What is wrong with a downloaded file against the manifest; "" when nothing is."""
    size = path.stat().st_size
    if size != file.bytes:
        return f"gave {size:,} bytes, {file.bytes:,} expected"
    crc = crc32_of(path)
    if crc != file.crc32:
        return f"has CRC-32 {crc:08x}, {file.crc32:08x} expected"
    return ""


class TransferProgress:
    """Bytes moved to or from the store: a rich bar on a terminal, else a line every 30 s
    (a Slurm log, a pipe); thread-safe. ``label``: what moves ("downloading shards")."""

    EVERY_S = 30.0

    def __init__(self, total: int, enabled: bool, label: str = "downloading shards"):
        self.total, self.enabled, self.done, self.label = total, enabled, 0, label
        self._lock, self._bar, self._task, self._last = threading.Lock(), None, None, 0.0

    def __enter__(self) -> "TransferProgress":
        self._last = time.monotonic()
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)

            self._bar = Progress(TextColumn(self.label), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(),
                                 console=Console(file=sys.stderr))
            self._task = self._bar.add_task("download", total=self.total)
            self._bar.start()
        return self

    def advance(self, count: int) -> None:
        with self._lock:
            self.done += count
            if self._bar is not None:
                self._bar.update(self._task, completed=min(self.done, self.total))
            elif self.enabled and time.monotonic() - self._last >= self.EVERY_S:
                self._last = time.monotonic()
                print(f"{self.label}: {human_bytes(self.done)} of {human_bytes(self.total)}",
                      file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
