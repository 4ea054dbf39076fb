"""Consume part results in order: number lines, count reasons, fill and commit shards."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from data_prep.blocks import Block
from data_prep.errors import BadDataError
from data_prep.records import BAD_REASONS
from data_prep.shards import ShardWriter
from data_prep.stats import Stats
from data_prep.worker import PartResult

LINE_FORMATS = ("jsonl", "text_lines")


class ShardAssembler:
    """Appends results to the open shard and commits it once it reaches the size limit.

    ``on_commit(entries)`` runs after every commit (it rewrites the manifest), and once before
    the run's first shard file is created. ``placer`` (the
    worker pool) writes the ids of parts that arrive without them (:mod:`data_prep.held_parts`). Shards close only
    at part boundaries (a block is one part unless it is a large compressed one), so a resumed run
    restarts at the part after the last committed shard.
    """

    def __init__(self, out_dir: str, stem: str, dtype, limits: tuple, examples: int,
                 kept: List[dict], resume: tuple, on_commit: Callable[[List[dict]], None],
                 placer=None) -> None:
        self.out_dir, self.stem, self.dtype = out_dir, stem, dtype
        self.shard_tokens, self.shard_bytes = limits
        self.examples_limit = examples
        self.entries = list(kept)
        self.next_block, self.next_part, last_file, last_lines = resume
        self.lines: Dict[int, int] = {last_file: last_lines} if last_file >= 0 else {}
        self.last_file = last_file
        self.on_commit = on_commit
        self.placer = placer
        self.writer: Optional[ShardWriter] = None
        self.shard_stats = Stats()
        self.first_block = self.next_block
        self.announced = False
        """Whether this run has written its manifest yet: it does before it creates its first
        shard file, so a run killed at any moment leaves no shard file that a manifest with its
        fingerprint does not account for (a re-run removes such leftovers as its own)."""

    def _block_stats(self, block: Block, result: PartResult) -> Stats:
        offset = self.lines.get(block.file_index, 0) if block.fmt in LINE_FORMATS else 0
        if block.fmt in LINE_FORMATS:
            self.lines[block.file_index] = offset + result.lines
        if result.failure:
            path, line, reason, detail = result.failure
            raise BadDataError(f"{path}:{line + offset}: {reason}: {detail} (strict=true stops at the "
                               "first bad record; fix the record or drop strict=true to skip it)")
        stats = Stats(len(result.lengths), result.token_count, result.input_bytes, result.text_bytes,
                      result.counts)
        for reason, found in result.examples.items():
            if reason in BAD_REASONS:
                stats.add_examples(reason, [f"{p}:{n + offset}: {d}" for p, n, d in found],
                                   self.examples_limit)
        return stats

    def consume(self, block: Block, result: PartResult) -> Stats:
        stats = self._block_stats(block, result)
        self.last_file = block.file_index + max(len(block.files), 1) - 1
        if len(result.lengths):
            if self.writer is None:
                if not self.announced:  # the manifest (fingerprint, kept shards) comes first
                    self.on_commit(self.entries)
                    self.announced = True
                prefix = f"{self.stem}_{len(self.entries):05d}"
                settle = self.placer.settle if self.placer is not None else (lambda path: None)
                self.writer = ShardWriter(self.out_dir, prefix, self.dtype, settle)
            if result.tokens is None:
                self.writer.add_placed(result.token_count, result.crc32, result.lengths,
                                       lambda path, offset: self.placer.place(result, path, offset))
            else:
                self.writer.add(result.tokens, result.lengths)
        self.shard_stats.merge(stats, self.examples_limit)
        self.next_block, self.next_part = (block.index + 1, 0) if result.last else (block.index, result.part + 1)
        if self.writer is not None and self._full():
            self._commit()
        return stats

    def _full(self) -> bool:
        return bool((self.shard_tokens and self.writer.tokens >= self.shard_tokens)
                    or (self.shard_bytes and self.writer.bin_bytes >= self.shard_bytes))

    def _commit(self) -> None:
        entry = self.writer.commit()
        entry.update({"first_block": self.first_block, "next_block": self.next_block,
                      "next_part": self.next_part,
                      "last_file": self.last_file, "last_file_lines": self.lines.get(self.last_file, 0),
                      "stats": self.shard_stats.to_dict()})
        self.entries.append(entry)
        self.writer, self.shard_stats, self.first_block = None, Stats(), self.next_block
        self.on_commit(self.entries)

    def finish(self) -> Stats:
        """Commit the open shard; returns the stats of trailing blocks that held no document."""
        if self.writer is not None:
            self._commit()
        return self.shard_stats

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abandon()
            self.writer = None


def total_stats(entries: List[dict], trailing: Stats, limit: int) -> Stats:
    totals = Stats()
    for entry in entries:
        totals.merge(Stats.from_dict(entry["stats"]), limit)
    totals.merge(trailing, limit)
    return totals
