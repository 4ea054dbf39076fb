"""Datasets on object storage (``s3://bucket/folder``): the layout data_prep publishes, what
makes one visible to training, and how a reader finds a shard's objects. Torch-free; data_prep
and the launcher share it. Under a dataset's folder::

    <name>_00000.bin, .idx           the shards (format=chat: also .mask.bin, .mask.idx)
    data.yaml                        the data config, its prefixes on the store
    manifest.json                    data_prep's manifest, uploaded LAST: the commit record

A folder is committed if and only if its ``manifest.json`` exists (and says ``"complete":
true``): :func:`publish` uploads every shard file and ``data.yaml`` first and the manifest only
once each of them is on the store, so a reader never sees a half-written dataset. A reader
(:func:`resolve`) refuses a prefix under a folder without one, naming it, and a shard the
manifest does not list, or whose object is missing or of another size than the manifest says,
naming the key. A re-publish over a committed folder deletes the old manifest first, so the
folder is never committed over a mix of old and new shards.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from launcher.core import objectstore
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.core.objectstore import ObjectURI, StoreFailure

MANIFEST = "manifest.json"
DATA_CONFIG = "data.yaml"
CHECK_S = 20.0
"""Seconds a manifest read or a listing keeps retrying transient failures (an endpoint that
does not answer is reported after this long)."""
_SHARD_FILE = re.compile(r"_\d{5,}(\.mask)?\.(bin|idx)$")


class DataUnavailable(RuntimeError):
    """A dataset on the store cannot be read as named: an unusable store, an uncommitted
    folder, a shard the manifest does not list, a missing or damaged object. A config error
    (exit 2); the message names the URI and the key, never a credential."""

    exit_code = CONFIG_ERROR_EXIT


@dataclass(frozen=True)
class ShardFile:
    """One file of a shard as the manifest records it."""

    name: str
    """File name inside the dataset folder (``<name>_00000.bin``)."""
    bytes: int
    crc32: int


@dataclass(frozen=True)
class RemoteShard:
    """A shard named by an ``s3://`` prefix, resolved against its folder's committed manifest."""

    prefix: str
    """The prefix as data.prefixes names it (``s3://bucket/folder/<name>_00000``)."""
    folder: ObjectURI
    files: tuple[ShardFile, ...]
    manifest: str
    """The folder's manifest.json, as on the store."""

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def uri(self, file: ShardFile) -> ObjectURI:
        return self.folder.child(file.name)


def entry_files(entry: dict) -> list[ShardFile]:
    """The files of a manifest shard entry: ``.bin`` and ``.idx``, and for format=chat the
    ``.mask.bin`` and ``.mask.idx`` of its loss mask."""
    parts = [(entry["prefix"], entry)]
    if entry.get("mask"):
        parts.append((entry["prefix"] + ".mask", entry["mask"]))
    return [ShardFile(f"{stem}.{ext}", int(fields[f"{ext}_bytes"]), int(fields[f"{ext}_crc32"]))
            for stem, fields in parts for ext in ("bin", "idx")]


def split_prefix(prefix: str) -> tuple[ObjectURI, str]:
    """(the dataset folder, the shard's name) of ``s3://bucket/folder/<name>``; ValueError for a
    prefix with no folder."""
    uri = ObjectURI.parse(prefix)
    folder, _, name = uri.prefix.rpartition("/")
    if not folder or not name:
        raise ValueError(f"{prefix} names no shard inside a dataset folder "
                         "(s3://<bucket>/<folder>/<name>_00000)")
    return ObjectURI(uri.bucket, folder), name


