"""Where the frames of a zstd file begin and end, from their headers alone (no decompression).

A file of several frames (``pzstd``, concatenated ``.zst`` files, multi-frame writers) can be cut
between frames into blocks that workers decompress independently. The walk reads each frame's
header and each block's 3-byte header and seeks over the block bodies (format: RFC 8878). A file
whose bytes do not walk cleanly (damage, truncation) ends in one last span from the first bad
frame to the end of the file: the worker's decoder then reports the damage, naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, List, Optional, Tuple

FRAME_MAGIC = 0xFD2FB528
SKIPPABLE_MAGIC, SKIPPABLE_MASK = 0x184D2A50, 0xFFFFFFF0
_DICT_ID_BYTES = (0, 1, 2, 4)
_CONTENT_SIZE_BYTES = (0, 2, 4, 8)
RESERVED_BLOCK_TYPE, RLE_BLOCK_TYPE = 3, 1


@dataclass(frozen=True)
class FrameSpan:
    start: int
    """Offset of the frame's first byte."""
    end: int
    """Offset after its last byte."""
    content_size: int
    """Decompressed bytes when the header says so, 0 for skippable frames, else -1."""


def _header(handle: BinaryIO, start: int) -> Optional[Tuple[int, int, bool]]:
    """(offset of the first block, content size or -1, has checksum) of the frame at ``start``."""
    handle.seek(start + 4)
    descriptor = handle.read(1)
    if not descriptor:
        return None
    flags = descriptor[0]
    single_segment, checksum = bool(flags & 0x20), bool(flags & 0x04)
    size_bytes = _CONTENT_SIZE_BYTES[flags >> 6] or (1 if single_segment else 0)
    skip = (0 if single_segment else 1) + _DICT_ID_BYTES[flags & 3]
    handle.seek(start + 5 + skip)
    field = handle.read(size_bytes)
    if len(field) < size_bytes:
        return None
    content = int.from_bytes(field, "little") + (256 if size_bytes == 2 else 0) if size_bytes else -1
    return start + 5 + skip + size_bytes, content, checksum


def _frame_end(handle: BinaryIO, start: int, file_size: int) -> Optional[Tuple[int, int]]:
    """(end offset, content size) of the zstd frame at ``start``; None when it does not walk."""
    header = _header(handle, start)
    if header is None:
        return None
    position, content, checksum = header
    while True:
        handle.seek(position)
        raw = handle.read(3)
        if len(raw) < 3:
            return None
        value = int.from_bytes(raw, "little")
        kind = (value >> 1) & 3
        if kind == RESERVED_BLOCK_TYPE:
            return None
        position += 3 + (1 if kind == RLE_BLOCK_TYPE else value >> 3)
        if position > file_size:
            return None
        if value & 1:
            end = position + (4 if checksum else 0)
            return (end, content) if end <= file_size else None


def frame_spans(path: str) -> List[FrameSpan]:
    """Every frame of the zstd file ``path`` in order; see the module docstring for damage."""
    spans: List[FrameSpan] = []
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        position = 0
        while position < size:
            handle.seek(position)
            head = handle.read(8)
            magic = int.from_bytes(head[:4], "little") if len(head) >= 4 else -1
            found: Optional[Tuple[int, int]] = None
            if magic >= 0 and magic & SKIPPABLE_MASK == SKIPPABLE_MAGIC and len(head) == 8:
                end = position + 8 + int.from_bytes(head[4:8], "little")
                found = (end, 0) if end <= size else None
            elif magic == FRAME_MAGIC:
                found = _frame_end(handle, position, size)
            if found is None:
                spans.append(FrameSpan(position, size, -1))
                return spans
            spans.append(FrameSpan(position, found[0], found[1]))
            position = found[0]
    return spans
