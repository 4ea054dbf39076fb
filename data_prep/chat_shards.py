"""The shards of ``data_prep format=chat``: packed rows of conversations, each shard a token and a
mask indexed dataset (``<stem>_<NNNNN>`` and ``<stem>_<NNNNN>.mask``), written by
:class:`data_prep.shards.ShardWriter` (temp, fsync, rename), cut at ``shard_bytes``; and what a
re-run keeps of an interrupted run's shards (:func:`intact_prefix`)."""

from __future__ import annotations

import os
from typing import List, Optional

import numpy as np

from data_prep.manifest import shard_files, shard_problem

MASK_FIELDS = ("bin_bytes", "idx_bytes", "bin_crc32", "idx_crc32")


class ChatShards:
    """Shards of packed rows; ``entries`` are the committed ones (those kept first)."""

    def __init__(self, out_dir: str, stem: str, dtype, shard_bytes: int,
                 kept: Optional[List[dict]] = None):
        self.out_dir, self.stem, self.dtype, self.shard_bytes = out_dir, stem, dtype, shard_bytes
        self.entries: List[dict] = list(kept or [])
        self._open: Optional[tuple] = None

    def _writers(self) -> tuple:
        from data_prep.shards import ShardWriter

        if self._open is None:
            prefix = f"{self.stem}_{len(self.entries):05d}"
            self._open = (ShardWriter(self.out_dir, prefix, self.dtype),
                          ShardWriter(self.out_dir, prefix + ".mask", np.uint8))
        return self._open

    def add(self, samples: list, rows: List[List[int]]) -> None:
        """Rows of ``samples`` (indices), each row's samples back to back."""
        tokens, masks = self._writers()
        order = [i for row in rows for i in row]
        lengths = np.array([len(samples[i].ids) for i in order], dtype=np.int32)
        sizes = np.array([len(row) for row in rows], dtype=np.int64)
        tokens.add_rows(np.concatenate([samples[i].ids for i in order]), lengths, sizes)
        masks.add_rows(np.concatenate([samples[i].mask for i in order]), lengths, sizes)

    @property
    def full(self) -> bool:
        """The open shard reached ``shard_bytes``."""
        return bool(self._open and self.shard_bytes
                    and self._open[0].bin_bytes >= self.shard_bytes)

    def commit(self, **extra) -> Optional[dict]:
        """Make the open shard final; its manifest entry (with ``extra``), or None."""
        if self._open is None:
            return None
        tokens, masks = self._open
        self._open = None
        entry, mask_entry = tokens.commit(), masks.commit()
        entry.update(samples=entry.pop("documents"), rows=int(sum(map(len, tokens._row_sizes))),
                     mask={k: mask_entry[k] for k in MASK_FIELDS}, **extra)
        self.entries.append(entry)
        return entry

    def abandon(self) -> None:
        if self._open is not None:
            for writer in self._open:
                writer.abandon()
            self._open = None


def entry_problem(out_dir: str, entry: dict) -> str:
    """What is wrong with a chat shard's four files against its entry; "" when nothing is."""
    return shard_problem(out_dir, entry) or shard_problem(
        out_dir, {"prefix": entry["prefix"] + ".mask", **entry["mask"]})


def intact_prefix(out_dir: str, entries: List[dict]) -> List[dict]:
    """The leading entries whose files are whole (a re-run resumes after the last of them)."""
    kept = []
    for entry in entries:
        if entry_problem(out_dir, entry):
            break
        kept.append(entry)
    return kept


def remove_other_files(out_dir: str, stem: str, kept: List[dict]) -> None:
    """Delete every shard file of ``stem`` that no kept entry names (an interrupted run's
    shard in progress, or a replaced run's): no final name holds what the manifest does not
    list."""
    names = {os.path.join(out_dir, f"{e['prefix']}{suffix}") for e in kept
             for suffix in (".bin", ".idx", ".mask.bin", ".mask.idx")}
    for path in shard_files(out_dir, stem):
        if path not in names:
            os.unlink(path)
