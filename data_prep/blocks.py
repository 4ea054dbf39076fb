"""Cut the input files into work units ("blocks") in a fixed order that depends on nothing but the
files and ``block_bytes`` -- never on the number of workers -- so the output is the same for any
worker count, and a resumed run can start again at any block.

* uncompressed JSONL / text lines: a byte range ending at a line end (the worker reads it);
* zstd of several frames: consecutive whole frames (found from the frame headers, see
  :mod:`data_prep.zstd_frames`) of about ``block_bytes`` decompressed; lines that cross a frame
  boundary are handled by the worker (:mod:`data_prep.parts`);
* gzip, and zstd of a single frame: the whole file (gzip members cannot be found without
  decompressing); the worker streams it in parts of ``block_bytes``;
* parquet: one row group;
* plain text, one document per file: consecutive files up to ``block_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple

from data_prep.decompress import unreadable_parquet
from data_prep.errors import ConfigError
from data_prep.inputs import InputFile


@dataclass
class Block:
    index: int
    """Position in the run's block sequence (0-based)."""
    file_index: int
    """Index of the (first) input file of the block."""
    path: str
    """That file's path."""
    fmt: str
    """jsonl, text_lines, text_files or parquet."""
    start: int = 0
    """Byte offset (range and compressed blocks) or row-group index (parquet)."""
    end: int = 0
    """End byte offset (range and compressed blocks); 0 otherwise."""
    compression: str = ""
    """'' (a byte range of the file), gz or zst (start/end are then compressed offsets)."""
    files: Tuple[Tuple[str, str], ...] = ()
    """text_files blocks: (path, compression) of every file, each one document."""
    at_file_end: bool = True
    """The block ends its file (an unterminated last line there may be truncated)."""
    first_line: int = 0
    """Line (row) number of the block's first record when known here; 0 = counted by the writer."""
    input_bytes: int = 0
    """Input bytes this block accounts for (compressed bytes for compressed files)."""


def _range_blocks(file: InputFile, block_bytes: int) -> Iterator[Tuple[int, int]]:
    with open(file.path, "rb") as handle:
        start = 0
        while start < file.size:
            target = start + block_bytes
            if target >= file.size:
                end = file.size
            else:
                handle.seek(target - 1)
                handle.readline()
                end = handle.tell()
            yield start, end
            start = end


ESTIMATED_RATIO = 4
"""Decompressed / compressed bytes assumed for frames whose header gives no content size."""


def _frame_groups(file: InputFile, block_bytes: int) -> Iterator[Tuple[int, int]]:
    """(start, end) compressed offsets of runs of whole zstd frames of about ``block_bytes``
    decompressed; the whole file for gzip or a single frame."""
    if file.compression != "zst":
        yield 0, file.size
        return
    from data_prep.zstd_frames import frame_spans

    start, estimate = 0, 0
    for span in frame_spans(file.path):
        size = span.content_size if span.content_size >= 0 else (span.end - span.start) * ESTIMATED_RATIO
        estimate += size
        if estimate >= block_bytes and span.end < file.size:
            yield start, span.end
            start, estimate = span.end, 0
    yield start, file.size


def _parquet_blocks(file: InputFile, key: str) -> Iterator[Tuple[int, int]]:
    """(row group, first row number) for every row group of a parquet file."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(file.path).metadata
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise unreadable_parquet(file.path, exc) from None
    names = meta.schema.names
    if key not in names:
        raise ConfigError(f"{file.path}: parquet file has no column {key!r} (columns: "
                          f"{', '.join(names)}); set text_key=<column>")
    row = 1
    for group in range(meta.num_row_groups):
        yield group, row
        row += meta.row_group(group).num_rows


def _file_blocks(fi: int, file: InputFile, key: str, block_bytes: int) -> Iterator[Block]:
    """Blocks of one line-oriented or parquet file (indices filled in by iter_blocks)."""
    fmt = "jsonl" if file.format == "jsonl" else ("parquet" if file.format == "parquet" else "text_lines")
    if fmt == "parquet":
        groups = list(_parquet_blocks(file, key))
        for group, row in groups:
            share = file.size // max(1, len(groups))
            yield Block(-1, fi, file.path, fmt, start=group, first_line=row, input_bytes=share)
    elif file.compression:
        for start, end in _frame_groups(file, block_bytes):
            yield Block(-1, fi, file.path, fmt, start=start, end=end, compression=file.compression,
                        at_file_end=end == file.size, input_bytes=end - start)
    else:
        for start, end in _range_blocks(file, block_bytes):
            yield Block(-1, fi, file.path, fmt, start=start, end=end, at_file_end=end == file.size,
                        input_bytes=end - start)


def iter_blocks(files: Sequence[InputFile], key: str, text_unit: str, block_bytes: int) -> Iterator[Block]:
    """Every block of ``files`` in output order, numbered from 0."""
    index, group, group_bytes = 0, [], 0

    def flush() -> Block:
        first = group[0][0]
        return Block(-1, first, files[first].path, "text_files", input_bytes=group_bytes,
                     files=tuple((files[i].path, files[i].compression) for i, _ in group))

    for fi, file in enumerate(files):
        if file.format == "text" and text_unit == "file":
            if group and group_bytes + file.size > block_bytes:
                block, group, group_bytes = flush(), [], 0
                block.index, index = index, index + 1
                yield block
            group.append((fi, file))
            group_bytes += file.size
            continue
        if group:
            block, group, group_bytes = flush(), [], 0
            block.index, index = index, index + 1
            yield block
        for block in _file_blocks(fi, file, key, block_bytes):
            block.index, index = index, index + 1
            yield block
    if group:
        block = flush()
        block.index = index
        yield block


def block_paths(block: Block) -> List[str]:
    return [p for p, _ in block.files] if block.files else [block.path]