def read_manifest(folder: ObjectURI, deadline: float) -> tuple[str, dict]:
    """The committed manifest of ``folder`` (its text and its JSON); DataUnavailable naming the
    folder when it has none, it does not parse or it is not complete."""
    where = folder.child(MANIFEST)
    text = _store_call(where, lambda: objectstore.get_text(where, deadline))
    if text is None:
        raise DataUnavailable(
            f"{folder} is not a committed dataset (no {where}): its upload never finished, or "
            "nothing was published there; re-run the python -m data_prep command that writes "
            f"it (output={folder}), or fix data.prefixes")
    try:
        manifest = json.loads(text)
        manifest["shards"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataUnavailable(f"{where} is not a data_prep manifest ({exc}); re-publish the "
                              "dataset with python -m data_prep") from None
    if manifest.get("complete") is not True:
        raise DataUnavailable(f"{where} says the dataset is not complete; re-run data_prep")
    return text, manifest


def _store_call(uri: ObjectURI, call: Callable):
    """``call()``, a StoreFailure turned into DataUnavailable naming ``uri`` and the fix."""
    try:
        return call()
    except StoreFailure as exc:
        raise DataUnavailable(f"cannot read {uri} (endpoint {objectstore.endpoint()}, bucket "
                              f"{uri.bucket!r}): {objectstore.unusable_reason(exc)}") from None


def resolve(prefixes: Sequence[str], deadline: Optional[float] = None) -> list[RemoteShard]:
    """Each ``s3://`` prefix as a shard of a committed dataset whose objects are all on the
    store with the sizes its manifest records (one manifest read and one listing per folder);
    DataUnavailable naming the first prefix, folder or key that is not."""
    deadline = deadline if deadline is not None else time.monotonic() + CHECK_S
    folders: dict[ObjectURI, tuple[str, dict, dict]] = {}
    shards = []
    for prefix in prefixes:
        try:
            folder, name = split_prefix(prefix)
        except ValueError as exc:
            raise DataUnavailable(str(exc)) from None
        if folder not in folders:
            text, manifest = read_manifest(folder, deadline)
            listing = _store_call(folder, lambda: dict(objectstore.list_keys(folder, deadline)))
            folders[folder] = (text, manifest, listing)
        text, manifest, listing = folders[folder]
        shards.append(_shard(prefix, folder, name, text, manifest, listing))
    return shards


def _shard(prefix: str, folder: ObjectURI, name: str, text: str, manifest: dict,
           listing: dict) -> RemoteShard:
    """The shard ``name`` of a folder's manifest, every object of it in ``listing`` (key ->
    bytes) with its manifest's size; DataUnavailable naming the prefix and the key."""
    entry = next((e for e in manifest["shards"] if e.get("prefix") == name), None)
    if entry is None:
        raise DataUnavailable(f"{prefix}: the manifest {folder.child(MANIFEST)} lists no shard "
                              f"{name!r} (it has {len(manifest['shards'])}); fix data.prefixes "
                              f"(the folder's {DATA_CONFIG} lists them)")
    files = tuple(entry_files(entry))
    for file in files:
        key = folder.key(file.name)
        size = listing.get(key)
        if size != file.bytes:
            state = "is missing" if size is None else f"holds {size:,} bytes"
            raise DataUnavailable(
                f"{prefix}: s3://{folder.bucket}/{key} {state}, the manifest "
                f"{folder.child(MANIFEST)} says {file.bytes:,} bytes; re-publish the dataset "
                "(re-run its python -m data_prep command) or fix data.prefixes")
    return RemoteShard(prefix, folder, files, text)


def shard_prefixes(folder: ObjectURI, manifest: dict) -> list[str]:
    """The ``s3://`` prefix of every shard of a manifest published under ``folder``."""
    return [str(folder.child(entry["prefix"])) for entry in manifest["shards"]]


def check_writable(folder: ObjectURI) -> None:
    """DataUnavailable (exit 2) unless this process can write and delete under ``folder``:
    found before hours of tokenizing, not at the upload."""
    deadline = time.monotonic() + CHECK_S
    probe = folder.child(f".trainwright-write-check-{os.getpid()}")
    try:
        objectstore.put_text(probe, "write check\n", deadline)
        objectstore.delete_keys(folder.bucket, [probe.prefix], deadline)
    except StoreFailure as exc:
        raise DataUnavailable(f"cannot write a dataset to {folder} (endpoint "
                              f"{objectstore.endpoint()}, bucket {folder.bucket!r}): "
                              f"{objectstore.unusable_reason(exc)}") from None


def publish(local_dir: Path, folder: ObjectURI, retry_s: float, *, replace: bool,
            data_config: str, on_file: Callable[[str, int], None] = lambda name, size: None
            ) -> str:
    """Upload the complete data_prep output ``local_dir`` to ``folder``: its shard files, then
    ``data_config`` (the text of data.yaml, prefixes on the store) as data.yaml, then its
    manifest.json LAST (the commit), then delete shard files of the folder that the manifest
    does not list (an earlier, other run's). "already committed" when the store holds this
    very manifest (nothing is sent), else "committed". ``replace`` allows replacing a committed
    dataset of other inputs or settings (data_prep's overwrite=true); without it that is
    DataUnavailable. Each request retries transient failures for ``retry_s`` seconds (then
    StoreFailure naming the key); ``on_file(name, bytes)`` after each file is on the store."""
    text = (Path(local_dir) / MANIFEST).read_text()
    manifest = json.loads(text)
    if manifest.get("complete") is not True:
        raise DataUnavailable(f"{local_dir}/{MANIFEST} is not complete; finish the data_prep "
                              "run first (re-run its command)")
    on_store = objectstore.get_text(folder.child(MANIFEST), time.monotonic() + retry_s)
    if on_store == text:
        return "already committed"
    if on_store is not None:
        _refuse_other_dataset(folder, on_store, manifest, replace)
        objectstore.delete_keys(folder.bucket, [folder.key(MANIFEST)],
                                time.monotonic() + retry_s)  # uncommitted from here on
    files = [f for entry in manifest["shards"] for f in entry_files(entry)]
    for file in files:
        objectstore.upload([(Path(local_dir) / file.name, folder.key(file.name))],
                           folder.bucket, time.monotonic() + retry_s)
        on_file(file.name, file.bytes)
    objectstore.put_text(folder.child(DATA_CONFIG), data_config, time.monotonic() + retry_s)
    objectstore.put_text(folder.child(MANIFEST), text, time.monotonic() + retry_s)  # the commit
    _delete_debris(folder, {f.name for f in files}, time.monotonic() + retry_s)
    return "committed"


def _refuse_other_dataset(folder: ObjectURI, on_store: str, manifest: dict,
                          replace: bool) -> None:
    """DataUnavailable when the store's committed manifest is of other inputs or settings
    and ``replace`` is not given."""
    try:
        theirs = json.loads(on_store).get("fingerprint")
    except ValueError:
        theirs = None
    if replace or theirs == manifest.get("fingerprint"):
        return
    raise DataUnavailable(f"{folder} holds a committed dataset of other inputs or settings "
                          f"({folder.child(MANIFEST)}); use another output=, or overwrite=true "
                          "to replace it")


def _delete_debris(folder: ObjectURI, keep: set, deadline: float) -> None:
    """Delete the shard files right under ``folder`` that are not in ``keep`` (never anything
    in a sub-folder: another dataset may live there)."""
    base = folder.prefix + "/"
    debris = [key for key, _ in objectstore.list_keys(folder, deadline)
              if "/" not in key[len(base):] and _SHARD_FILE.search(key)
              and key[len(base):] not in keep]
    if debris:
        objectstore.delete_keys(folder.bucket, debris, deadline)
