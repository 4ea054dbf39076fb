"""Cut the input files into work units ("blocks") in a fixed order that depends on nothing but the
files and ``block_bytes`` -- never on the number of workers -- so the output is the same for any
worker count, and a resumed run can start again at any block.

* uncompressed JSONL / text lines: a byte range ending at a line end (the worker reads it);
* gzip / zstd: the decompressed bytes, cut at a line end (streamed, one block in memory at a time);
* parquet: one row group;
* plain text, one document per file: consecutive files up to ``block_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

from data_prep.decompress import checked_reader, unreadable_parquet
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
    """Byte offset (range blocks) or row-group index (parquet)."""
    end: int = 0
    """End byte offset (range blocks); 0 otherwise."""
    data: Optional[bytes] = None
    """Decompressed bytes (compressed inputs); None when the worker reads the file itself."""
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


def _stream_chunks(file: InputFile, block_bytes: int) -> Iterator[Tuple[bytes, int]]:
    """(bytes ending at a line end, compressed bytes consumed) from a compressed file; a truncated
    or corrupt file raises CorruptInputError before its last bytes are yielded."""
    with open(file.path, "rb") as raw:
        reader = checked_reader(raw, file.path, file.compression)
        carry, consumed = b"", 0
        while True:
            chunk = _read_exact(reader, block_bytes)
            buffer = carry + chunk
            cut = buffer.rfind(b"\n") + 1 if chunk else len(buffer)
            if cut:
                position = raw.tell()
                yield buffer[:cut], max(0, position - consumed)
                consumed = max(consumed, position)
            carry = buffer[cut:]
            if not chunk:
                return


def _with_last_flag(chunks: Iterator) -> Iterator[Tuple[object, bool]]:
    previous, have = None, False
    for item in chunks:
        if have:
            yield previous, False
        previous, have = item, True
    if have:
        yield previous, True


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
        for (data, consumed), last in _with_last_flag(_stream_chunks(file, block_bytes)):
            yield Block(-1, fi, file.path, fmt, data=data, at_file_end=last, input_bytes=consumed)
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


def read_block_bytes(block: Block) -> bytes:
    """The bytes of a range or decompressed block."""
    if block.data is not None:
        return block.data
    with open(block.path, "rb") as handle:
        handle.seek(block.start)
        return handle.read(block.end - block.start)


def block_paths(block: Block) -> List[str]:
    return [p for p, _ in block.files] if block.files else [block.path]
