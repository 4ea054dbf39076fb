"""What a worker reads for one block: the block's records as "parts" of at most about
``part_bytes`` input bytes, each ending at a line end, in order.

* A byte range of an uncompressed file is one part (the range already ends at a line end).
* A compressed block (a run of zstd frames, or a whole gzip / single-frame zstd file) is streamed
  and cut into parts at the first line end after every ``part_bytes`` decompressed bytes, so a
  worker holds one part at a time however large the file is.

Lines may cross the boundary between two compressed blocks. A block owns the lines that *start*
after its first byte and at or before its end (positions in the decompressed stream), so every
line belongs to exactly one block and no worker needs bytes before its block: a block that does not
start its file drops everything up to its first line end (that line belongs to the block before),
and after its last byte it reads on into the next frames until the line that is open (or that
starts exactly there) ends. The cuts depend only on the file and ``part_bytes``, never on which
worker reads, so the output is the same for any number of workers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import BinaryIO, Iterator, List, Tuple

from data_prep.blocks import Block
from data_prep.decompress import checked_reader
from data_prep.inputs import input_changed_error


@dataclass
class Part:
    data: bytes
    """Whole lines (the last one unterminated only at the end of the file)."""
    at_file_end: bool
    """The data ends where the file ends."""
    input_bytes: int
    """Input bytes of the block this part accounts for (compressed bytes when compressed)."""


class _Window:
    """Reads of an open file that stop at offset ``end``; ``tell`` is the file offset."""

    def __init__(self, handle: BinaryIO, end: int) -> None:
        self.handle, self.end = handle, end

    def read(self, size: int = -1) -> bytes:
        left = self.end - self.handle.tell()
        size = left if size < 0 else min(size, left)
        return self.handle.read(size) if size > 0 else b""

    def tell(self) -> int:
        return self.handle.tell()


def _read_exact(reader, size: int) -> bytes:
    """``size`` bytes, fewer only at the end of the stream (so cuts never depend on buffering)."""
    parts, wanted = [], size
    while wanted > 0:
        part = reader.read(wanted)
        if not part:
            break
        parts.append(part)
        wanted -= len(part)
    return b"".join(parts)


TAIL_READ_BYTES = 64 * 1024
"""Decompressed bytes read at a time while looking for the end of the line open at a block's end."""


def _rest_of_line(block: Block) -> Tuple[bytes, bool]:
    """The decompressed bytes after the block's end up to and including the first line end, and
    whether the file ended first."""
    with open(block.path, "rb") as raw:
        raw.seek(block.end)
        reader = checked_reader(raw, block.path, block.compression)
        pieces: List[bytes] = []
        while True:
            chunk = reader.read(TAIL_READ_BYTES)
            if not chunk:
                return b"".join(pieces), True
            cut = chunk.find(b"\n")
            if cut >= 0:
                pieces.append(chunk[:cut + 1])
                return b"".join(pieces), False
            pieces.append(chunk)


def _owned_chunks(block: Block, raw: BinaryIO, part_bytes: int) -> Iterator[Tuple[bytes, int]]:
    """(bytes of whole owned lines, file offset read so far) for the block's own frames; the
    open line at the end comes last, completed from the frames after the block."""
    reader = checked_reader(_Window(raw, block.end), block.path, block.compression)
    skipping, carry = block.start > 0, b""
    while True:
        chunk = _read_exact(reader, part_bytes)
        if not chunk:
            break
        if skipping:
            cut = chunk.find(b"\n")
            if cut < 0:
                continue
            chunk, skipping = chunk[cut + 1:], False
        buffer = carry + chunk
        cut = buffer.rfind(b"\n") + 1
        if cut:
            yield buffer[:cut], raw.tell()
        carry = buffer[cut:]
    if skipping or block.end >= os.fstat(raw.fileno()).st_size:
        yield carry, block.end
        return
    rest, _ = _rest_of_line(block)
    yield carry + rest, block.end


def _compressed_parts(block: Block, part_bytes: int) -> Iterator[Part]:
    with open(block.path, "rb") as raw:
        raw.seek(block.start)
        accounted = block.start
        for data, offset in _owned_chunks(block, raw, part_bytes):
            offset = min(offset, block.end)
            yield Part(data, False, offset - accounted)
            accounted = offset


def iter_parts(block: Block, part_bytes: int) -> Iterator[Tuple[Part, bool]]:
    """(part, is the block's last part) for a line-oriented block (jsonl / text_lines)."""
    if not block.compression:
        with open(block.path, "rb") as handle:
            handle.seek(block.start)
            data = handle.read(block.end - block.start)
        if len(data) < block.end - block.start:  # the file was truncated since it was listed
            raise input_changed_error([f"{block.path}: bytes {block.start:,}-{block.end:,} were "
                                       f"listed, the file ends at {os.path.getsize(block.path):,} now"])
        yield Part(data, block.at_file_end, block.input_bytes), True
        return
    previous = None
    for part in _compressed_parts(block, part_bytes):
        if previous is not None:
            yield previous, False
        previous = part
    previous.at_file_end = not previous.data.endswith(b"\n") or block.at_file_end
    yield previous, True
