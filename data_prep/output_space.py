"""The output's filesystem during a run: a warning as soon as the shards still to come will not
fit, and a full disk (or quota) reported as such.

The output's size is projected from what this run has tokenized so far: bytes out (tokens times
the dtype's size, plus :data:`INDEX_BYTES_PER_DOCUMENT` of ``.idx`` per document) per input byte,
times the input bytes still to come. The free space is asked at most every
:attr:`OutputSpace.check_every_s` seconds (one ``statvfs``), so the warning costs nothing
measurable and comes within the first block of a terabyte run, not hours later at the failure.

A write that fails with ENOSPC or EDQUOT, in this process (``.idx``, the manifest) or in a worker
(its tokens, written into the shard with ``pwrite``), becomes :class:`OutputFullError`: it names
the directory and its free space, the shards kept, the space the rest still needs and how to go
on. The open shard is removed as on any failure (:meth:`data_prep.assembler.ShardAssembler.abort`),
so a re-run resumes after the last committed shard.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, List

from data_prep.errors import DataPrepError
from data_prep.stats import Stats
from launcher.core.diskspace import filesystem_usage, free_space_text, human_bytes, no_space_cause

INDEX_BYTES_PER_DOCUMENT = 20
"""``.idx`` bytes per document in a Megatron indexed dataset: its length (int32), its pointer
(int64) and its document index (int64)."""


class OutputFullError(DataPrepError):
    """The output's filesystem or quota filled up; committed shards are kept (exit code 1)."""


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class OutputSpace:
    """Watches the free space under ``out_dir`` against the output this run still has to write.

    ``stem`` is the shards' name (``name=``), ``total_input`` the input bytes of the run (of
    this array task), ``itemsize`` the bytes of one token in the shards, ``kept_shards`` and
    ``kept_input`` the shards a resumed run keeps and the input bytes they hold. ``warn`` shows
    the warning (the progress bar's console).
    """

    check_every_s = 2.0

    def __init__(self, out_dir: str, stem: str, total_input: int, itemsize: int,
                 kept_shards: int = 0, kept_input: int = 0,
                 warn: Callable[[str], None] = _stderr) -> None:
        self.out_dir, self.stem, self.itemsize, self.warn = out_dir, stem, itemsize, warn
        self.total_input = total_input
        self.committed_shards, self.committed_input = kept_shards, kept_input
        self.done_before = kept_input  # input bytes in the shards a resume kept
        self.seen_input = self.seen_output = 0
        self.warned = False
        self.next_check = 0.0

    def output_per_input_byte(self) -> float:
        """Shard bytes written per input byte by this run so far (0 before its first part)."""
        return self.seen_output / self.seen_input if self.seen_input else 0.0

    def observe(self, stats: Stats) -> None:
        """Count a tokenized part; warn once when the projected rest exceeds the free space."""
        self.seen_input += stats.input_bytes
        self.seen_output += stats.tokens * self.itemsize + stats.documents * INDEX_BYTES_PER_DOCUMENT
        now = time.monotonic()
        if self.warned or not self.seen_output or now < self.next_check:
            return
        self.next_check = now + self.check_every_s
        usage = filesystem_usage(self.out_dir)
        to_come = self.total_input - self.done_before - self.seen_input
        needed = int(self.output_per_input_byte() * max(0, to_come))
        if usage is not None and needed > usage.free:
            self.warned = True
            self.warn(f"data_prep: warning: the rest of the output needs about "
                      f"{human_bytes(needed)} ({self.output_per_input_byte():.2f} bytes per input "
                      f"byte so far, {human_bytes(to_come)} of input to go) but {self.out_dir} has "
                      f"{human_bytes(usage.free)} free; the run will stop when the disk is full, "
                      "keeping its committed shards. Free space now, or re-run the same command "
                      "after freeing it: it resumes after the last committed shard")

    def committed(self, entries: List[dict]) -> None:
        """The committed shards so far (kept ones included), after each commit: only the new
        entries are added up (a task can commit thousands of shards)."""
        self.committed_input += sum(e["stats"].get("input_bytes", 0)
                                    for e in entries[self.committed_shards:])
        self.committed_shards = len(entries)

    def full_error(self, exc: OSError) -> OutputFullError:
        """The OutputFullError for ``exc``, a write that found no space left."""
        rest = max(0, self.total_input - self.committed_input)
        ratio = self.output_per_input_byte()
        needed = (f"the rest ({human_bytes(rest)} of input) needs about "
                  f"{human_bytes(ratio * rest)} more at {ratio:.2f} bytes per input byte"
                  if ratio else f"{human_bytes(rest)} of input is still to tokenize")
        kept = (f"{self.committed_shards} committed shard(s) are kept "
                f"({self.committed_input / max(1, self.total_input):.0%} of the input)"
                if self.committed_shards else "no shard was committed")
        return OutputFullError(
            f"no space left under {self.out_dir} ({free_space_text(self.out_dir)}): {kept}; "
            f"{needed}. Free space there and re-run the same command, or move the directory to a "
            f"larger filesystem and re-run with output=<its new path> name={self.stem}: either "
            f"resumes after the last committed shard ({type(exc).__name__}: {exc})")

    @contextlib.contextmanager
    def reporting_full_disk(self) -> Iterator["OutputSpace"]:
        """Turn an exception that means 'no space left' into :meth:`full_error`."""
        try:
            yield self
        except Exception as exc:
            cause = no_space_cause(exc)
            if cause is not None:
                raise self.full_error(cause) from exc
            raise
