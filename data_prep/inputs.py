"""Turn ``input=`` specs (files, globs, directories) into an ordered list of input files.

The order is the order of the specs; a glob or a directory contributes its files sorted by path.
That order is the document order of the output, and :func:`split_for_task` cuts it into contiguous,
size-balanced ranges for Slurm array tasks.
"""

from __future__ import annotations

import contextlib
import glob
import os
from dataclasses import dataclass
from typing import Iterator, List, Sequence

from data_prep.errors import ConfigError, InputChangedError

COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
JSONL_SUFFIXES = {".jsonl", ".json", ".ndjson"}
SKIPPED_NAMES = {"manifest.json", "data.yaml"}


@dataclass(frozen=True)
class InputFile:
    path: str
    """Absolute path."""
    format: str
    """jsonl, parquet or text."""
    compression: str
    """'' (none), gz or zst."""
    size: int
    """File size in bytes (compressed size for compressed files)."""
    mtime_ns: int
    """Modification time when the inputs were listed (ns); the fingerprint records it, so a
    file changed during a run makes its re-run refuse the shards."""


def suffixes(path: str) -> List[str]:
    """The suffixes of the file name, as :attr:`pathlib.PurePath.suffixes` gives them, without
    building a Path (a listing of millions of files asks this of each)."""
    name = os.path.basename(path)
    if name.endswith("."):
        return []
    return ["." + part for part in name.lstrip(".").split(".")[1:]]


def detect_format(path: str, forced: str) -> tuple[str, str]:
    """(format, compression) of ``path``: from its suffixes, or ``forced`` unless that is auto."""
    found = [s.lower() for s in suffixes(path)]
    compression = COMPRESSIONS.get(found[-1], "") if found else ""
    inner = found[-2] if compression and len(found) > 1 else (found[-1] if found else "")
    if forced != "auto":
        fmt = forced
    elif inner == ".parquet":
        fmt = "parquet"
    elif inner in JSONL_SUFFIXES:
        fmt = "jsonl"
    else:
        fmt = "text"
    if fmt == "parquet" and compression:
        raise ConfigError(f"{path}: parquet files compress internally; pass the .parquet file itself")
    return fmt, compression


def _expand_one(spec: str) -> List[str]:
    """Files named by one spec, sorted within the spec."""
    if os.path.isdir(spec):
        found = []
        for root, dirs, files in os.walk(spec):
            dirs.sort()
            found += [os.path.join(root, f) for f in files if not f.startswith(".")]
        return sorted(p for p in found if os.path.basename(p) not in SKIPPED_NAMES)
    if os.path.isfile(spec):
        return [spec]
    if glob.has_magic(spec):
        return sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
    raise ConfigError(f"input {spec!r} is not a file, directory or matching glob; "
                      "check the path (input=<file|glob|dir> or input=[a,b,...])")


def expand_inputs(specs: Sequence[str], forced_format: str, exclude_dir: str = "") -> List[InputFile]:
    """Every input file in output order; a file named twice is kept once (its first place).
    Files under ``exclude_dir`` (the output directory) are never inputs."""
    if not specs:
        raise ConfigError("input= is empty; name at least one file, glob or directory")
    seen, result = set(), []
    for spec in specs:
        files = _expand_one(os.path.expanduser(spec))
        if not files:
            raise ConfigError(f"input {spec!r} matches no files; check the glob or directory")
        for path in files:
            path = os.path.abspath(path)
            if path in seen or (exclude_dir and path.startswith(exclude_dir.rstrip(os.sep) + os.sep)):
                continue
            seen.add(path)
            fmt, compression = detect_format(path, forced_format)
            stat = os.stat(path)
            result.append(InputFile(path, fmt, compression, stat.st_size, stat.st_mtime_ns))
    return result


def split_for_task(files: Sequence[InputFile], num_tasks: int, task_index: int) -> List[InputFile]:
    """The contiguous range of ``files`` that array task ``task_index`` of ``num_tasks`` prepares.

    A file belongs to the task whose share of the total bytes holds the file's midpoint, so every
    file goes to exactly one task, order is kept, and tasks get about equal bytes.
    """
    total = sum(f.size for f in files) or 1
    chosen, before = [], 0
    for f in files:
        midpoint = before + f.size / 2
        owner = min(int(midpoint * num_tasks // total), num_tasks - 1)
        if owner == task_index:
            chosen.append(f)
        before += f.size
    return chosen


def _change(file: InputFile) -> str:
    """What differs in ``file`` from when it was listed ('' when nothing)."""
    try:
        stat = os.stat(file.path)
    except FileNotFoundError:
        return f"{file.path}: removed"
    if stat.st_size != file.size:
        return f"{file.path}: {file.size:,} bytes when listed, {stat.st_size:,} now"
    if stat.st_mtime_ns != file.mtime_ns:
        return f"{file.path}: modified after it was listed (same size)"
    return ""


def changed_inputs(files: Sequence[InputFile]) -> List[str]:
    """One line for every input whose size or mtime differs from the listing, or that is gone."""
    return [change for change in map(_change, files) if change]


def input_changed_error(changes: Sequence[str]) -> InputChangedError:
    """The error of a run whose inputs changed under it (``changes``: from changed_inputs)."""
    shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
    return InputChangedError(
        f"{len(changes)} input file(s) changed during the run: {shown}. The output is not marked "
        "complete, and the shards already written came from the old contents: re-run with "
        "overwrite=true once the inputs stop changing")


@contextlib.contextmanager
def reporting_changed_inputs(files: Sequence[InputFile]) -> Iterator[None]:
    """A failure while inputs changed under the run (a truncated range, a damaged frame, a
    removed file) is reported as InputChangedError, naming every changed file."""
    try:
        yield
    except Exception as exc:
        changes = changed_inputs(files)
        if changes:
            raise input_changed_error(changes) from exc
        raise


def check_unchanged(files: Sequence[InputFile]) -> None:
    """Raise InputChangedError when an input differs from its listing."""
    changes = changed_inputs(files)
    if changes:
        raise input_changed_error(changes)
