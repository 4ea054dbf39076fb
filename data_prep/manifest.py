"""manifest.json: what a run (or one array task) wrote, and what a re-run may keep.

A manifest is rewritten atomically after every committed shard with ``"complete": false``; the
last write sets it to true. A re-run with the same fingerprint keeps every listed shard whose files
still have the recorded sizes and CRC-32, and resumes at the block after the last one kept.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from typing import List, Optional, Tuple

import orjson

from data_prep.crc import crc32
from data_prep.errors import ConfigError
from data_prep.shards import TMP_SUFFIX
from launcher.core.atomic import atomic_write_bytes

MANIFEST = "manifest.json"


def manifest_name(num_tasks: int, task_index: int) -> str:
    return MANIFEST if num_tasks == 1 else f"manifest.task-{task_index:05d}-of-{num_tasks:05d}.json"


def shard_stem(name: str, num_tasks: int, task_index: int) -> str:
    """Shards are <stem>_<NNNNN>; array tasks put their index into the stem."""
    return name if num_tasks == 1 else f"{name}_task{task_index:05d}"


def load_manifest(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as handle:
            return orjson.loads(handle.read())
    except (OSError, ValueError):  # orjson.JSONDecodeError is a ValueError
        return None


def write_manifest(path: str, manifest: dict) -> None:
    """Indented JSON, written atomically. orjson, not ``json``: with an indent, ``json`` encodes in
    Python, 0.6 s per rewrite for a task of 50,000 input files, and a run rewrites it after every
    shard."""
    atomic_write_bytes(path, orjson.dumps(manifest, option=orjson.OPT_INDENT_2) + b"\n")


READ_CHUNK = 1 << 22
"""Bytes read at a time to hash or check a file."""


def _chunks(path: str):
    """The bytes of ``path`` as views into one reused buffer: a 4 MiB ``read()`` per chunk made a
    new allocation each time, which glibc keeps on the heap once its mmap threshold has grown,
    so the main process's memory crept up with the corpus. The buffer is no larger than the file
    (plus the byte that finds its end): zeroing 4 MiB for each of many small files cost 150 us a
    file, ten times the hashing of a 2 KB one."""
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(min(READ_CHUNK, os.fstat(handle.fileno()).st_size + 1))
        view = memoryview(buffer)
        while count := handle.readinto(buffer):
            yield view[:count]


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    for chunk in _chunks(path):
        digest.update(chunk)
    return digest.hexdigest()


def file_crc32(path: str) -> int:
    crc = 0
    for chunk in _chunks(path):
        crc = crc32(chunk, crc)
    return crc


def shard_problem(out_dir: str, entry: dict) -> str:
    """What is wrong with a shard's files against its manifest ``entry`` (missing, size, CRC-32),
    naming the file; "" when both match."""
    for ext in ("bin", "idx"):
        path = os.path.join(out_dir, f"{entry['prefix']}.{ext}")
        if not os.path.isfile(path):
            return f"{path}: missing"
        size, want = os.path.getsize(path), entry[f"{ext}_bytes"]
        if size != want:
            return f"{path}: {size:,} bytes, the manifest says {want:,}"
        crc, want = file_crc32(path), entry[f"{ext}_crc32"]
        if crc != want:
            return f"{path}: CRC-32 {crc:08x}, the manifest says {want:08x}"
    return ""


def shard_is_intact(out_dir: str, entry: dict) -> bool:
    """Both files exist with the recorded sizes and CRC-32 (a check against truncation and
    damage, cheap enough to run over every shard on every re-run)."""
    return not shard_problem(out_dir, entry)


def _remove(paths: List[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def shard_files(out_dir: str, stem: str) -> List[str]:
    # <stem>_<N>.bin/.idx, and the .mask datasets of format=chat beside them
    pattern = re.compile(re.escape(stem) + r"_\d{5,}(\.mask)?\.(bin|idx)("
                         + re.escape(TMP_SUFFIX) + ")?$")
    return sorted(p for p in glob.glob(os.path.join(glob.escape(out_dir), "*"))
                  if pattern.match(os.path.basename(p)))


def _input_differences(old: list, new: list) -> List[str]:
    """Input files added, removed or changed (size, mtime) between two fingerprints."""
    before = {entry[0]: entry[1:] for entry in old}
    after = {entry[0]: entry[1:] for entry in new}
    found = [f"input {path} is new" for path in after if path not in before]
    found += [f"input {path} is no longer an input" for path in before if path not in after]
    for path, (size, mtime) in after.items():
        if path in before and before[path] != [size, mtime]:
            was = before[path][0]
            found.append(f"input {path} changed ({was:,} bytes, now {size:,})" if was != size
                         else f"input {path} was modified (same size, mtime differs)")
    if not found and [e[0] for e in old] != [e[0] for e in new]:
        found.append("the inputs are in another order")
    return found


def fingerprint_differences(old: dict, new: dict, shown: int = 5) -> List[str]:
    """What differs between the fingerprint of an output (``old``) and of this run (``new``):
    a line per setting and per input file, the first ``shown`` input lines and a count."""
    found = []
    inputs = _input_differences(old.get("inputs", []), new.get("inputs", []))
    found += inputs[:shown] + ([f"{len(inputs) - shown} more input(s) differ"]
                               if len(inputs) > shown else [])
    for key in [k for k in new if k != "inputs"] + [k for k in old if k not in new]:
        if old.get(key) != new.get(key):
            found.append(f"{key} was {old.get(key, '(absent)')!r}, now {new.get(key, '(absent)')!r}")
    return found or ["the fingerprints differ"]


def kept_shards(out_dir: str, stem: str, previous: Optional[dict], fingerprint: dict,
                overwrite: bool) -> List[dict]:
    """Shard entries of ``previous`` that a re-run keeps; deletes every other file of ``stem``."""
    existing = shard_files(out_dir, stem)
    if previous is not None and previous.get("fingerprint") != fingerprint and not overwrite:
        differences = fingerprint_differences(previous.get("fingerprint") or {}, fingerprint)
        raise ConfigError(f"{out_dir} holds a run with other inputs or settings: "
                          f"{'; '.join(differences)}. Use another output=, or overwrite=true to "
                          "replace its shards")
    if previous is None and existing and not overwrite:
        raise ConfigError(f"{out_dir} holds shard files of {stem!r} but no manifest for them; "
                          "use another output= or overwrite=true")
    kept: List[dict] = []
    if previous is not None and previous.get("fingerprint") == fingerprint:
        for entry in previous.get("shards", []):
            if not shard_is_intact(out_dir, entry):
                break
            kept.append(entry)
    keep_names = {os.path.join(out_dir, f"{e['prefix']}.{x}") for e in kept for x in ("bin", "idx")}
    _remove([p for p in existing if p not in keep_names])
    return kept


def resume_position(kept: List[dict]) -> Tuple[int, int, int, int]:
    """(first block to process, parts of it already committed, index of the file last read,
    lines of that file already read)."""
    if not kept:
        return 0, 0, -1, 0
    last = kept[-1]
    return last["next_block"], last.get("next_part", 0), last["last_file"], last["last_file_lines"]
